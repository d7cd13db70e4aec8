"""The reshard executor: run one rank's part of a plan over a torch.distributed group.

Phase by phase (a direct plan has one; a hierarchical plan runs its network phase, then its
relay and NVLink forward phases from the destination buffers the earlier phases filled), round
by round: the rank packs what it sends to each peer into one contiguous staging buffer, posts
every send and receive of the round at once (``batch_isend_irecv``), and unpacks each received
buffer in place into the caller's destination tensors (live parameters: no model-sized copy).
Local copies run first in a phase, fan-out copies last. Works on CPU tensors with gloo and
CUDA tensors with NCCL: the byte handling is plain torch ops.

Before any byte moves, every rank checks its buffers against the plan and all ranks compare
plan fingerprints (:func:`~reshard.execution.base.agree`).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..planning.plan import PhasedPlan, RankPlan
from .base import Executor, PhaseStats, RunStats, agree, check_buffers, device_of, synchronize
from .group import DEFAULT_TIMEOUT, Group
from .packing import Buffers, copy_within, pack, unpack


class ReshardExecutor(Executor):
    """Runs every phase of ``plan`` on this rank. Every rank of ``group`` (a :class:`Group`, a torch
    process group, or ``None`` for the default one; the plan's ranks are the group's) constructs one
    and calls :meth:`run`; ``timeout`` bounds every wait, so a peer that never shows up raises
    instead of hanging.
    """

    def __init__(self, plan: PhasedPlan, group: Group | dist.ProcessGroup | None = None, *,
                 timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        self.plan = plan
        self.group = Group.of(group)
        self.timeout = timeout
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

    def run(self, src_buffers: Buffers, dst_buffers: Buffers) -> RunStats:
        """Move the bytes; ``dst_buffers`` are written in place. Collective over the group."""
        agree(self.group, self.plan.fingerprint(), self.check(src_buffers, dst_buffers))
        device = device_of(src_buffers, dst_buffers)
        phases = [self._run_phase(name, part, src_buffers if i == 0 else dst_buffers, dst_buffers, device)
                  for i, (name, part) in enumerate(zip(self.plan.phase_names, self.parts))]
        return RunStats.of_phases(self.rank, phases)

    def _run_phase(self, name: str, part: RankPlan, src_buffers: Buffers, dst_buffers: Buffers,
                   device: torch.device) -> PhaseStats:
        rank = self.rank
        start = time.perf_counter()
        copy_within(part.local, src_buffers, dst_buffers, rank)
        peak = 0
        # one staging arena for every round (fresh buffers each round cost page faults / allocator work)
        arena = torch.empty(part.peak_staging_bytes(), dtype=torch.uint8, device=device)
        for j in range(part.num_rounds):
            sends, recvs = part.round(j)
            views, pos = [], 0
            for m in sends + recvs:
                views.append(arena[pos: pos + m.nbytes])
                pos += m.nbytes
            out = [pack(m, src_buffers, rank, v) for m, v in zip(sends, views)]
            inc = views[len(sends):]
            peak = max(peak, pos)
            self.group.exchange([(t, m.peer) for m, t in zip(sends, out)], [(t, m.peer) for m, t in zip(recvs, inc)],
                                self.timeout)
            for m, t in zip(recvs, inc):
                unpack(m, t, dst_buffers, rank)
            del out, inc, views
        del arena
        copy_within(part.fanout, dst_buffers, dst_buffers, rank)
        synchronize(device)
        local = sum(c.nbytes for c in part.local + part.fanout)
        return PhaseStats(name, time.perf_counter() - start, part.send_bytes, part.recv_bytes, local, peak,
                          part.num_rounds, len(part.sends))


def execute(plan: PhasedPlan, src_buffers: Buffers, dst_buffers: Buffers, group: Group | dist.ProcessGroup | None = None, *,
            timeout: timedelta = DEFAULT_TIMEOUT) -> RunStats:
    """One-shot :class:`ReshardExecutor` run (collective over ``group``)."""
    return ReshardExecutor(plan, group, timeout=timeout).run(src_buffers, dst_buffers)
