"""The baseline RL stacks use today: gather each full tensor on one source rank, broadcast it.

For each tensor, in order: the source ranks send their parts of it to ``root`` (a
source rank, the lowest by default, like training rank 0), ``root`` assembles the
full tensor, broadcasts it to every destination rank, and each destination copies
its pieces out of it. Every destination receives every byte of every tensor.
It takes the same plan and buffers as :class:`reshard.execution.direct.ReshardExecutor`, so
both run in one program on the same data.

Per-rank bytes for tensor ``t`` on 4 -> 3 ranks (root 0)::

    rank        0 (root)          1..3 (sources)     4..6 (destinations)
    receives    3/4 of t          0                  all of t
    sends       3 x t (logical)   1/4 of t each      0
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

from ..layout import Layout
from ..placements import Replicate
from ..planning.plan import Plan
from ..planning.schedule import Copy, Message
from ..tensors import buffer_view
from .direct import Buffers, RunStats, agree, check_buffers, device_of
from .local import copy_within, pack, unpack


def gather_layout(plan: Plan, root: int) -> Layout:
    """Full tensors on ``root``, each in a buffer named after it, in the destination's dtype."""
    layouts = []
    for name in plan.tensors:
        spec = plan.destination.specs[name]
        t = plan.destination.tables[name]
        dtype = plan.destination.buffer_spec(int(t.ranks[0]), t.buffers[0])[1]
        layouts.append(Layout.from_placements(spec, [root], (1,), [Replicate()], dtype=dtype))
    return Layout.merge(layouts)


def gather_broadcast_bytes(plan: Plan, root: int | None = None) -> dict[str, int]:
    """Logical bytes the baseline moves: ``gather`` (to root), ``broadcast`` (root to each destination)."""
    root = min(plan.source.ranks) if root is None else root
    gather = Plan(plan.source, gather_layout(plan, root))
    receivers = [r for r in plan.destination.ranks if r != root]
    full = sum(gather.destination.specs[n].numel * gather.destination.buffer_spec(root, n)[1].itemsize
               for n in plan.tensors)
    return {"gather": gather.wire_bytes, "broadcast": full * len(receivers)}


class GatherBroadcastExecutor:
    """Gather-and-broadcast over ``group`` (see module doc). Every rank of the group
    must construct it (it creates the broadcast group) and call :meth:`run`."""

    def __init__(self, plan: Plan, group=None, *, root: int | None = None,
                 timeout: timedelta = timedelta(minutes=5)) -> None:
        self.plan = plan
        self.group = group
        self.timeout = timeout
        self.rank = dist.get_rank()
        self.root = min(plan.source.ranks) if root is None else root
        self.gather = Plan(plan.source, gather_layout(plan, self.root))
        members = sorted({self.root} | set(plan.destination.ranks))
        self.members = members
        self.bcast_group = dist.new_group(members)
        part = self.gather.for_rank(self.rank)
        # per tensor: what this rank sends to root / root receives from each source / root copies locally
        self.sends: dict[str, list[Copy]] = defaultdict(list)
        self.recvs: dict[str, dict[int, list[Copy]]] = defaultdict(lambda: defaultdict(list))
        for m in part.sends:
            for c in m.copies:
                self.sends[c.tensor].append(c)
        for m in part.recvs:
            for c in m.copies:
                self.recvs[c.tensor][m.peer].append(c)
        self.local: dict[str, list[Copy]] = defaultdict(list)
        for c in part.local:
            self.local[c.tensor].append(c)
        self.my_pieces = defaultdict(list)
        for p in plan.destination.pieces(self.rank):
            self.my_pieces[p.tensor].append(p)

    def run(self, src_buffers: Buffers, dst_buffers: Buffers) -> RunStats:
        rank, root = self.rank, self.root
        need_src = {c.src_buffer for cs in self.sends.values() for c in cs} | {
            c.src_buffer for cs in self.local.values() for c in cs}
        need_dst = {p.buffer for ps in self.my_pieces.values() for p in ps}
        agree(self.group, self.plan.fingerprint(),
              check_buffers(self.plan.source, rank, src_buffers, need_src, "source")
              or check_buffers(self.plan.destination, rank, dst_buffers, need_dst, "destination"))
        device = device_of(src_buffers, dst_buffers)
        start = time.perf_counter()
        sent = received = peak = 0
        for name in self.plan.tensors:
            shape, dtype = self.gather.destination.buffer_spec(root, name)
            full = None
            staging = 0
            if rank in self.members:
                full = torch.empty(shape, dtype=dtype, device=device)
                staging += full.numel() * full.element_size()
            if rank == root:
                copy_within(self.local.get(name, []), src_buffers, {name: full}, rank)
                msgs = [Message(peer, 0, cs) for peer, cs in sorted(self.recvs.get(name, {}).items())]
                bufs = [torch.empty(m.nbytes, dtype=torch.uint8, device=device) for m in msgs]
                staging += sum(m.nbytes for m in msgs)
                works = [dist.irecv(b, m.peer, group=self.group) for m, b in zip(msgs, bufs)]
                for w in works:
                    w.wait(self.timeout)
                for m, b in zip(msgs, bufs):
                    unpack(m, b, {name: full}, rank)
                    received += m.payload_bytes
            elif name in self.sends:
                m = Message(root, 0, self.sends[name])
                payload = pack(m, src_buffers, rank)
                staging += m.nbytes
                dist.isend(payload, root, group=self.group).wait(self.timeout)
                sent += m.payload_bytes
            if full is not None:
                flat = full.reshape(-1).view(torch.uint8)
                dist.broadcast(flat, src=root, group=self.bcast_group)
                nbytes = flat.numel()
                if rank == root:
                    sent += nbytes * (len(self.members) - 1)
                else:
                    received += nbytes
                for p in self.my_pieces.get(name, []):
                    buffer_view(dst_buffers[p.buffer], p.buffer_offsets, p.sizes).copy_(
                        full[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))])
            peak = max(peak, staging)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return RunStats(rank, time.perf_counter() - start, sent, received, 0, peak, len(self.plan.tensors),
                        len(self.plan.tensors))
