"""The engines of a chaos run, who serves, and what each fault cost: the bookkeeping of :mod:`.chaos_loop`.

An engine moves through these states (the driver changes them; nothing here touches a process)::

    starting  ->  joining  ->  serving  ->  left     (shrink: it leaves on purpose)
                     |            |
                     +------------+------>  dead     (killed, or fenced after a stall: its processes killed)

``starting``: its process is coming up (grow, or the replacement of a dead one). ``joining``: up, in
the refit group, at the initial weights: the next refit catches it up, and it serves only once its
weights are digest-equal to a serving peer at the committed version. Only ``serving`` engines get
prompts.

>>> assign(10, ["e0", "e2"])
{'e0': (0, 5), 'e2': (5, 10)}
>>> assign(3, ["e0", "e1", "e2", "e3"])
{'e0': (0, 1), 'e1': (1, 2), 'e2': (2, 3)}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

STARTING, JOINING, SERVING, DEAD, LEFT = "starting", "joining", "serving", "dead", "left"
IN_GROUP = (JOINING, SERVING)  # the engines a refit sends to


def assign(num_prompts: int, engines: list[str]) -> dict[str, tuple[int, int]]:
    """Prompts ``0..num_prompts-1`` split into contiguous runs over ``engines`` (the first ones take one
    more where it does not divide; an engine with nothing to do is left out)."""
    if not engines:
        raise ValueError("no engine serves: nothing to assign the prompts to")
    base, extra = divmod(num_prompts, len(engines))
    out, start = {}, 0
    for i, key in enumerate(engines):
        size = base + (i < extra)
        if size:
            out[key] = (start, start + size)
        start += size
    return out


@dataclass
class EngineSlot:
    """One engine of the run: its name (``e0``, ``e1``, ... never reused), actor handle, state, the version
    it holds, and when it reached each state (seconds since the run's start)."""

    key: str
    actor: Any = None
    state: str = STARTING
    version: str | None = None
    tp: int = 1
    since: dict[str, float] = field(default_factory=dict)
    workers: list[int] = field(default_factory=list)  # its vLLM workers' pids
    reason: str = ""  # why it is dead or left
    record: Any = None  # the FaultRecord it came up for (a replacement, a grow), done once it serves


@dataclass
class FaultRecord:
    """One injected fault or membership change and what it cost (seconds since the run's start).

    ``detected``: when the loop saw it (an error or a timeout; membership: when it was asked for);
    ``recovered``: when the capacity was back (a replacement serving, a refit committed, the new
    engine serving, the leaver gone). ``steps_lost``: updates thrown away (the loop redoes the
    generation of a dead engine's prompts and retries a failed refit, so none is)."""

    kind: str
    step: int
    target: str
    injected: float
    detected: float | None = None
    recovered: float | None = None
    outcome: str = ""
    steps_lost: int = 0
    detail: str = ""

    @property
    def detection_s(self) -> float | None:
        return None if self.detected is None else self.detected - self.injected

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered is None or self.detected is None else self.recovered - self.detected

    def to_json(self) -> dict:
        return {**asdict(self), "detection_s": self.detection_s, "recovery_s": self.recovery_s}


@dataclass
class Fleet:
    """Every engine of a run, by key, in the order they joined the refit group."""

    slots: list[EngineSlot] = field(default_factory=list)

    def add(self, actor: Any, tp: int, now: float, state: str = STARTING) -> EngineSlot:
        slot = EngineSlot(f"e{len(self.slots)}", actor, state, tp=tp, since={state: now})
        self.slots.append(slot)
        return slot

    def set(self, slot: EngineSlot, state: str, now: float, reason: str = "") -> None:
        slot.state = state
        slot.since[state] = now
        if reason:
            slot.reason = reason

    def where(self, *states: str) -> list[EngineSlot]:
        return [s for s in self.slots if s.state in states]

    def serving(self) -> list[EngineSlot]:
        return self.where(SERVING)

    def group(self) -> list[EngineSlot]:
        """The engines a refit sends to, in refit-rank order."""
        return self.where(*IN_GROUP)

    def by_key(self, key: str) -> EngineSlot:
        return next(s for s in self.slots if s.key == key)


__all__ = ["DEAD", "IN_GROUP", "JOINING", "LEFT", "SERVING", "STARTING", "EngineSlot", "FaultRecord", "Fleet",
           "assign"]
