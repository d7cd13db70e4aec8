"""What both fault suites share: a scenario (a refit with one fault), its outcome, and the figures.

A scenario is one refit from ``sources`` ranks to ``destinations`` ranks with one fault
(:mod:`reshard.execution.faults`, ``"kind@point"``) at one refit rank. Its two drivers:

    fault_suite.py       random small layouts over a standalone gloo group (``bench_faults.py``)
    fault_suite_vllm.py  two trainer ranks refitting a live vLLM engine (``bench_faults_vllm.py``)

Each driver plays a scenario and judges it into an :class:`Outcome`; :func:`summary` counts what
an on-call engineer asks about first (hangs, silent corruptions, torn models: all three should be
0) and times detection and recovery; :func:`print_figures` shows them.

A scenario also belongs to a *family*, the way its refit overlaps the work around it
(:attr:`Scenario.overlap`; docs/overlap.md)::

    family             sources                               destinations
    blocking           refit(v)                              receive in place
    staged receive     refit(v)                              receive="staged": the receive on a thread
                                                             while the rank serves its version
    trainer in flight  refit(v, wait=False), then forward,   receive in place
                       backward and an optimizer step (the
                       guard makes the step wait), wait()
    both               as "trainer in flight"                as "staged receive"

Besides the three counts that must stay 0, a failed refit counts the destinations that *kept
serving the previous version*: alive, ``ready`` at the version they had, their bytes (or, for an
engine, its greedy tokens and digests) equal to it bit for bit. It is judged against the
destinations that should have: every staged destination whose refit failed before it started
putting bytes in place (the put-in-place comes only after the commit), and every in-place one its
session left ``ready`` (no byte reached it). :func:`family_figures` gives the counts per family.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

import numpy as np
from rich.console import Console
from rich.table import Table

from ..execution import faults

KINDS = faults.KINDS  # kill, stall, raise, corrupt
OVERLAPS = ("", "staged", "trainer", "both")  # Scenario.overlap
FAMILIES = {"": "blocking", "staged": "staged receive", "trainer": "trainer in flight", "both": "both"}


@dataclass(frozen=True)
class Scenario:
    """One refit with one fault (``fault`` like ``"kill@transfer round 1"``, at refit rank ``fault_rank``)."""

    index: int
    seed: int  # the gloo suite's random layouts and values (the vLLM suite's model is fixed: 0)
    sources: int
    destinations: int
    fault: str | None
    fault_rank: int
    checksum: bool
    timeout_s: float
    bucket_bytes: int
    first_fault_rank: int | None = None  # a "recovery" scenario: this rank raises first, to start a recovery
    precision: bool = False  # into FP8 engines (gloo suite)
    method: str = "reshard"  # the refit method the session runs (gloo suite)
    # the family (module doc): "" (blocking) here; an OverlapScenario's field, so that a blocking scenario's
    # fields (its records, its pickles) are what they were before families came
    overlap: ClassVar[str] = ""

    def in_family(self, overlap: str) -> "Scenario":
        """This scenario in family ``overlap`` (``""``, ``"staged"``, ``"trainer"``, ``"both"``)."""
        if overlap not in OVERLAPS:
            raise ValueError(f"overlap {overlap!r}: use one of {', '.join(map(repr, OVERLAPS))}")
        base = {f.name: getattr(self, f.name) for f in fields(Scenario)}
        return Scenario(**base) if not overlap else OverlapScenario(**base, overlap=overlap)

    @property
    def staged(self) -> bool:
        """Destinations receive into staging on a thread while they serve (``receive="staged"``)."""
        return self.overlap in ("staged", "both")

    @property
    def in_flight(self) -> bool:
        """Sources refit with ``wait=False`` and step their optimizer while the refit is in flight."""
        return self.overlap in ("trainer", "both")

    @property
    def family(self) -> str:
        return FAMILIES[self.overlap]

    @property
    def world(self) -> int:
        return self.sources + self.destinations

    @property
    def kind(self) -> str | None:
        """The fault's kind (``kill``, ``stall``, ``raise``, ``corrupt``), None without a fault."""
        return self.fault.partition("@")[0] if self.fault else None

    @property
    def point(self) -> str | None:
        """Where the fault fires (``agreement``, ``transfer round 1``, ...), None without a fault."""
        return self.fault.partition("@")[2] if self.fault else None

    def describe(self, side: str | None = None) -> str:
        """One line; ``side`` names the faulty rank's role (the vLLM suite: ``trainer 1``, ``engine``)."""
        first = f" after raise@transfer round 0 on rank {self.first_fault_rank}" if self.first_fault_rank is not None \
            else ""
        role = f" ({side})" if side else ""
        return (f"#{self.index} {self.sources}->{self.destinations} {self.fault or 'no fault'} on rank "
                f"{self.fault_rank}{role}{first}{' checksum' if self.checksum else ''}"
                f"{' fp8' if self.precision else ''}{f' ({self.family})' if self.overlap else ''}"
                f"{f' by {self.method}' if self.method != 'reshard' else ''}")


@dataclass(frozen=True)
class OverlapScenario(Scenario):
    """A scenario whose refit overlaps other work (:meth:`Scenario.in_family`)."""

    overlap: str = "staged"

    def __post_init__(self) -> None:
        if self.overlap not in OVERLAPS[1:]:
            raise ValueError(f"overlap {self.overlap!r}: use one of {', '.join(map(repr, OVERLAPS[1:]))}")


@dataclass
class Outcome:
    """What a scenario came to, as its driver judged it."""

    scenario: Scenario
    fired: bool = False  # the fault fired
    result: str = ""  # committed, recovered, detected at connect, split outcome, hang, ...
    hung: list[int] = field(default_factory=list)  # ranks that never returned within their bound
    silent: int = 0  # committed destinations (or engines) holding wrong bytes
    torn: int = 0  # destinations reported ready (or engines serving) after a failed refit, not whole
    undetected: bool = False  # a corrupt fault fired, yet the refit committed
    detection_s: float | None = None  # fault fired -> the last rank that did not fault raising
    recovery_s: float | None = None  # detection -> the next refit committed
    phase: str | None = None  # the phase the refit failed in (vLLM suite: trainer rank 0's error)
    moved: bool = True  # whether that error says destination bytes may have moved (RefitError.moved)
    late: bool = False  # (vLLM suite) a trainer rank raised later than its bound
    named: bool | None = None  # (vLLM engine kills) both trainer ranks' errors named the killed rank
    engine_restart: bool = False  # (vLLM suite) an engine worker was killed: the engine was replaced
    notes: list[str] = field(default_factory=list)  # what went wrong, in words
    reports: list[dict] = field(default_factory=list)  # (gloo suite) each rank's report: its events
    kept: int = 0  # destinations (engines) that kept serving the previous version after the failed refit
    kept_due: int = 0  # those that should have: had not started putting bytes in place (module doc)
    served: int = 0  # reads (generates) of the live weights while a staged receive was in flight, all checked
    guard_waits: int = 0  # optimizer steps that found the refit in flight and waited for it
    guard_broken: int = 0  # refits in flight that guarded none of the parameters they read (the step would not wait)
    # (vLLM suite) the harness's serving check inside trainer rank 0's refit call, not the trainer's time:
    harness_at: float | None = None  # when it began (time.monotonic())
    harness_s: float = 0.0  # how long it took

    def record(self, side: str | None = None) -> dict:
        """This outcome as JSON-ready data: the scenario described, each rank's events by rank."""
        out = asdict(self)
        out["scenario"] = self.scenario.describe(side)
        out["reports"] = {r["rank"]: r["events"] for r in self.reports}
        return out


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summary(outcomes: list[Outcome], extra: dict | None = None) -> dict:
    """The figures both suites print; ``extra``: a driver's own figures, placed before the outcomes.
    Recovery times leave out scenarios whose engine was replaced (a driver counts those apart)."""
    detection = [o.detection_s for o in outcomes if o.detection_s is not None]
    recovery = [o.recovery_s for o in outcomes if o.recovery_s is not None and not o.engine_restart]
    corrupt = [o for o in outcomes if o.scenario.kind == "corrupt"]
    out = {"scenarios": len(outcomes), "faults fired": sum(o.fired for o in outcomes),
           "hangs": sum(bool(o.hung) for o in outcomes), "silent corruptions": sum(o.silent for o in outcomes),
           "torn models served or committed": sum(o.torn for o in outcomes),
           "corrupt faults fired / undetected (refit committed)":
               f"{sum(o.fired for o in corrupt)} / {sum(o.undetected for o in outcomes)}",
           "detection p50 s": percentile(detection, 50), "detection p95 s": percentile(detection, 95),
           "recovery p50 s": percentile(recovery, 50), "recovery p95 s": percentile(recovery, 95)}
    for kind in KINDS:
        times = [o.detection_s for o in outcomes if o.detection_s is not None and o.scenario.kind == kind]
        out[f"detection p50/p95 s, {kind} ({len(times)})"] = (percentile(times, 50), percentile(times, 95))
    out["kept serving the previous version / should have (failed refits)"] = \
        f"{sum(o.kept for o in outcomes)} / {sum(o.kept_due for o in outcomes)}"
    if any(o.scenario.overlap for o in outcomes):
        out["reads of live weights while a staged receive was in flight (all checked)"] = sum(o.served for o in outcomes)
        out["optimizer steps that waited for a refit in flight / refits with no guard"] = \
            f"{sum(o.guard_waits for o in outcomes)} / {sum(o.guard_broken for o in outcomes)}"
    out.update(extra or {})
    results: dict[str, int] = {}
    for o in outcomes:
        results[o.result] = results.get(o.result, 0) + 1
    out["outcomes"] = dict(sorted(results.items(), key=lambda kv: -kv[1]))
    return out


def print_figures(console: Console, figures: dict, title: str) -> None:
    """:func:`summary`'s figures and what the scenarios came to, as two tables."""
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in figures.items():
        if key == "outcomes":
            continue
        if isinstance(value, tuple):
            value = " / ".join(f"{v:.3f}" for v in value)
        elif isinstance(value, float):
            value = f"{value:.3f}"
        table.add_row(key, str(value))
    console.print(table)
    results = Table(title="what the scenarios came to")
    results.add_column("outcome")
    results.add_column("scenarios", justify="right")
    for key, count in figures["outcomes"].items():
        results.add_row(key, str(count))
    console.print(results)


def bad(outcome: Outcome) -> bool:
    """Whether an outcome is one of the three that must not happen (a hang, a silent corruption, a torn model)."""
    return bool(outcome.hung or outcome.silent or outcome.torn)


def missed(outcome: Outcome) -> bool:
    """Whether the outcome misses an overlap target: a destination that should have kept serving its
    previous version did not, or a refit in flight did not guard the parameters it reads."""
    return outcome.kept < outcome.kept_due or bool(outcome.guard_broken)


def family_figures(outcomes: list[Outcome]) -> dict[str, dict]:
    """Per family (module doc) that has scenarios: the counts the targets are about."""
    out = {}
    for overlap, family in FAMILIES.items():
        mine = [o for o in outcomes if o.scenario.overlap == overlap]
        if not mine:
            continue
        out[family] = {"scenarios": len(mine), "faults fired": sum(o.fired for o in mine),
                       "hangs": sum(bool(o.hung) for o in mine), "silent": sum(o.silent for o in mine),
                       "torn": sum(o.torn for o in mine),
                       "failed refits": sum(not o.result.startswith("committed") for o in mine),
                       "kept serving the previous version": sum(o.kept for o in mine),
                       "  should have (had not started putting bytes in place)": sum(o.kept_due for o in mine),
                       "optimizer steps that waited / unguarded refits": f"{sum(o.guard_waits for o in mine)} / "
                                                                       f"{sum(o.guard_broken for o in mine)}"}
    return out


def print_families(console: Console, families: dict[str, dict], title: str = "per family") -> None:
    """:func:`family_figures` as one table: a row per figure, a column per family."""
    if not families:
        return
    table = Table(title=title)
    table.add_column("figure")
    for family in families:
        table.add_column(family, justify="right")
    for figure in next(iter(families.values())):
        table.add_row(figure, *(str(figures[figure]) for figures in families.values()))
    console.print(table)


__all__ = ["FAMILIES", "KINDS", "OVERLAPS", "Outcome", "OverlapScenario", "Scenario", "bad", "family_figures", "missed", "percentile",
           "print_families", "print_figures", "summary"]
