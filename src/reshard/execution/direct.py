"""The reshard executor: run one rank's part of a plan over a torch.distributed group.

Per round, the rank packs what it sends to each peer into one contiguous staging
buffer, posts every send and receive of the round at once
(``batch_isend_irecv``), and unpacks each received buffer in place into the
caller's destination tensors (live parameters: no model-sized copy). Local copies
run first, fan-out copies last. Works on CPU tensors with gloo and CUDA tensors
with NCCL: the byte handling is plain torch ops.

Before any byte moves, every rank checks its buffers against the plan and all
ranks compare plan fingerprints; any problem raises :class:`LayoutError` on every
rank, naming the rank at fault, and no destination tensor has been touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from ..layout import Layout
from ..planning.plan import Plan, RankPlan
from ..tensors import LayoutError
from .local import copy_within, pack, unpack

Buffers = Mapping[str, torch.Tensor]


@dataclass
class RunStats:
    """What one rank did in one run."""

    rank: int
    seconds: float
    sent_bytes: int
    recv_bytes: int
    local_bytes: int
    peak_staging_bytes: int
    rounds: int
    messages: int


def check_buffers(layout: Layout, rank: int, buffers: Buffers, needed: set[str], side: str) -> str | None:
    """``None`` if ``buffers`` has every buffer in ``needed`` with the layout's shape and dtype."""
    for name in sorted(needed):
        shape, dtype = layout.buffer_spec(rank, name)
        t = buffers.get(name)
        if t is None:
            return f"rank {rank}: {side} buffer {name!r} was not given"
        if tuple(t.shape) != shape or t.dtype != dtype:
            return (f"rank {rank}: {side} buffer {name!r} is {tuple(t.shape)} {t.dtype}, the layout says "
                    f"{shape} {dtype}")
    return None


def agree(group, fingerprint: str, error: str | None) -> None:
    """Collective: raise the same LayoutError on every rank if any rank has an error or another plan."""
    world = dist.get_world_size(group)
    seen: list = [None] * world
    dist.all_gather_object(seen, (dist.get_rank(), fingerprint, error), group=group)
    errors = [e for _, _, e in seen if e]
    if errors:
        raise LayoutError("; ".join(errors))
    prints = {fp for _, fp, _ in seen}
    if len(prints) > 1:
        detail = ", ".join(f"rank {r}: {fp}" for r, fp, _ in seen)
        raise LayoutError(f"ranks disagree on the plan fingerprint ({detail})")


class ReshardExecutor:
    """Runs ``plan`` on this rank. Every rank of ``group`` constructs one and calls :meth:`run`.

    ``timeout`` bounds every wait; a peer that never shows up raises instead of hanging.
    """

    def __init__(self, plan: Plan, group=None, *, timeout: timedelta = timedelta(minutes=5)) -> None:
        self.plan = plan
        self.group = group
        self.timeout = timeout
        self.rank = dist.get_rank()
        self.part: RankPlan = plan.for_rank(self.rank)

    def _validate(self, src: Buffers, dst: Buffers) -> str | None:
        p, part = self.plan, self.part
        need_src = {c.src_buffer for m in part.sends for c in m.copies} | {c.src_buffer for c in part.local}
        need_dst = ({c.dst_buffer for m in part.recvs for c in m.copies} | {c.dst_buffer for c in part.local}
                    | {c.dst_buffer for c in part.fanout} | {c.src_buffer for c in part.fanout})
        return (check_buffers(p.source, self.rank, src, need_src, "source")
                or check_buffers(p.destination, self.rank, dst, need_dst, "destination"))

    def run(self, src_buffers: Buffers, dst_buffers: Buffers) -> RunStats:
        """Move the bytes; ``dst_buffers`` are written in place. Collective over the group."""
        agree(self.group, self.plan.fingerprint(), self._validate(src_buffers, dst_buffers))
        part, rank = self.part, self.rank
        start = time.perf_counter()
        copy_within(part.local, src_buffers, dst_buffers, rank)
        peak = 0
        device = device_of(src_buffers, dst_buffers)
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
            ops = [dist.P2POp(dist.isend, t, m.peer, self.group) for m, t in zip(sends, out)]
            ops += [dist.P2POp(dist.irecv, t, m.peer, self.group) for m, t in zip(recvs, inc)]
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait(self.timeout)
            for m, t in zip(recvs, inc):
                unpack(m, t, dst_buffers, rank)
            del out, inc, views
        del arena
        copy_within(part.fanout, dst_buffers, dst_buffers, rank)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        local = sum(c.nbytes for c in part.local + part.fanout)
        return RunStats(rank, time.perf_counter() - start, part.send_bytes, part.recv_bytes, local, peak,
                        part.num_rounds, len(part.sends))


class HierarchicalExecutor:
    """Runs a :class:`~reshard.planning.hierarchy.HierarchicalPlan`: its network phase, then its relay and
    NVLink forward phases, which read the destination buffers the earlier phases filled.

    Every rank of ``group`` constructs one and calls :meth:`run`, like :class:`ReshardExecutor`.
    """

    def __init__(self, plan, group=None, *, timeout: timedelta = timedelta(minutes=5)) -> None:
        self.plan = plan
        self.phases = [ReshardExecutor(p, group, timeout=timeout) for p in plan.phases]

    def run(self, src_buffers: Buffers, dst_buffers: Buffers) -> list[RunStats]:
        """Move the bytes (per-phase stats); ``dst_buffers`` are written in place."""
        first, *later = self.phases
        return [first.run(src_buffers, dst_buffers)] + [p.run(dst_buffers, dst_buffers) for p in later]


def device_of(*groups: Buffers) -> torch.device:
    """The device of the first buffer given (CPU if none): where staging buffers go."""
    for g in groups:
        for t in g.values():
            return t.device
    return torch.device("cpu")


def execute(plan: Plan, src_buffers: Buffers, dst_buffers: Buffers, group=None, *,
            timeout: timedelta = timedelta(minutes=5)) -> RunStats:
    """One-shot :class:`ReshardExecutor` run (collective over ``group``)."""
    return ReshardExecutor(plan, group, timeout=timeout).run(src_buffers, dst_buffers)
