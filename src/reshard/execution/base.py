"""The executor contract: what every way of running a refit offers, and the checks they share.

Call sequence, on every rank of the group (sources, destinations, colocated ranks)::

    ex = SomeExecutor(plan, group, timeout=...)   # this rank's part of a finished plan; collective
                                                  # where ``collective_setup`` (a subgroup is split off)
    problem = ex.setup_error or ex.check(src, dst)  # None, or what is wrong with this rank's buffers
    stats = ex.run(src_buffers, dst_buffers)      # collective: check, agree, move, decide; RunStats
    stats = ex.run(src_buffers, dst_buffers, decide=False)  # the caller (a session) decides afterwards
    ex.touched, ex.where                          # whether the last run got past the agreement (bytes
                                                  # may have moved), and the step it was in
    ex.close()                                    # releases what it holds (subgroups); idempotent

A composite executor (the precision executor, around any method's executor) runs the parts of
``run`` itself: ``buffers_used()`` (what this rank reads and writes), ``move(src, dst, device)``
(the bytes alone) and ``fail(error)`` (breaks the group and any subgroup, so every rank hears).

``src_buffers`` / ``dst_buffers`` are ``{buffer name: tensor}`` of this rank (empty where the
rank holds none); destination tensors are written in place. Before any byte moves, every rank
checks its buffers against the plan and all ranks compare plan fingerprints and :attr:`Executor.options`
(:func:`agree`): a problem raises :class:`~reshard.tensors.LayoutError` on every rank, naming
the rank at fault, with no destination tensor touched. A rank that never arrives is named in a
:class:`~reshard.execution.control.RefitError` on every rank within ``timeout``, whatever the
group (torch's default group, a subgroup, a standalone one). A failure while bytes move raises
``RefitError`` (``moved=True``) on every rank (see :mod:`reshard.execution.control`).
Executors receive finished plans: they plan nothing themselves.

Capability flags (class attributes) say what an executor guarantees:

    flag               reshard  hybrid  gather-broadcast  precision (around a method's executor)
    needed_bytes_only  yes      no      no                the method's
    bounded_staging    yes      no      no                the method's (plus the quantization staging)
    collective_setup   no       yes     yes               the method's
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, ClassVar, Mapping, Sequence

import torch
import torch.distributed as dist

from ..layout import Layout
from ..tensors import LayoutError, cast_problem, narrowing
from . import faults
from .control import RefitError
from .group import DEFAULT_TIMEOUT, Group
from .packing import Buffers

if TYPE_CHECKING:
    from ..planning.plan import PhasedPlan


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
    """Runs a finished plan on this rank; every rank of the group builds one and calls :meth:`run` (see
    module doc). The shared constructor holds the plan, the group (``None``: torch's default group),
    the ``timeout`` that bounds every wait, the options every executor has (``checksum``: a digest per
    message, where the executor sends messages; ``allow_lossy``: send values a narrowing cast loses),
    and :attr:`setup_error`, the problem this group has with the plan (a rank it lacks), or None."""

    #: the executor's name in the options every rank agrees on
    name: ClassVar[str] = "executor"
    #: every destination rank receives only the bytes it holds and does not already have
    needed_bytes_only: ClassVar[bool] = True
    #: staging per rank stays under the plan's ``max_bucket_bytes`` (plus one copy per round in flight)
    bounded_staging: ClassVar[bool] = True
    #: construction is collective (the ranks agree, then split off a subgroup): every rank builds it
    collective_setup: ClassVar[bool] = False
    #: whether the executor takes ``checksum=True``
    checksums: ClassVar[bool] = True

    def __init__(self, plan: "PhasedPlan", group: Group | dist.ProcessGroup | None = None, *,
                 timeout: timedelta = DEFAULT_TIMEOUT, checksum: bool = False, allow_lossy: bool = False) -> None:
        if not isinstance(timeout, timedelta) or not timeout.total_seconds() > 0:
            raise ValueError(f"{type(self).__name__}: timeout must be a positive datetime.timedelta, got {timeout!r}")
        if checksum and not self.checksums:
            raise ValueError(f"{type(self).__name__} sends no messages to checksum (checksum=True)")
        self.plan = plan
        self.group = Group.of(group, timeout=timeout)
        self.timeout = timeout
        self.checksum, self.allow_lossy = checksum, allow_lossy
        self.rank = self.group.rank
        self.where = "agreement"  # the step a run is in, for errors
        self.touched = False  # whether the last run got past the agreement (destination bytes may have moved)
        self.closed = False
        self.setup_error: str | None = plan_ranks_problem(plan, self.group.size, self.rank)

    @property
    def options(self) -> dict:
        """What every rank must agree on besides the plan."""
        return {"executor": self.name, "checksum": self.checksum, "allow_lossy": self.allow_lossy}

    @abstractmethod
    def check(self, src_buffers: Buffers, dst_buffers: Buffers) -> str | None:
        """The first problem with this rank's buffers for the plan (naming the rank), or None. Local."""

    @abstractmethod
    def run(self, src_buffers: Buffers, dst_buffers: Buffers, *, decide: bool = True) -> RunStats:
        """Move the bytes; ``dst_buffers`` are written in place. Collective over the group. ``decide=False``
        leaves the commit decision to the caller."""

    # -- what a composite executor (the precision executor around any method's) runs of this one
    @abstractmethod
    def buffers_used(self) -> tuple[set[str], set[str]]:
        """(source buffers read, destination buffers written) by this rank's part. Local."""

    @abstractmethod
    def move(self, src_buffers: Buffers, dst_buffers: Buffers, device: torch.device) -> list[PhaseStats]:
        """The bytes of :meth:`run` with no check, agreement or decision: what a composite executor runs
        after its own checks and agreement. Collective."""

    def fail(self, error: RefitError) -> RefitError:
        """Break what a run waits on (the group; subgroups too, where the executor has them) so that every
        rank hears ``error``; the error every rank raises."""
        return self.group.fail(error)

    def close(self) -> None:
        """Release what the executor holds beyond the caller's group (nothing, by default)."""
        self.closed = True

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"rank {self.rank}: this {type(self).__name__} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def agree(group: Group, fingerprint: str, error: str | None, options: Mapping | None = None,
          timeout: timedelta | None = None) -> None:
    """Collective, through the group's store: raise the same LayoutError on every rank if any rank has
    an error, another plan, or other executor ``options``; RefitError naming the ranks that never
    arrive within ``timeout`` (default: the group's)."""
    seen = group.gather("agreement", (group.rank, fingerprint, error, dict(options or {})), timeout)
    errors = [e for _, _, e, _ in seen if e]
    if errors:
        raise LayoutError("; ".join(_grouped(errors)))
    prints = {fp for _, fp, _, _ in seen}
    if len(prints) > 1:
        detail = ", ".join(f"rank {r}: {fp[:16]}" for r, fp, _, _ in seen)
        raise LayoutError(f"ranks disagree on the plan fingerprint ({detail}): each built another plan")
    for key in sorted({k for *_, o in seen for k in o}):
        values = {repr(o.get(key)) for *_, o in seen}
        if len(values) > 1:
            detail = ", ".join(f"rank {r}: {o.get(key)!r}" for r, _, _, o in seen)
            raise LayoutError(f"ranks disagree on the executor option {key!r} ({detail})")


def agree_before_moving(group: Group, fingerprint: str, error: str | None, options: Mapping, timeout: timedelta,
                        fail: Callable[[RefitError], RefitError] | None = None) -> None:
    """An executor's agreement step (the ``agreement`` fault point, then :func:`agree`): a LayoutError
    on every rank as is; a rank that never arrives, or this rank failing here, goes through ``fail``
    (default ``group.fail``: abort, close the communicator) and is raised as a RefitError."""
    fail = fail or group.fail
    try:
        faults.hit("agreement")
        agree(group, fingerprint, error, options, timeout)
    except RefitError as e:  # a rank never arrived: tell the others at once
        raise fail(e.with_traceback(None)) from None
    except LayoutError:
        raise
    except Exception as e:  # noqa: BLE001 - this rank failed before any byte moved
        raise fail(RefitError("agreement", f"rank {group.rank}: {type(e).__name__}: {e}",
                              ranks=[group.rank])) from None


def end_of_run(group: Group, failure: RefitError | None, decide: bool, timeout,
               fail: Callable[[RefitError], RefitError] | None = None) -> None:
    """An executor's last step: raise ``failure`` through ``fail`` (default ``group.fail``), else, when
    ``decide``, take the group's commit decision. Called outside any ``except`` block, with a failure
    that carries no traceback: nothing keeps a round's posted work (and with it the communicator)
    alive, so that ``fail`` can close the connections. Either error says ``moved``: the run got past
    the agreement, so destination bytes may have moved."""
    fail = fail or group.fail
    if failure is not None:
        raise fail(failure).but(moved=True)
    if decide:
        try:
            group.control.decide(None, timeout)
        except RefitError as e:
            raise fail(e).but(moved=True) from None


def plan_ranks_problem(plan: "PhasedPlan", size: int, rank: int) -> str | None:
    """A rank the plan names that the group does not have (it would crash the transport), or None."""
    for phase in plan.phases:
        for side, layout in (("source", phase.source), ("destination", phase.destination)):
            bad = [r for r in layout.ranks if not 0 <= r < size]
            if bad:
                return (f"rank {rank}: the plan's {side} layout names rank {bad[0]}, outside this group of {size} "
                        f"ranks (0..{size - 1})")
    return None


def check_storage(rank: int, read: Buffers, written: Buffers) -> str | None:
    """Buffers that cannot be written in place, or that share storage where a refit would read or
    write one byte twice: destination buffers overlapping each other or a source buffer.

    >>> import torch
    >>> w = torch.zeros(4, 4)
    >>> check_storage(0, {}, {"a": w[:2], "b": w[1:]})
    "rank 0: destination buffers 'a' and 'b' share memory; give each tensor its own storage"
    >>> check_storage(0, {}, {"a": torch.zeros(1).expand(4)})
    "rank 0: destination buffer 'a' cannot be written in place: an expanded view (stride 0)"
    """
    for name, t in written.items():
        if t.is_meta:
            return f"rank {rank}: destination buffer {name!r} is a meta tensor (no storage to write into)"
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            return f"rank {rank}: destination buffer {name!r} cannot be written in place: an expanded view (stride 0)"
    spans = [(_span(t), "destination", n) for n, t in written.items() if t.numel()] + [
        (_span(t), "source", n) for n, t in read.items() if t.numel() and not t.is_meta]
    spans.sort()
    for i, ((key, lo, hi), side, name) in enumerate(spans):
        for (key2, lo2, hi2), side2, name2 in spans[i + 1:]:
            if key2 != key or lo2 >= hi:
                break
            if "destination" in (side, side2) and hi > lo and hi2 > lo2:
                if side == side2:
                    return (f"rank {rank}: destination buffers {name!r} and {name2!r} share memory; give each tensor "
                            f"its own storage")
                src, dst = (name, name2) if side == "source" else (name2, name)
                return (f"rank {rank}: destination buffer {dst!r} shares memory with source buffer {src!r}; a refit "
                        f"cannot read and write the same bytes")
    return None


def _span(t: torch.Tensor) -> tuple[str, int, int]:
    """``(device, first byte, end byte)`` of the memory a non-empty ``t`` can touch."""
    start = t.data_ptr()
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
    return (str(t.device), start, start + extent * t.element_size())


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

def lossy_cast_problem(rank: int, src: Buffers, pairs, executor: str) -> str | None:
    """The first ``(source buffer, destination dtype)`` of ``pairs`` whose narrowing cast would lose
    values of ``src``, as a message naming ``rank`` and the way out (``allow_lossy=True``), or None."""
    for buffer, dtype in sorted(set(pairs), key=str):
        t = src[buffer]
        if narrowing(t.dtype, dtype):
            problem = cast_problem(buffer, t, dtype)
            if problem:
                return f"rank {rank}: {problem} ({executor}(allow_lossy=True) sends them anyway)"
    return None


__all__ = ["Executor", "PhaseStats", "RunStats", "agree", "check_buffers", "check_storage", "device_of",
           "agree_before_moving", "end_of_run", "lossy_cast_problem", "plan_ranks_problem", "synchronize"]
