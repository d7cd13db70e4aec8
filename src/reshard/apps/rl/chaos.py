"""Chaos schedules for the RL loop: which fault or membership change happens at which step, to whom.

A spec is comma-separated tokens (``reshard rl-demo --chaos SPEC``)::

    KIND@STEP[:TARGET]   at STEP, on TARGET (an engine index, or a trainer rank for trainer kinds;
                         default: drawn from the seed)
    KIND=RATE            at every step, with probability RATE (drawn from the seed)
    seed=N               the seed of every draw (default 0)
    stall=SECONDS        how long a stall lasts (default: longer than any timeout, so it is detected)

Kinds::

    kill-engine     SIGKILL of one worker process of an engine, as its batch starts
    stall-engine    SIGSTOP of an engine's workers (hung but alive) for ``stall`` seconds
    trainer-stall   a trainer rank sleeps inside the next refit (before any byte moves) for ``stall`` s
    trainer-raise   a trainer rank raises inside the next refit
    corrupt         one byte of a trainer rank's first message of the next refit flipped (checksums on)
    grow            a new engine starts and joins
    shrink          an engine leaves on purpose

The schedule is pure and fully drawn at parse time: the same spec and step count give the same
events, so a run can be replayed.

>>> s = parse("kill-engine@3:1,grow@5,seed=7")
>>> [(e.kind, e.step, e.target) for e in s.events(8, engines=2, trainers=2)]
[('kill-engine', 3, 1), ('grow', 5, None)]
>>> parse("kill-engine@x")
Traceback (most recent call last):
...
reshard.apps.rl.chaos.ChaosSpecError: chaos token 'kill-engine@x': STEP must be a whole number >= 0, got 'x'
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

ENGINE_FAULTS = ("kill-engine", "stall-engine")
TRAINER_FAULTS = ("trainer-stall", "trainer-raise", "corrupt")
MEMBERSHIP = ("grow", "shrink")
KINDS = ENGINE_FAULTS + TRAINER_FAULTS + MEMBERSHIP
FOREVER_S = 3600.0  # a stall no timeout waits out


class ChaosSpecError(ValueError):
    """A chaos spec that cannot be read; the message names the token at fault."""


@dataclass(frozen=True)
class Event:
    """One fault or membership change: ``kind`` at the start of ``step`` (trainer kinds: in that step's
    refit) on ``target`` (None: the engine chosen when it happens, for grow: a new one)."""

    kind: str
    step: int
    target: int | None = None

    @property
    def on_trainer(self) -> bool:
        return self.kind in TRAINER_FAULTS


@dataclass(frozen=True)
class ChaosSpec:
    """A parsed spec (see module doc); :meth:`events` draws the schedule of a run."""

    fixed: tuple[Event, ...] = ()
    rates: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    stall_s: float = FOREVER_S

    def events(self, steps: int, *, engines: int, trainers: int) -> list[Event]:
        """Every event of a run of ``steps`` steps, ordered by step (fixed ones first in a step), each
        target drawn where the spec left it open (trainer kinds: a rank; engine faults: an engine
        among ``engines``; the loop maps it onto the engines serving then). Fixed targets out of
        range raise :class:`ChaosSpecError`."""
        rng = random.Random(self.seed)
        out = []
        for e in self.fixed:
            bound = trainers if e.on_trainer else engines
            if e.target is not None and e.kind != "grow" and not 0 <= e.target < max(bound, 1):
                who = "trainer rank" if e.on_trainer else "engine"
                raise ChaosSpecError(f"chaos {e.kind}@{e.step}:{e.target}: there is no {who} {e.target} "
                                     f"({bound} at start)")
            if e.step < steps:
                out.append(e)
        for step in range(1, steps):  # step 0 stays clean: it is every run's baseline
            for kind, rate in sorted(self.rates.items()):
                if rng.random() < rate:
                    out.append(Event(kind, step))
        resolved = []
        for e in sorted(out, key=lambda e: e.step):
            if e.target is None and e.kind != "grow":
                e = Event(e.kind, e.step, rng.randrange(trainers if e.on_trainer else engines))
            resolved.append(e)
        return resolved


def _number(token: str, text: str, what: str, kind=int, low: float = 0):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < low:
        noun = "a whole number" if kind is int else "a number"
        raise ChaosSpecError(f"chaos token {token!r}: {what} must be {noun} >= {low:g}, got {text!r}")
    return value


def parse(spec: str) -> ChaosSpec:
    """The :class:`ChaosSpec` of ``spec`` (see module doc); :class:`ChaosSpecError` names a bad token."""
    fixed, rates, seed, stall_s = [], {}, 0, FOREVER_S
    tokens = [t.strip() for t in spec.split(",") if t.strip()]
    if not tokens:
        raise ChaosSpecError(f"chaos spec {spec!r} is empty: give KIND@STEP[:TARGET] or KIND=RATE tokens "
                             f"(kinds: {', '.join(KINDS)})")
    for token in tokens:
        if "@" in token:
            kind, _, where = token.partition("@")
            step_text, _, target_text = where.partition(":")
            _kind(token, kind)
            step = _number(token, step_text, "STEP")
            target = _number(token, target_text, "TARGET") if target_text else None
            if kind == "grow" and target is not None:
                raise ChaosSpecError(f"chaos token {token!r}: grow starts a new engine; it takes no TARGET")
            fixed.append(Event(kind, step, target))
        elif "=" in token:
            key, _, value = token.partition("=")
            if key == "seed":
                seed = _number(token, value, "the seed")
            elif key == "stall":
                stall_s = _number(token, value, "the stall's seconds", float, low=0.1)
            else:
                _kind(token, key)
                rate = _number(token, value, "RATE", float)
                if rate > 1:
                    raise ChaosSpecError(f"chaos token {token!r}: RATE is a probability per step, 0..1")
                rates[key] = rate
        else:
            raise ChaosSpecError(f"chaos token {token!r}: expected KIND@STEP[:TARGET], KIND=RATE, seed=N or "
                                 f"stall=SECONDS")
    return ChaosSpec(tuple(fixed), rates, seed, stall_s)


def _kind(token: str, kind: str) -> None:
    if kind not in KINDS:
        raise ChaosSpecError(f"chaos token {token!r}: unknown kind {kind!r}; kinds: {', '.join(KINDS)}")


__all__ = ["ENGINE_FAULTS", "FOREVER_S", "KINDS", "MEMBERSHIP", "TRAINER_FAULTS", "ChaosSpec", "ChaosSpecError",
           "Event", "parse"]
