"""The reshard executor: run one rank's part of a plan over a torch.distributed group.

Phase by phase (a direct plan has one; a hierarchical plan runs its network phase, then its
relay and NVLink forward phases from the destination buffers the earlier phases filled), round
by round: the rank packs what it sends to each peer into one contiguous staging buffer, posts
every send and receive of the round at once (``batch_isend_irecv``), and unpacks each received
buffer in place into the caller's destination tensors (live parameters: no model-sized copy).
Fan-out copies run last in a phase. Works on CPU tensors with gloo and CUDA tensors with NCCL:
the byte handling is plain torch ops.

Two orders, same bytes (``overlap``, on by default; ``benchmarks/bench_overlap.py`` measured it
1.5-3x faster than sequential with hundreds of rounds, within noise with a few dozen)::

    sequential   local | pack 0 | wire 0 | unpack 0 | pack 1 | wire 1 | unpack 1 | ...
    overlapped   pack 0 | wire 0                  | wire 1                    | wire 2 ...
                        | local, pack 1           | pack 2, unpack 0          | pack 3, unpack 1 ...

Overlapped, one round is on the wire at a time; while round ``j`` is, the rank packs round
``j+1`` and unpacks round ``j-1`` (local copies take the slot of unpack ``-1``), then waits for
round ``j`` and posts round ``j+1``. Staging: two slots for sends and two for receives, each as
big as this rank's largest round of sends (receives), so at most twice the sequential staging
(see :meth:`ReshardExecutor.staging_bytes`). With gloo, posted work runs on gloo's threads while
the calling thread packs; with NCCL, pack/unpack are kernels on the current stream, which NCCL
joins when a round is posted and which waits for NCCL when a round is waited, so the same order
puts round ``j``'s transfer beside round ``j+1``'s pack and round ``j-1``'s unpack on the GPU.
Overlap relies on what phases guarantee: a phase never sends bytes it receives itself.

Before any byte moves, every rank checks its buffers (:meth:`ReshardExecutor.check`: shapes and
dtypes, buffers that share storage, buffers that cannot be written in place, values a narrowing
cast would lose) and all ranks compare plan fingerprints and options
(:func:`~reshard.execution.base.agree`); a problem raises the same ``LayoutError`` on every rank
with no byte moved. Autograd leaves and inference tensors are written under
``torch.inference_mode``. Then every wait is bounded by ``timeout`` and watches the group's abort
signal: a rank that raises, dies or stalls makes every rank raise
:class:`~reshard.execution.control.RefitError` naming the phase, round and rank(s) at fault, and
the run ends with one decision for all ranks (:meth:`~reshard.execution.control.Control.decide`).
With ``checksum=True`` each message carries an xxh3-64 digest of its payload, checked on arrival
(``benchmarks/bench_checksum.py`` measures the cost).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from ..planning.plan import PhasedPlan, RankPlan
from ..planning.schedule import Message
from . import faults
from .base import (Executor, PhaseStats, RunStats, agree_before_moving, check_buffers, check_storage, device_of,
                   end_of_run, lossy_cast_problem, synchronize)
from .control import RefitError
from .group import DEFAULT_TIMEOUT, Group
from .heap import return_free_heap
from .packing import Buffers, copy_within, pack, unpack

DIGEST_BYTES = 8


class ReshardExecutor(Executor):
    """Runs every phase of ``plan`` on this rank. Every rank of ``group`` (a :class:`Group`, a torch
    process group, or ``None`` for the default one; the plan's ranks are the group's) constructs one
    and calls :meth:`run`; ``timeout`` bounds every wait, so a peer that never shows up raises
    instead of hanging. ``overlap`` packs and unpacks neighbouring rounds while a round is on the
    wire (see module doc); ranks may differ in it, the bytes moved are the same. ``checksum``:
    every message carries a digest of its payload, checked on arrival. ``allow_lossy``: send values
    that a narrowing cast (int64 -> int8, fp32 -> fp16) cannot hold instead of refusing them. Ranks
    must agree on ``checksum`` and ``allow_lossy``.
    """

    name = "reshard"

    def __init__(self, plan: PhasedPlan, group: Group | dist.ProcessGroup | None = None, *,
                 timeout: timedelta = DEFAULT_TIMEOUT, overlap: bool = True, checksum: bool = False,
                 allow_lossy: bool = False) -> None:
        super().__init__(plan, group, timeout=timeout, checksum=checksum, allow_lossy=allow_lossy)
        self.overlap = overlap
        self.parts: list[RankPlan] = [] if self.setup_error else [p.for_rank(self.rank) for p in plan.phases]
        # a pipelined hierarchical plan: per step, this rank's part of each phase in it
        self.steps = (plan.steps_for_rank(self.rank) if not self.setup_error and getattr(plan, "is_pipelined", False)
                      else None)

    def check(self, src: Buffers, dst: Buffers) -> str | None:
        """The first problem with this rank's buffers for the plan, or None: missing, wrong shape or
        dtype, destination buffers that share storage with each other or with a source buffer,
        destinations that cannot be written in place (meta tensors, expanded views), and (unless
        ``allow_lossy``) source values that a narrowing cast to the destination dtype would lose."""
        if self.setup_error:
            return self.setup_error
        for i, (phase, part) in enumerate(zip(self.plan.phases, self.parts)):
            need_src = {c.src_buffer for m in part.sends for c in m.copies} | {c.src_buffer for c in part.local}
            need_dst = ({c.dst_buffer for m in part.recvs for c in m.copies} | {c.dst_buffer for c in part.local}
                        | {c.dst_buffer for c in part.fanout} | {c.src_buffer for c in part.fanout})
            error = (check_buffers(phase.source, self.rank, src if i == 0 else dst, need_src,
                                   "source" if i == 0 else "destination")
                     or check_buffers(phase.destination, self.rank, dst, need_dst, "destination"))
            if error:
                return error
        read, written = self.buffers_used()
        return check_storage(self.rank, {n: src[n] for n in sorted(read)}, {n: dst[n] for n in sorted(written)}) or (
            None if self.allow_lossy else self._cast_problem(src))

    def buffers_used(self) -> tuple[set[str], set[str]]:
        """(source buffers read: the first phase's, destination buffers written: every phase's)."""
        if not self.parts:
            return set(), set()
        first = self.parts[0]
        read = {c.src_buffer for m in first.sends for c in m.copies} | {c.src_buffer for c in first.local}
        written: set[str] = set()
        for part in self.parts:
            written |= {c.dst_buffer for m in part.recvs for c in m.copies} | {c.dst_buffer for c in part.local} | {
                c.dst_buffer for c in part.fanout}
        return read, written

    def _cast_problem(self, src: Buffers) -> str | None:
        """Values of a source buffer that its narrowing cast to a destination dtype would lose."""
        if not self.parts:
            return None
        part = self.parts[0]
        pairs = [(c.src_buffer, c.dtype) for m in part.sends for c in m.copies] + [
            (c.src_buffer, c.dtype) for c in part.local]
        return lossy_cast_problem(self.rank, src, pairs, "ReshardExecutor")

    def staging_bytes(self) -> int:
        """Staging this rank allocates in its busiest phase (what ``RunStats.peak_staging_bytes`` reports).

        Sequential: the largest round's sends plus receives (<= the plan's round cap, half its
        ``max_bucket_bytes``, plus the largest single copy). Overlapped, with two rounds or more: twice the largest round's sends
        plus twice the largest round's receives; since every stream's per-round quota is fixed
        and a rank's quotas add up to at most the plan's round cap (half its ``max_bucket_bytes``),
        that stays under ``max_bucket_bytes`` (plus the largest copy of each round in flight).
        """
        extra = DIGEST_BYTES if self.checksum else 0
        if self.steps is not None:
            return max((_Slots.of(_StepRounds(step), self.overlap, extra).nbytes for step in self.steps), default=0)
        return max((_Slots.of(part, self.overlap, extra).nbytes for part in self.parts), default=0)

    def run(self, src_buffers: Buffers, dst_buffers: Buffers, *, decide: bool = True) -> RunStats:
        """Move the bytes; ``dst_buffers`` are written in place. Collective over the group.

        Raises ``LayoutError`` on every rank, with no byte moved, for bad buffers or a plan or options
        that differ between ranks; :class:`~reshard.execution.control.RefitError` on every rank when a
        rank fails, dies or stalls during the run (destination buffers may then hold a mix of old and
        new values). ``decide=False`` leaves the final decision to the caller (a refit session, which
        decides after its own post-processing)."""
        self.where, self.touched = "agreement", False
        self.group.check_usable("agreement")
        error = self.check(src_buffers, dst_buffers)
        agree_before_moving(self.group, self.plan.fingerprint(), error, self.options, self.timeout)
        failure = None
        try:
            self.touched = True
            device = device_of(src_buffers, dst_buffers)
            with torch.inference_mode():  # writes autograd leaves and inference tensors in place
                phases = self.move(src_buffers, dst_buffers, device)
        except RefitError as e:
            failure = RefitError(e.phase, str(e).partition(": ")[2], ranks=e.ranks)
        except Exception as e:  # noqa: BLE001 - every rank hears of it
            failure = RefitError(self.where, f"rank {self.rank}: {type(e).__name__}: {e}", ranks=[self.rank])
        end_of_run(self.group, failure, decide, self.timeout)
        return RunStats.of_phases(self.rank, phases)

    def move(self, src_buffers: Buffers, dst_buffers: Buffers, device: torch.device) -> list[PhaseStats]:
        """Every phase's bytes, in order, with no check, agreement or decision: the part of :meth:`run`
        that a composite executor (:class:`~reshard.execution.hybrid.HybridExecutor`) runs after its
        own checks. Later phases read what earlier ones wrote into ``dst_buffers``."""
        if self.steps is not None:
            return [self._run_step(s, step, src_buffers, dst_buffers, device) for s, step in enumerate(self.steps)]
        return [self._run_phase(name, part, src_buffers if i == 0 else dst_buffers, dst_buffers, device)
                for i, (name, part) in enumerate(zip(self.plan.phase_names, self.parts))]

    def _run_phase(self, name: str, part: RankPlan, src_buffers: Buffers, dst_buffers: Buffers,
                   device: torch.device) -> PhaseStats:
        start = time.perf_counter()
        slots = _Slots.of(part, self.overlap, DIGEST_BYTES if self.checksum else 0)
        # one staging arena for every round (fresh buffers each round cost page faults / allocator work)
        arena = torch.empty(slots.nbytes, dtype=torch.uint8, device=device)
        self._rounds(name, part, src_buffers, dst_buffers, slots, arena)
        del arena
        return_free_heap()
        self.where = f"{name} fan-out"
        copy_within(part.fanout, dst_buffers, dst_buffers, self.rank)
        synchronize(device)
        local = sum(c.nbytes for c in part.local + part.fanout)
        return PhaseStats(name, time.perf_counter() - start, part.send_bytes, part.recv_bytes, local, slots.nbytes,
                          part.num_rounds, len(part.sends))

    def _run_step(self, index: int, step: list, src_buffers: Buffers, dst_buffers: Buffers,
                  device: torch.device) -> PhaseStats:
        """One step of a pipelined plan: every phase in it (phase p of chunk ``index - p``) moves its
        sub-rounds together, in the order of :meth:`_rounds`; fan-out copies after its last sub-round.
        Phases of one step touch different tensors (their chunks differ), and a phase's chunk reads
        only what earlier steps wrote."""
        start = time.perf_counter()
        names = self.plan.phase_names
        name = f"step {index} (" + ", ".join(f"{names[sp.phase]} chunk {index - sp.phase}" for sp in step) + ")"
        rounds = _StepRounds(step)
        slots = _Slots.of(rounds, self.overlap, DIGEST_BYTES if self.checksum else 0)
        arena = torch.empty(slots.nbytes, dtype=torch.uint8, device=device)
        reads = {id(m): (src_buffers if sp.phase == 0 else dst_buffers) for sp in step for m in sp.part.sends}
        locals_ = [(sp.part.local, src_buffers if sp.phase == 0 else dst_buffers) for sp in step]
        self._rounds(name, rounds, src_buffers, dst_buffers, slots, arena, reads=reads, locals_=locals_)
        del arena
        self.where = f"{name} fan-out"
        for sp in step:
            copy_within(sp.part.fanout, dst_buffers, dst_buffers, self.rank)
        synchronize(device)
        local = sum(c.nbytes for sp in step for c in sp.part.local + sp.part.fanout)
        return PhaseStats(name, time.perf_counter() - start, rounds.send_bytes, rounds.recv_bytes, local, slots.nbytes,
                          rounds.num_rounds, len(rounds.sends))

    def _rounds(self, name: str, part: RankPlan, src_buffers: Buffers, dst_buffers: Buffers, slots: _Slots,
                arena: torch.Tensor, reads: dict | None = None, locals_: list | None = None) -> None:
        """The local copies and every round of a phase, in the order the module doc shows (``reads``:
        the buffers each send message packs from, by id, default ``src_buffers``; ``locals_``: the
        local copies with the buffers they read, default ``part.local`` from ``src_buffers``)."""
        rank, checksum = self.rank, self.checksum
        reads = reads or {}
        local_runs = [(part.local, src_buffers)] if locals_ is None else locals_

        def copy_locals() -> None:
            for copies, source in local_runs:
                copy_within(copies, source, dst_buffers, rank)

        def packed(j: int) -> _Round:
            self.where = f"{name} round {j}"
            sends, recvs = part.round(j)
            out, inc = slots.views(arena, j, sends, recvs)
            for m, t in zip(sends, out):
                pack(m, reads.get(id(m), src_buffers), rank, t[: m.nbytes])
                if checksum:
                    t[m.nbytes:] = _digest(t[: m.nbytes])
            faults.hit(f"{name} round {j}", out[0] if out else None)
            return _Round(j, sends, recvs, out, inc)

        def post(r: _Round) -> list:
            self.where = f"{name} round {r.index}"
            return self.group.post([(t, m.peer) for m, t in zip(r.sends, r.out)],
                                   [(t, m.peer) for m, t in zip(r.recvs, r.inc)])

        def wait(r: _Round, works: list) -> None:
            self.group.wait(works, f"{name} round {r.index}", self.timeout)

        def unpacked(r: _Round) -> None:
            for m, t in zip(r.recvs, r.inc):
                if checksum and not torch.equal(t[m.nbytes:], _digest(t[: m.nbytes])):
                    raise RefitError(f"{name} round {r.index}", f"the message from rank {m.peer} to rank {rank} "
                                     f"fails its checksum (corrupted in transit)", ranks=[m.peer, rank])
                unpack(m, t[: m.nbytes], dst_buffers, rank)

        n = part.num_rounds
        if not self.overlap or n == 0:
            copy_locals()
            for j in range(n):
                r = packed(j)
                wait(r, post(r))
                unpacked(r)
            return
        cur = packed(0)
        works, prev = post(cur), None
        copy_locals()  # while round 0 is on the wire
        for j in range(n):
            nxt = packed(j + 1) if j + 1 < n else None  # while round j is on the wire
            if prev is not None:
                unpacked(prev)
            wait(cur, works)
            prev, cur = cur, nxt
            works = post(cur) if cur is not None else []
        unpacked(prev)


def _digest(payload: torch.Tensor) -> torch.Tensor:
    """xxh3-64 of a uint8 payload, as 8 bytes on its device (CUDA payloads are hashed on the host)."""
    value = xxhash.xxh3_64_intdigest(payload.cpu().numpy())
    return torch.from_numpy(np.array([value], dtype=np.uint64).view(np.uint8)).to(payload.device)


class _Round(NamedTuple):
    """One round's messages and their staging views (``out`` packed, ``inc`` to receive into)."""

    index: int
    sends: list[Message]
    recvs: list[Message]
    out: list[torch.Tensor]
    inc: list[torch.Tensor]


class _StepRounds(RankPlan):
    """A pipelined step's messages as one rank part: sub-round ``j`` holds the ``j``-th message of
    every stream of every phase in the step, each phase's messages in phase order (both ends of a
    stream post them in the same order)."""

    def __init__(self, step: list) -> None:
        super().__init__(step[0].part.rank if step else -1)
        for sp in step:
            self.sends.extend(sp.part.sends)
            self.recvs.extend(sp.part.recvs)
        order = {id(m): i for i, m in enumerate(self.sends + self.recvs)}
        self.sends.sort(key=lambda m: (m.round, order[id(m)]))
        self.recvs.sort(key=lambda m: (m.round, order[id(m)]))


def run_local_pipelined(plan, src_buffers, dst_buffers) -> None:
    """Every rank's part of a pipelined hierarchical plan in this process, step by step and sub-round
    by sub-round, through the packing functions the executor uses (``run_local`` calls it)."""
    ranks = sorted(set(plan.source.ranks) | set(plan.destination.ranks))
    steps = {r: plan.steps_for_rank(r) for r in ranks}
    empty: dict[str, torch.Tensor] = {}
    for s in range(plan.num_steps):
        for r in ranks:
            for sp in steps[r][s]:
                source = src_buffers if sp.phase == 0 else dst_buffers
                copy_within(sp.part.local, source.get(r, empty), dst_buffers.get(r, empty), r)
        for r in ranks:
            for sp in steps[r][s]:
                source = (src_buffers if sp.phase == 0 else dst_buffers).get(r, empty)
                for m in sp.part.sends:
                    theirs = next(x for x in steps[m.peer][s] if x.phase == sp.phase)
                    peer_msg = next(x for x in theirs.part.recvs if x.peer == r and x.round == m.round)
                    unpack(peer_msg, pack(m, source, r), dst_buffers.get(m.peer, empty), m.peer)
        for r in ranks:
            for sp in steps[r][s]:
                copy_within(sp.part.fanout, dst_buffers.get(r, empty), dst_buffers.get(r, empty), r)


class _Slots:
    """Where each round's staging buffers sit in the arena: ``depth`` slots of sends, then
    ``depth`` slots of receives; round ``j`` uses slot ``j % depth``."""

    def __init__(self, send_bytes: int, recv_bytes: int, depth: int, extra: int = 0) -> None:
        self.send_bytes, self.recv_bytes, self.depth, self.extra = send_bytes, recv_bytes, depth, extra
        self.nbytes = depth * (send_bytes + recv_bytes)

    @classmethod
    def of(cls, part: RankPlan, overlap: bool, extra: int = 0) -> _Slots:
        """Slots for ``part``'s rounds; ``extra`` bytes ride after each message (its digest)."""
        rounds = [part.round(j) for j in range(part.num_rounds)]

        def size(msgs) -> int:
            return sum(m.nbytes + extra for m in msgs)

        if not overlap or len(rounds) < 2:  # one slot for both: the largest round
            return cls(max((size(s + r) for s, r in rounds), default=0), 0, 1, extra)
        return cls(max(size(s) for s, _ in rounds), max(size(r) for _, r in rounds), 2, extra)

    def views(self, arena: torch.Tensor, j: int, sends: Sequence[Message], recvs: Sequence[Message]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        slot = j % self.depth
        pos = slot * self.send_bytes
        out = []
        for m in sends:
            out.append(arena[pos: pos + m.nbytes + self.extra])
            pos += m.nbytes + self.extra
        if self.recv_bytes:
            pos = self.depth * self.send_bytes + slot * self.recv_bytes
        inc = []
        for m in recvs:
            inc.append(arena[pos: pos + m.nbytes + self.extra])
            pos += m.nbytes + self.extra
        return out, inc


def execute(plan: PhasedPlan, src_buffers: Buffers, dst_buffers: Buffers, group: Group | dist.ProcessGroup | None = None, *,
            timeout: timedelta = DEFAULT_TIMEOUT, **options) -> RunStats:
    """One-shot :class:`ReshardExecutor` run (collective over ``group``; ``options`` as the executor's)."""
    return ReshardExecutor(plan, group, timeout=timeout, **options).run(src_buffers, dst_buffers)
