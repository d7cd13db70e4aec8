"""The executor contract: what every way of running a refit offers, and the checks they share.

Call sequence, on every rank of the group (sources, destinations, colocated ranks)::

    ex = SomeExecutor(plan, group, timeout=...)   # builds this rank's part; no communication
    stats = ex.run(src_buffers, dst_buffers)      # collective: check, agree, move, return RunStats
    stats = ex.run(src_buffers, dst_buffers)      # replay: same plan, new values

``src_buffers`` / ``dst_buffers`` are ``{buffer name: tensor}`` of this rank (empty where the
rank holds none); destination tensors are written in place. Before any byte moves, every rank
checks its buffers against the plan and all ranks compare plan fingerprints
(:func:`agree`): a problem raises :class:`~reshard.tensors.LayoutError` on every rank, naming
the rank at fault, with no destination tensor touched.

Capability flags (class attributes) say what an executor guarantees:

    flag               reshard   gather-broadcast
    needed_bytes_only  yes       no: every destination receives every byte of every tensor
    bounded_staging    yes       no: full tensors are staged on the root and every destination
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Sequence

import torch

from ..layout import Layout
from ..tensors import LayoutError
from .group import Group
from .packing import Buffers


@dataclass
class PhaseStats:
    """What one rank did in one phase of a run."""

    name: str
    seconds: float
    sent_bytes: int
    recv_bytes: int
    local_bytes: int
    peak_staging_bytes: int
    rounds: int
    messages: int


@dataclass
class RunStats:
    """What one rank did in one run: totals over its phases, and each phase.

    >>> a = PhaseStats("network", 1.0, 100, 0, 0, 64, 2, 2)
    >>> b = PhaseStats("NVLink forward", 0.5, 50, 0, 8, 32, 1, 1)
    >>> s = RunStats.of_phases(3, [a, b])
    >>> s.seconds, s.sent_bytes, s.peak_staging_bytes, s.rounds, [p.name for p in s.phases]
    (1.5, 150, 64, 3, ['network', 'NVLink forward'])
    """

    rank: int
    seconds: float
    sent_bytes: int
    recv_bytes: int
    local_bytes: int
    peak_staging_bytes: int
    rounds: int
    messages: int
    phases: list[PhaseStats] = field(default_factory=list)

    @classmethod
    def of_phases(cls, rank: int, phases: Sequence[PhaseStats]) -> "RunStats":
        """Totals of ``phases`` run one after another: times, bytes, rounds and messages add up, the
        staging peak is the largest phase's."""
        return cls(rank, sum(p.seconds for p in phases), sum(p.sent_bytes for p in phases),
                   sum(p.recv_bytes for p in phases), sum(p.local_bytes for p in phases),
                   max((p.peak_staging_bytes for p in phases), default=0), sum(p.rounds for p in phases),
                   sum(p.messages for p in phases), list(phases))


class Executor(ABC):
    """Runs a plan on this rank; every rank of the group builds one and calls :meth:`run` (see module doc)."""

    #: every destination rank receives only the bytes it holds and does not already have
    needed_bytes_only: ClassVar[bool] = True
    #: staging per rank and round stays under the plan's ``max_bucket_bytes`` (plus one copy); an
    #: executor that overlaps rounds says how many it stages at once (reshard: two)
    bounded_staging: ClassVar[bool] = True

    @abstractmethod
    def run(self, src_buffers: Buffers, dst_buffers: Buffers) -> RunStats:
        """Move the bytes; ``dst_buffers`` are written in place. Collective over the group."""


def check_buffers(layout: Layout, rank: int, buffers: Buffers, needed: set[str], side: str) -> str | None:
    """``None`` if ``buffers`` has every buffer in ``needed`` with the layout's shape and dtype, else the problem."""
    for name in sorted(needed):
        shape, dtype = layout.buffer_spec(rank, name)
        t = buffers.get(name)
        if t is None:
            return f"rank {rank}: {side} buffer {name!r} was not given"
        if tuple(t.shape) != shape or t.dtype != dtype:
            return (f"rank {rank}: {side} buffer {name!r} is {tuple(t.shape)} {t.dtype}, the layout says "
                    f"{shape} {dtype}")
    return None


def agree(group: Group, fingerprint: str, error: str | None) -> None:
    """Collective: raise the same LayoutError on every rank if any rank has an error or another plan."""
    seen = group.all_gather_object((group.rank, fingerprint, error))
    errors = [e for _, _, e in seen if e]
    if errors:
        raise LayoutError("; ".join(_grouped(errors)))
    prints = {fp for _, fp, _ in seen}
    if len(prints) > 1:
        detail = ", ".join(f"rank {r}: {fp}" for r, fp, _ in seen)
        raise LayoutError(f"ranks disagree on the plan fingerprint ({detail})")


def _grouped(errors: list[str]) -> list[str]:
    """``"rank 0: X"``, ``"rank 1: X"`` -> ``"ranks 0, 1: X"`` (one line per distinct problem)."""
    by_text: dict[str, list[str]] = {}
    for e in errors:
        head, sep, text = e.partition(": ")
        if sep and head.startswith("rank ") and head[5:].isdigit():
            by_text.setdefault(text, []).append(head[5:])
        else:
            by_text.setdefault(e, [])
    return [text if not ranks else f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}: {text}"
            for text, ranks in by_text.items()]


def device_of(*groups: Mapping[str, torch.Tensor]) -> torch.device:
    """The device of the first buffer given (CPU if none): where staging buffers go."""
    for g in groups:
        for t in g.values():
            return t.device
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (CUDA copies) so that a run's time is its real time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["Executor", "PhaseStats", "RunStats", "agree", "check_buffers", "device_of", "synchronize"]
