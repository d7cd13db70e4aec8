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

Before any byte moves, every rank checks its buffers against the plan and all ranks compare
plan fingerprints (:func:`~reshard.execution.base.agree`). Every wait is bounded by ``timeout``;
a rank that fails mid-run raises, and its peers' waits time out.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..planning.plan import PhasedPlan, RankPlan
from ..planning.schedule import Message
from .base import Executor, PhaseStats, RunStats, agree, check_buffers, device_of, synchronize
from .group import DEFAULT_TIMEOUT, Group
from .packing import Buffers, copy_within, pack, unpack


class ReshardExecutor(Executor):
    """Runs every phase of ``plan`` on this rank. Every rank of ``group`` (a :class:`Group`, a torch
    process group, or ``None`` for the default one; the plan's ranks are the group's) constructs one
    and calls :meth:`run`; ``timeout`` bounds every wait, so a peer that never shows up raises
    instead of hanging. ``overlap`` packs and unpacks neighbouring rounds while a round is on the
    wire (see module doc); ranks may differ in it, the bytes moved are the same.
    """

    def __init__(self, plan: PhasedPlan, group: Group | dist.ProcessGroup | None = None, *,
                 timeout: timedelta = DEFAULT_TIMEOUT, overlap: bool = True) -> None:
        self.plan = plan
        self.group = Group.of(group)
        self.timeout = timeout
        self.overlap = overlap
        self.rank = self.group.rank
        self.parts: list[RankPlan] = [p.for_rank(self.rank) for p in plan.phases]

    def check(self, src: Buffers, dst: Buffers) -> str | None:
        """The first problem with this rank's buffers for the plan (missing, wrong shape or dtype), or None."""
        for i, (phase, part) in enumerate(zip(self.plan.phases, self.parts)):
            need_src = {c.src_buffer for m in part.sends for c in m.copies} | {c.src_buffer for c in part.local}
            need_dst = ({c.dst_buffer for m in part.recvs for c in m.copies} | {c.dst_buffer for c in part.local}
                        | {c.dst_buffer for c in part.fanout} | {c.src_buffer for c in part.fanout})
            error = (check_buffers(phase.source, self.rank, src if i == 0 else dst, need_src,
                                   "source" if i == 0 else "destination")
                     or check_buffers(phase.destination, self.rank, dst, need_dst, "destination"))
            if error:
                return error
        return None

    def staging_bytes(self) -> int:
        """Staging this rank allocates in its busiest phase (what ``RunStats.peak_staging_bytes`` reports).

        Sequential: the largest round's sends plus receives (<= ``max_bucket_bytes``, plus the
        largest single copy). Overlapped, with two rounds or more: twice the largest round's sends
        plus twice the largest round's receives; since every stream's per-round quota is fixed
        and a rank's quotas add up to at most ``max_bucket_bytes``, that is at most twice the
        sequential bound. To keep a total cap ``C`` with overlap, plan with ``max_bucket_bytes=C // 2``
        (:func:`reshard.execution.methods.method_plan` does: the demo and refit sessions keep ``C``).
        """
        return max((_Slots.of(part, self.overlap).nbytes for part in self.parts), default=0)

    def run(self, src_buffers: Buffers, dst_buffers: Buffers) -> RunStats:
        """Move the bytes; ``dst_buffers`` are written in place. Collective over the group."""
        agree(self.group, self.plan.fingerprint(), self.check(src_buffers, dst_buffers))
        device = device_of(src_buffers, dst_buffers)
        phases = [self._run_phase(name, part, src_buffers if i == 0 else dst_buffers, dst_buffers, device)
                  for i, (name, part) in enumerate(zip(self.plan.phase_names, self.parts))]
        return RunStats.of_phases(self.rank, phases)

    def _run_phase(self, name: str, part: RankPlan, src_buffers: Buffers, dst_buffers: Buffers,
                   device: torch.device) -> PhaseStats:
        start = time.perf_counter()
        slots = _Slots.of(part, self.overlap)
        # one staging arena for every round (fresh buffers each round cost page faults / allocator work)
        arena = torch.empty(slots.nbytes, dtype=torch.uint8, device=device)
        self._rounds(part, src_buffers, dst_buffers, slots, arena)
        del arena
        copy_within(part.fanout, dst_buffers, dst_buffers, self.rank)
        synchronize(device)
        local = sum(c.nbytes for c in part.local + part.fanout)
        return PhaseStats(name, time.perf_counter() - start, part.send_bytes, part.recv_bytes, local, slots.nbytes,
                          part.num_rounds, len(part.sends))

    def _rounds(self, part: RankPlan, src_buffers: Buffers, dst_buffers: Buffers, slots: _Slots,
                arena: torch.Tensor) -> None:
        """The local copies and every round of a phase, in the order the module doc shows."""
        rank, timeout = self.rank, self.timeout

        def packed(j: int) -> _Round:
            sends, recvs = part.round(j)
            out, inc = slots.views(arena, j, sends, recvs)
            return _Round(sends, recvs, [pack(m, src_buffers, rank, t) for m, t in zip(sends, out)], inc)

        def post(r: _Round) -> list:
            return self.group.post([(t, m.peer) for m, t in zip(r.sends, r.out)],
                                   [(t, m.peer) for m, t in zip(r.recvs, r.inc)])

        def unpacked(r: _Round) -> None:
            for m, t in zip(r.recvs, r.inc):
                unpack(m, t, dst_buffers, rank)

        n = part.num_rounds
        if not self.overlap or n == 0:
            copy_within(part.local, src_buffers, dst_buffers, rank)
            for j in range(n):
                r = packed(j)
                _wait(post(r), timeout)
                unpacked(r)
            return
        cur = packed(0)
        works, prev = post(cur), None
        copy_within(part.local, src_buffers, dst_buffers, rank)  # while round 0 is on the wire
        for j in range(n):
            nxt = packed(j + 1) if j + 1 < n else None  # while round j is on the wire
            if prev is not None:
                unpacked(prev)
            _wait(works, timeout)
            prev, cur = cur, nxt
            works = post(cur) if cur is not None else []
        unpacked(prev)


class _Round(NamedTuple):
    """One round's messages and their staging views (``out`` packed, ``inc`` to receive into)."""

    sends: list[Message]
    recvs: list[Message]
    out: list[torch.Tensor]
    inc: list[torch.Tensor]


class _Slots:
    """Where each round's staging buffers sit in the arena: ``depth`` slots of sends, then
    ``depth`` slots of receives; round ``j`` uses slot ``j % depth``."""

    def __init__(self, send_bytes: int, recv_bytes: int, depth: int) -> None:
        self.send_bytes, self.recv_bytes, self.depth = send_bytes, recv_bytes, depth
        self.nbytes = depth * (send_bytes + recv_bytes)

    @classmethod
    def of(cls, part: RankPlan, overlap: bool) -> _Slots:
        rounds = [part.round(j) for j in range(part.num_rounds)]
        if not overlap or len(rounds) < 2:  # one slot for both: the largest round
            return cls(max((sum(m.nbytes for m in s + r) for s, r in rounds), default=0), 0, 1)
        return cls(max(sum(m.nbytes for m in s) for s, _ in rounds), max(sum(m.nbytes for m in r) for _, r in rounds), 2)

    def views(self, arena: torch.Tensor, j: int, sends: Sequence[Message], recvs: Sequence[Message]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        slot = j % self.depth
        pos = slot * self.send_bytes
        out = []
        for m in sends:
            out.append(arena[pos: pos + m.nbytes])
            pos += m.nbytes
        if self.recv_bytes:
            pos = self.depth * self.send_bytes + slot * self.recv_bytes
        inc = []
        for m in recvs:
            inc.append(arena[pos: pos + m.nbytes])
            pos += m.nbytes
        return out, inc


def _wait(works: list, timeout: timedelta) -> None:
    for w in works:
        w.wait(timeout)


def execute(plan: PhasedPlan, src_buffers: Buffers, dst_buffers: Buffers, group: Group | dist.ProcessGroup | None = None, *,
            timeout: timedelta = DEFAULT_TIMEOUT, overlap: bool = True) -> RunStats:
    """One-shot :class:`ReshardExecutor` run (collective over ``group``)."""
    return ReshardExecutor(plan, group, timeout=timeout, overlap=overlap).run(src_buffers, dst_buffers)
