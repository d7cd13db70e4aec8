"""Running a refit straight into FP8 engines: quantize on the senders, move, quantize what is left.

A :class:`~reshard.planning.precision.PrecisionPlan` runs in three steps on every rank::

    assemble blocks           (with ``assemble``) in rounds under the staging cap: the block rows no
                              source rank holds whole go to their assemblers, which quantize them
                              into FP8 staging and free them (reshard.planning.assembly_rounds)
    quantize at source        each source rank quantizes the whole blocks it sends (its
                              quantization's source tasks) into FP8 and scale staging buffers
    <the wire plan's phases>  FP8 values, scales, raw blocks (source precision, into destination
                              staging) and kept / cast tensors, as ReshardExecutor moves any plan
    quantize at destination   each destination rank quantizes the raw blocks it received into its
                              FP8 weights and scales (its destination tasks)

:class:`PrecisionExecutor` does it over a process group as one refit with one outcome: before any
byte moves every rank checks its buffers (the caller's, against the plan's source and destination
layouts: FP8 weights in float8_e4m3fn, ``<buffer>_scale_inv`` in float32) and all ranks compare the
plan's fingerprint (which covers the dtype policy) and options; a problem raises the same
``LayoutError`` on every rank with nothing written. A failure in any step raises
:class:`~reshard.execution.control.RefitError` on every rank, and the run ends with one commit /
abort decision (``decide=False`` leaves it to a refit session). :func:`run_local_precision` runs
every rank's part in one process (tests)::

    ex = PrecisionExecutor(precision_plan(src, dst, "fp8"), group)
    stats = ex.run(src_buffers, engine_buffers)    # phases: quantize at source, transfer, quantize at destination

**Tensor groups.** Under a cap (``max_bucket_bytes`` ``C``) the executor runs the refit in tensor
groups (:mod:`reshard.planning.tensor_groups`): each group's steps above in turn, its staging
allocated before them and freed after, so a rank holds at most ``C`` (the group's FP8, scale, raw
and box staging under ``C // 2``, its wire's transfer under the rest; one tensor over ``C // 2``
alone goes over by its excess). Of the two designs, groups were chosen over one wire plan with
lazily allocated buffers: each group is an ordinary refit (its own plan, checks and tasks), so the
bound needs no hook in the wire executor and holds for any wire method, and groups are built by
the executor only (plan construction costs what it did). Per rank, six tensors whose raw blocks
are 32 KiB each on destination 2, cap 64 KiB::

    staging on rank 2      all at once (before)   a group at a time
    raw blocks             192 KiB                32 KiB
    + transfer staging     <= 32 KiB              <= 32 KiB

The tasks are the plan's (:meth:`~reshard.planning.precision.PrecisionPlan.quantization`); the
executor runs them as they are. Fault points (:mod:`reshard.execution.faults`): ``agreement``,
``quantize at source``, the wire plan's rounds, ``quantize at destination``.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from ..planning.assembly_rounds import AssemblyRounds
from ..planning.precision import PrecisionPlan
from ..planning.quantization import QuantTask, RankQuantization, first_phase_reads
from ..quant import grid_shape, quantize_into
from ..tensors import buffer_view
from . import faults
from .base import (Executor, PhaseStats, RunStats, agree_before_moving, check_buffers, check_storage, device_of,
                   end_of_run, synchronize)
from .control import RefitError
from .executor import ReshardExecutor
from .group import DEFAULT_TIMEOUT, Group
from .local import run_local
from .packing import Buffers

SOURCE_STEP, DESTINATION_STEP = "quantize at source", "quantize at destination"
ASSEMBLY_STEP = "assemble blocks"  # the assembly phase (PrecisionPlan.assembly): block rows to their assemblers


def run_quant_task(task: QuantTask, read: Buffers, write: Buffers) -> None:
    """Quantize ``task``'s box of ``read[task.src_buffer]`` into its views of ``write`` (in place)."""
    x = buffer_view(read[task.src_buffer], task.src_offsets, task.sizes)
    q = buffer_view(write[task.q_buffer], task.q_offsets, task.sizes)
    s = buffer_view(write[task.s_buffer], task.s_offsets, grid_shape(task.sizes, task.block))
    quantize_into(x, q, s, task.block, task.ue8m0, task.mx)


def staging(plan: PrecisionPlan, rank: int, side: str, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """``rank``'s staging buffers for the quantization (``side``: ``"source"`` (FP8 values and scales) or
    ``"destination"`` (raw blocks); assembled boxes are allocated a round at a time, :func:`allocated`)."""
    named = {"source": plan.source_staging, "destination": plan.destination_staging}[side].get(rank, {})
    return allocated(named, device)


def allocated(named: Mapping, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Empty tensors for ``{name: (shape, dtype)}``."""
    return {b: torch.empty(shape, dtype=dt, device=device) for b, (shape, dt) in named.items()}


def assemble_locally(plan: PrecisionPlan, msrc: dict[int, dict[str, torch.Tensor]]) -> None:
    """Every rank's assembly rounds in this process: each round hands over its boxes (:func:`run_local`)
    and quantizes them into ``msrc``'s FP8 staging, its boxes freed before the next."""
    rounds = AssemblyRounds(plan)
    split = {r: rounds.split(r, plan.quantization(r).source) for r in msrc}
    for i, round_plan in enumerate(rounds.plans):
        merged = {r: {**msrc[r], **allocated(rounds.buffers(i, r), device_of(msrc[r]))} for r in msrc}
        run_local(round_plan, merged, merged)
        for r in msrc:
            for task in split[r][0][i]:
                run_quant_task(task, merged[r], merged[r])


def run_local_precision(plan: PrecisionPlan, src_buffers: Mapping[int, Buffers], dst_buffers: Mapping[int, Buffers]
                        ) -> None:
    """Every rank's part of ``plan`` in this process: quantize at the sources, move (:func:`run_local`),
    quantize at the destinations. ``dst_buffers[rank]`` are the engine's buffers (FP8 weights and
    scales included: ``plan.destination.empty_buffers(rank)``), written in place.

    >>> import torch, reshard as rs
    >>> from reshard.planning.precision import precision_plan
    >>> from reshard.quant import quantize_blocks
    >>> spec = rs.TensorSpec("up_proj.weight", (256, 200), torch.bfloat16)
    >>> src = rs.Layout.from_placements(spec, [0, 1, 2], (3,), [rs.Shard(0)])   # 86 rows each: no whole block
    >>> dst = rs.Layout.from_placements(spec, [3, 4], (2,), [rs.Shard(0)])
    >>> plan = precision_plan(src, dst, "fp8")
    >>> full = {spec.name: torch.randn(spec.shape).to(spec.dtype)}
    >>> out = {r: plan.destination.empty_buffers(r) for r in plan.destination.ranks}
    >>> run_local_precision(plan, {r: src.materialize(r, full) for r in src.ranks}, out)
    >>> q, s = quantize_blocks(full[spec.name])
    >>> torch.equal(out[4]["up_proj.weight"].view(torch.uint8), q[128:].view(torch.uint8)), torch.equal(out[4]["up_proj.weight_scale_inv"], s[1:])
    (True, True)
    """
    groups = plan.tensor_groups()
    plans = [groups.plan(i) for i in range(len(groups))]  # every group planned before any byte moves
    for group_plan in plans:  # a tensor group at a time, as PrecisionExecutor runs them
        _run_local_group(group_plan, src_buffers, dst_buffers)


def _run_local_group(plan: PrecisionPlan, src_buffers: Mapping[int, Buffers], dst_buffers: Mapping[int, Buffers]
                     ) -> None:
    empty: dict[str, torch.Tensor] = {}
    msrc, mdst = {}, {}
    for r in sorted(set(plan.source.ranks) | set(plan.source_staging) | set(plan.assembly_staging)):
        buffers = src_buffers.get(r, empty)
        msrc[r] = {**buffers, **staging(plan, r, "source", device_of(buffers))}
    assembled = {}
    if plan.assembly is not None:
        assemble_locally(plan, msrc)
        assembled = {r: set(plan.assembly_staging.get(r, {})) for r in msrc}
    for r in msrc:
        for task in plan.quantization(r).source:
            if task.src_buffer not in assembled.get(r, ()):
                run_quant_task(task, msrc[r], msrc[r])
    for r in sorted(set(plan.destination.ranks) | set(plan.destination_staging)):
        buffers = dst_buffers.get(r, empty)
        mdst[r] = {**buffers, **staging(plan, r, "destination", device_of(buffers))}
    run_local(plan.wire, msrc, mdst)
    for r in plan.destination_staging:
        for task in plan.quantization(r).destination:
            run_quant_task(task, mdst[r], dst_buffers[r])


class PrecisionExecutor(Executor):
    """Runs a :class:`PrecisionPlan` over ``group`` (see module doc). Every rank of the group constructs
    it with the same plan and calls :meth:`run`. ``wire``: the executor class of the method whose plan
    is the wire (:class:`ReshardExecutor` by default; the method registry passes the method's); it
    is built here on the same group, collectively where its ``collective_setup`` says so.
    ``overlap`` (reshard executors only), ``checksum`` and ``allow_lossy`` are the wire executor's
    (``allow_lossy`` covers casts of kept and cast tensors; quantization saturates by its rule and
    is never refused). :meth:`close` releases the wire executor."""

    name = "precision"

    def __init__(self, plan: PrecisionPlan, group: Group | dist.ProcessGroup | None = None, *,
                 timeout: timedelta = DEFAULT_TIMEOUT, overlap: bool = True, checksum: bool = False,
                 allow_lossy: bool = False, wire: type[Executor] = ReshardExecutor, groups: bool = True) -> None:
        if not isinstance(plan, PrecisionPlan):
            raise TypeError(f"PrecisionExecutor runs a PrecisionPlan (precision_plan(...)), got {type(plan).__name__}")
        if checksum and not wire.checksums:
            raise ValueError(f"{wire.__name__} sends no messages to checksum (checksum=True)")
        self._step: str | None = None
        super().__init__(plan, group, timeout=timeout, checksum=checksum, allow_lossy=allow_lossy)
        kwargs = {"timeout": timeout, "allow_lossy": allow_lossy}
        if wire.checksums:
            kwargs["checksum"] = checksum
        if issubclass(wire, ReshardExecutor):
            kwargs["overlap"] = overlap
        # the refit in tensor groups under the cap (planning.tensor_groups): one child executor per group
        self.children: list[PrecisionExecutor] = []
        self._current: PrecisionExecutor | None = None  # the child running now
        tensor_groups = plan.tensor_groups() if groups else None
        if tensor_groups is not None and not tensor_groups.whole:  # one group or more, sharing the cap
            self.children = [PrecisionExecutor(tensor_groups.plan(i), self.group, timeout=timeout, overlap=overlap,
                                               checksum=checksum, allow_lossy=allow_lossy, wire=wire, groups=False)
                             for i in range(len(tensor_groups))]
            first = self.children[0]
            self.wire, self.rounds, self.assemblers = first.wire, None, []
            self.setup_error = self.setup_error or next((c.setup_error for c in self.children if c.setup_error), None)
            self.source_tasks, self.destination_tasks, self.round_tasks, self.later_tasks = (), (), [], []
            self.needed_bytes_only, self.bounded_staging = first.needed_bytes_only, first.bounded_staging
            self.collective_setup = first.collective_setup
            return
        self.wire = wire(plan.wire, self.group, **kwargs)
        # the assembly phase in rounds under the staging cap (AssemblyRounds), one plain plan each on the group
        self.rounds = AssemblyRounds(plan) if plan.assembly is not None else None
        self.assemblers = [ReshardExecutor(p, self.group, timeout=timeout, allow_lossy=allow_lossy, overlap=overlap)
                           for p in (self.rounds.plans if self.rounds is not None else [])]
        self.setup_error = (self.setup_error or self.wire.setup_error
                            or next((a.setup_error for a in self.assemblers if a.setup_error), None))
        if self.setup_error:
            tasks = RankQuantization()
        elif isinstance(self.wire, ReshardExecutor):  # its parts are built: reuse the first phase's reads
            parts = self.wire.parts
            tasks = plan.quantization(self.rank, first_phase_reads(parts[0]) if parts else [])
        else:
            tasks = plan.quantization(self.rank)
        self.source_tasks, self.destination_tasks = tasks.source, tasks.destination
        # the source tasks that read assembled boxes run in their round; the others after every round
        self.round_tasks, self.later_tasks = (self.rounds.split(self.rank, self.source_tasks) if self.rounds is not None
                                              else ([], list(self.source_tasks)))
        # the wire's guarantees are the run's (the class's flags hold for the default wire)
        self.needed_bytes_only, self.bounded_staging = self.wire.needed_bytes_only, self.wire.bounded_staging
        self.collective_setup = self.wire.collective_setup


    @property
    def options(self) -> dict:
        """What every rank must agree on besides the plan: the wire executor's options, the policy."""
        return {**self.wire.options, **super().options, "wire": self.wire.name, "policy": self.plan.policy.key}

    @property
    def where(self) -> str:
        """The step a run is in (for errors)."""
        if self._current is not None:
            return self._current.where
        return self._step if self._step is not None else self.wire.where

    @where.setter
    def where(self, value: str) -> None:
        self._step = value

    def assembly_staging_bytes(self) -> int:
        """The most this rank stages in one assembly round: its boxes of the round plus the round's transfer
        staging (at most the plan's ``max_bucket_bytes``: :mod:`reshard.planning.assembly_rounds`)."""
        if self.children:
            return max(c.assembly_staging_bytes() for c in self.children)
        return max((a.staging_bytes() + self.rounds.staging_bytes(i).get(self.rank, 0)
                    for i, a in enumerate(self.assemblers)), default=0)

    def staging_bytes(self) -> int:
        """Bytes this rank allocates: the wire's staging (or an assembly round's, the larger: one runs after the
        other) plus the quantization's (FP8 values and scales, raw blocks): the busiest tensor group's."""
        if self.children:
            return max(c.staging_bytes() for c in self.children)
        figures = self.plan.staging_bytes()
        wire = self.wire.staging_bytes() if hasattr(self.wire, "staging_bytes") else 0
        return (max(wire, self.assembly_staging_bytes()) + figures["source"].get(self.rank, 0)
                + figures["destination"].get(self.rank, 0))

    def close(self) -> None:
        """Release the wire executor (its subgroups; local, idempotent)."""
        super().close()
        self.wire.close()
        for child in self.children:
            child.close()
        for assembler in self.assemblers:
            assembler.close()

    def fail(self, error: RefitError) -> RefitError:
        """Break what any step may wait on, on every rank: the group and each tensor group's wire (a
        gather-and-broadcast wire has a broadcast subgroup of its own per tensor group, and a peer may
        already wait in a later group's broadcast while this rank fails in an earlier one's quantize)."""
        if not self.children:
            return self.wire.fail(error)
        first = self.children[0].fail(error)  # the group's abort signal: the first failure stands
        for child in self.children[1:]:
            child.fail(first)
        return first

    # ------------------------------------------------------------------ checks
    def buffers_used(self) -> tuple[set[str], set[str]]:
        """(source buffers read, destination buffers written) of the caller's, by every step on this rank."""
        if self.children:
            used = [c.buffers_used() for c in self.children]
            return set().union(*(r for r, _ in used)), set().union(*(w for _, w in used))
        own_src = set(self.plan.source_staging.get(self.rank, {})) | set(self.plan.assembly_staging.get(self.rank, {}))
        own_dst = set(self.plan.destination_staging.get(self.rank, {}))
        wire_read, wire_written = self.wire.buffers_used()
        for assembler in self.assemblers:
            wire_read = wire_read | assembler.buffers_used()[0]
        read = {t.src_buffer for t in self.source_tasks} | wire_read
        written = {b for t in self.destination_tasks for b in (t.q_buffer, t.s_buffer)} | wire_written
        return read - own_src, written - own_dst

    def check(self, src: Buffers, dst: Buffers, merged_src: Buffers | None = None,
              merged_dst: Buffers | None = None) -> str | None:
        """The first problem with this rank's buffers, or None (see module doc); ``merged_*``: the
        buffers with this rank's staging added (allocated here when not given)."""
        if self.setup_error:
            return self.setup_error
        if self.children:  # each group with its own staging (one group's at a time), then storage across groups
            for child in self.children:
                problem = child.check(src, dst)
                if problem:
                    return problem
            read, written = self.buffers_used()
            return check_storage(self.rank, {n: src[n] for n in sorted(read)}, {n: dst[n] for n in sorted(written)})
        if merged_src is None or merged_dst is None:
            device = device_of(src, dst)
            merged_src = {**src, **staging(self.plan, self.rank, "source", device)}
            merged_dst = {**dst, **staging(self.plan, self.rank, "destination", device)}
        problem = self.wire.check(merged_src, merged_dst)
        for i, assembler in enumerate(self.assemblers):  # each round with its own boxes (one round's at a time)
            if problem:
                break
            merged = {**merged_src, **allocated(self.rounds.buffers(i, self.rank), device_of(src, dst))}
            problem = assembler.check(merged, merged)
        if problem:
            return problem
        read, written = self.buffers_used()
        assembled = set(self.plan.assembly_staging.get(self.rank, {}))
        return (check_buffers(self.plan.source, self.rank, src,
                              {t.src_buffer for t in self.source_tasks} - assembled, "source")
                or check_buffers(self.plan.destination, self.rank, dst,
                                 {b for t in self.destination_tasks for b in (t.q_buffer, t.s_buffer)}, "destination")
                or check_storage(self.rank, {n: src[n] for n in sorted(read)}, {n: dst[n] for n in sorted(written)}))

    # ------------------------------------------------------------------ run
    def run(self, src_buffers: Buffers, dst_buffers: Buffers, *, decide: bool = True) -> RunStats:
        """Quantize, move and quantize; ``dst_buffers`` (the engine's, FP8 weights and scales included) are
        written in place. Collective over the group. Errors as :meth:`ReshardExecutor.run`'s."""
        self.check_open()
        self._step, self.touched, self._current = "agreement", False, None
        self.group.check_usable("agreement")
        device = device_of(src_buffers, dst_buffers)
        src_stage = {} if self.children else staging(self.plan, self.rank, "source", device)
        dst_stage = {} if self.children else staging(self.plan, self.rank, "destination", device)
        merged_src, merged_dst = {**src_buffers, **src_stage}, {**dst_buffers, **dst_stage}
        error = self.check(src_buffers, dst_buffers, merged_src, merged_dst)
        agree_before_moving(self.group, self.plan.fingerprint(), error, self.options, self.timeout, fail=self.fail)
        failure, phases = None, []
        try:
            with torch.inference_mode():  # writes autograd leaves and inference tensors in place
                phases = self._steps(dst_buffers, merged_src, merged_dst, src_stage, dst_stage, device)
        except RefitError as e:
            failure = RefitError(e.phase, str(e).partition(": ")[2], ranks=e.ranks)
        except Exception as e:  # noqa: BLE001 - every rank hears of it
            failure = RefitError(self.where, f"rank {self.rank}: {type(e).__name__}: {e}", ranks=[self.rank])
        finally:
            del src_stage, dst_stage, merged_src, merged_dst
        end_of_run(self.group, failure, decide, self.timeout, fail=self.fail)
        return RunStats.of_phases(self.rank, phases)

    def move(self, src_buffers: Buffers, dst_buffers: Buffers, device: torch.device) -> list[PhaseStats]:
        """Quantize, move and quantize with no check, agreement or decision (for a composite executor)."""
        if self.children:
            return self._steps(dst_buffers, src_buffers, dst_buffers, {}, {}, device)
        src_stage = staging(self.plan, self.rank, "source", device)
        dst_stage = staging(self.plan, self.rank, "destination", device)
        return self._steps(dst_buffers, {**src_buffers, **src_stage}, {**dst_buffers, **dst_stage}, src_stage,
                           dst_stage, device)

    def _steps(self, dst_buffers: Buffers, merged_src: Buffers, merged_dst: Buffers, src_stage: Buffers,
               dst_stage: Buffers, device: torch.device) -> list[PhaseStats]:
        """The three steps on buffers with this rank's staging merged in (the caller's alone with tensor
        groups: each group's staging is allocated and freed here); marks :attr:`touched`."""
        if self.children:
            return self._groups(merged_src, dst_buffers, device)
        # touched from here on: the other ranks go on into the wire as soon as their own assembly and source
        # steps end, so a source failing in one of its own asks the destinations whether they wrote (the
        # session's ``moved``) instead of declaring that nothing moved while they already count themselves written
        self.touched = True
        phases, quantized = [], (0.0, 0)
        if self.assemblers:
            assembly, quantized = self._assemble(merged_src, device)
            phases.append(assembly)
        source = self._quantize(SOURCE_STEP, self.later_tasks, merged_src, merged_src, src_stage, device)
        phases.append(dataclasses.replace(source, seconds=source.seconds + quantized[0],
                                          local_bytes=source.local_bytes + quantized[1]))
        self._step = None
        phases += self.wire.move(merged_src, merged_dst, device)
        phases.append(self._quantize(DESTINATION_STEP, self.destination_tasks, merged_dst, dst_buffers, dst_stage,
                                     device))
        # every step runs with the quantization's staging held: each phase's peak counts it
        held = _nbytes(src_stage) + _nbytes(dst_stage)
        return [dataclasses.replace(p, peak_staging_bytes=held + (0 if p.name in (SOURCE_STEP, DESTINATION_STEP)
                                                                  else p.peak_staging_bytes)) for p in phases]

    def _groups(self, src_buffers: Buffers, dst_buffers: Buffers, device: torch.device) -> list[PhaseStats]:
        """Each tensor group's steps in turn, its staging allocated before them and freed after; one phase
        per step name (times, bytes, rounds and messages added up, the peak the largest group's)."""
        self.touched = True
        merged: dict[str, PhaseStats] = {}
        for child in self.children:
            self._current = child
            src_stage = staging(child.plan, self.rank, "source", device)
            dst_stage = staging(child.plan, self.rank, "destination", device)
            for p in child._steps(dst_buffers, {**src_buffers, **src_stage}, {**dst_buffers, **dst_stage}, src_stage,
                                  dst_stage, device):
                seen = merged.get(p.name)
                merged[p.name] = p if seen is None else PhaseStats(
                    p.name, seen.seconds + p.seconds, seen.sent_bytes + p.sent_bytes, seen.recv_bytes + p.recv_bytes,
                    seen.local_bytes + p.local_bytes, max(seen.peak_staging_bytes, p.peak_staging_bytes),
                    seen.rounds + p.rounds, seen.messages + p.messages)
            del src_stage, dst_stage
        self._current = None
        return list(merged.values())

    def _assemble(self, merged_src: Buffers, device: torch.device) -> tuple[PhaseStats, tuple[float, int]]:
        """The assembly rounds: each hands over its boxes, then this rank quantizes its own into FP8 staging
        and frees them. (One ``assemble blocks`` phase: transfers, peak staging of a round; (seconds, bytes
        written) of the quantization, counted with the source step's.)"""
        self._step = ASSEMBLY_STEP
        faults.hit(ASSEMBLY_STEP)
        moved: list[PhaseStats] = []
        peak, quantized, written = 0, 0.0, 0
        for i, assembler in enumerate(self.assemblers):
            self._step = ASSEMBLY_STEP
            boxes = allocated(self.rounds.buffers(i, self.rank), device)
            merged = {**merged_src, **boxes}
            stats = assembler.move(merged, merged, device)
            moved += stats
            staged = _nbytes(boxes)
            peak = max(peak, staged + max((p.peak_staging_bytes for p in stats), default=0))
            start = time.perf_counter()
            written += self._run_tasks(SOURCE_STEP, self.round_tasks[i], merged, merged)
            synchronize(device)
            quantized += time.perf_counter() - start
            del boxes, merged
        total = RunStats.of_phases(self.rank, moved)
        return (PhaseStats(ASSEMBLY_STEP, total.seconds, total.sent_bytes, total.recv_bytes, total.local_bytes, peak,
                           total.rounds, total.messages), (quantized, written))

    def _run_tasks(self, step: str, tasks: Iterable[QuantTask], read: Buffers, write: Buffers) -> int:
        """Run ``tasks`` as step ``step`` (its fault point passed once, at its first task); bytes written."""
        written = 0
        for task in tasks:
            if self._step != step:
                self._step = step
                faults.hit(step)
            run_quant_task(task, read, write)
            written += task.sizes[0] * task.sizes[1] + (1 if task.mx else 4) * task.blocks
        return written

    def _quantize(self, step: str, tasks: Iterable[QuantTask], read: Buffers, write: Buffers,
                  stage: Mapping[str, torch.Tensor], device: torch.device) -> PhaseStats:
        self._step = step
        start = time.perf_counter()
        faults.hit(step)
        written = self._run_tasks(step, tasks, read, write)
        synchronize(device)
        return PhaseStats(step, time.perf_counter() - start, 0, 0, written, _nbytes(stage), 0, 0)


def _nbytes(buffers: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in buffers.values())


__all__ = ["ASSEMBLY_STEP", "DESTINATION_STEP", "PrecisionExecutor", "SOURCE_STEP", "allocated", "assemble_locally",
           "run_local_precision", "run_quant_task", "staging"]
