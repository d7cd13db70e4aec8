"""What a time model answers: an :class:`Estimate` of one refit method, phase by phase, each with
its :class:`Bottleneck`. Every model returns one (:func:`~reshard.modeling.reshard_time.model_time`,
:func:`~reshard.modeling.gather_broadcast.gather_broadcast_time`,
:func:`~reshard.modeling.gather_broadcast.gather_broadcast_fair_time`)."""

from __future__ import annotations

from dataclasses import dataclass

from .traffic import LINK_LABEL


@dataclass(frozen=True)
class Bottleneck:
    """The resource that took longest in a phase: a link of one GPU, its packing or unpacking,
    or a shared host."""

    phase: str
    kind: str  # one of LINKS, "pack", "unpack" or "host"
    where: int  # GPU (or node for "host")
    ranks: tuple[int, ...]
    bytes: float
    seconds: float

    def describe(self) -> str:
        place = f"node {self.where}" if self.kind == "host" else f"GPU {self.where}"
        ranks = ""
        if self.ranks:
            shown = ", ".join(map(str, self.ranks[:4])) + (", ..." if len(self.ranks) > 4 else "")
            ranks = f" (rank{'s' if len(self.ranks) > 1 else ''} {shown})"
        return (f"{place}{ranks} {LINK_LABEL[self.kind]}: {self.bytes / 1e9:.4g} GB, {self.seconds:.4g} s "
                f"in {self.phase}")


@dataclass(frozen=True)
class PhaseEstimate:
    name: str
    rounds: int
    seconds: float  # this phase alone, its rounds one after another
    latency_s: float  # of which fixed per-round / per-call costs
    bottleneck: Bottleneck | None


@dataclass(frozen=True)
class Estimate:
    """Modeled time of one refit method on one topology, with a printable breakdown."""

    method: str
    topology: str
    seconds: float
    phases: tuple[PhaseEstimate, ...]
    pipelined: bool = False
    notes: tuple[str, ...] = ()

    @property
    def bottleneck(self) -> Bottleneck | None:
        """The bottleneck of the phase that took longest."""
        longest = max(self.phases, key=lambda phase: phase.seconds, default=None)
        return longest.bottleneck if longest else None

    def rows(self) -> list[dict]:
        return [{"phase": phase.name, "rounds": phase.rounds, "seconds": phase.seconds,
                 "latency_s": phase.latency_s, "bottleneck": phase.bottleneck.describe() if phase.bottleneck else "-"}
                for phase in self.phases]

    def format(self) -> str:
        """A few lines a person can read."""
        how = ""
        if len(self.phases) > 1:
            how = " (phases pipelined by round)" if self.pipelined else " (phases one after another)"
        lines = [f"{self.method} on {self.topology}: {self.seconds:.4g} s{how}"]
        width = max([len(phase.name) for phase in self.phases] + [5])
        lines.append(f"  {'phase':<{width}}  {'rounds':>6}  {'alone s':>9}  {'latency s':>9}  bottleneck")
        for phase in self.phases:
            lines.append(f"  {phase.name:<{width}}  {phase.rounds:>6}  {phase.seconds:>9.4g}  {phase.latency_s:>9.3g}  "
                         f"{phase.bottleneck.describe() if phase.bottleneck else '-'}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    __str__ = format
