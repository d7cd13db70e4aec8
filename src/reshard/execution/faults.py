"""Fault injection: make one rank fail at one named point of a refit, to test that every rank hears of it.

The points a refit passes, in order (``<phase>`` is ``network``, ``relay``, ``NVLink forward``, or
``transfer`` for a direct plan)::

    connect              a session's rendezvous and layout exchange
    agreement            ranks compare plans and buffer checks, before any byte moves
    <phase> round <j>    after round j's sends are packed, before they are posted
    commit               after the bytes arrived, before the outcome is posted
    recovery             a session rebuilding its group after a failure

A fault is ``kind@point`` for one rank, armed in the process that should fail, by
:func:`arm` or by the environment (``RESHARD_FAULT="kill@network round 1"``, read when the process
first passes a point). Kinds: ``kill`` (the process dies at once, as on SIGKILL), ``stall`` (it
sleeps ``RESHARD_FAULT_STALL_S``, default an hour: past any timeout), ``raise`` (an exception on
that rank), ``corrupt`` (one byte of the round's first packed send is flipped after its checksum
was taken; only at round points). A point matches when the armed point is a prefix of it
(``"network round"`` matches every network round, ``"round 1"`` nothing: give the phase).
Unarmed, a point costs one comparison.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

import torch

KINDS = ("kill", "stall", "raise", "corrupt")


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


@dataclass(frozen=True)
class Fault:
    """``kind`` at the first point whose name starts with ``point``.

    >>> Fault.parse("corrupt@network round 2")
    Fault(kind='corrupt', point='network round 2')
    """

    kind: str
    point: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r}: use one of {', '.join(KINDS)}")
        if not self.point:
            raise ValueError("a fault needs a point (connect, agreement, '<phase> round <j>', commit, recovery)")

    @classmethod
    def parse(cls, text: str) -> "Fault":
        kind, sep, point = text.partition("@")
        if not sep:
            raise ValueError(f"fault {text!r}: expected kind@point, e.g. 'kill@network round 1'")
        return cls(kind.strip(), point.strip())


_armed: Fault | None = None
_env_read = False
_on_fire: Callable[[str], None] | None = None


def arm(fault: Fault | str | None, *, on_fire: Callable[[str], None] | None = None) -> None:
    """Arm ``fault`` in this process (``None`` disarms); ``on_fire(point)`` runs just before it fires
    (a harness records the time)."""
    global _armed, _env_read, _on_fire
    _armed = Fault.parse(fault) if isinstance(fault, str) else fault
    _env_read = True
    _on_fire = on_fire


def armed() -> Fault | None:
    global _armed, _env_read
    if not _env_read:
        _env_read = True
        text = os.environ.get("RESHARD_FAULT")
        _armed = Fault.parse(text) if text else None
    return _armed


def hit(point: str, payload: torch.Tensor | None = None) -> None:
    """Pass ``point``: if the armed fault matches, it fires (once; ``corrupt`` flips a byte of ``payload``)."""
    fault = armed()
    if fault is None or not point.startswith(fault.point):
        return
    on_fire = _on_fire
    if fault.kind == "corrupt":
        if payload is None or payload.numel() == 0:
            return  # nothing sent here: wait for a point that sends
        arm(None)
        if on_fire:
            on_fire(point)
        flat = payload.view(torch.uint8).reshape(-1)
        flat[flat.numel() // 2] ^= 0x5A
        return
    arm(None)
    if on_fire:
        on_fire(point)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "stall":
        time.sleep(float(os.environ.get("RESHARD_FAULT_STALL_S", "3600")))
    else:
        raise InjectedFault(f"injected fault at {point}")


__all__ = ["Fault", "InjectedFault", "KINDS", "arm", "armed", "hit"]
