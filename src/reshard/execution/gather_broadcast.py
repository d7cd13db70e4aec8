"""The baseline executor: gather each full tensor on one source rank, broadcast it to every destination.

It runs the steps of :mod:`reshard.planning.baseline` one tensor at a time, as RL stacks do: the
sources send their parts of the tensor to the root, the root assembles it and broadcasts it to
every destination rank (a broadcast group of the root and the destinations), and each destination
copies its pieces out of it. It takes the same plan and buffers as
:class:`~reshard.execution.executor.ReshardExecutor`, so both run in one program on the same data.
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

from ..planning.baseline import broadcast_members, default_root, gather_plan
from ..planning.plan import Plan
from ..planning.schedule import Copy, Message
from ..tensors import box_slices, buffer_view
from .base import Executor, PhaseStats, RunStats, agree, check_buffers, device_of, synchronize
from .group import DEFAULT_TIMEOUT, Group
from .packing import Buffers, copy_within, pack, unpack


class GatherBroadcastExecutor(Executor):
    """Gather-and-broadcast over ``group`` (see module doc). Every rank of the group must construct
    it (it creates the broadcast group) and call :meth:`run`. Its stats have two phases, ``gather``
    and ``broadcast``, each summed over the tensors."""

    needed_bytes_only = False
    bounded_staging = False

    def __init__(self, plan: Plan, group: Group | dist.ProcessGroup | None = None, *, root: int | None = None,
                 timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        self.plan = plan
        self.group = Group.of(group)
        self.timeout = timeout
        self.rank = self.group.rank
        self.root = default_root(plan) if root is None else root
        self.gather = gather_plan(plan, self.root)
        self.members = broadcast_members(plan, self.root)
        self.bcast_group = self.group.split(self.members)
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
        """Move the bytes; ``dst_buffers`` are written in place. Collective over the group."""
        rank, root = self.rank, self.root
        need_src = {c.src_buffer for cs in self.sends.values() for c in cs} | {
            c.src_buffer for cs in self.local.values() for c in cs}
        need_dst = {p.buffer for ps in self.my_pieces.values() for p in ps}
        agree(self.group, self.plan.fingerprint(),
              check_buffers(self.plan.source, rank, src_buffers, need_src, "source")
              or check_buffers(self.plan.destination, rank, dst_buffers, need_dst, "destination"))
        device = device_of(src_buffers, dst_buffers)
        gather = PhaseStats("gather", 0.0, 0, 0, 0, 0, 0, 0)
        bcast = PhaseStats("broadcast", 0.0, 0, 0, 0, 0, 0, 0)
        for name in self.plan.tensors:
            t0 = time.perf_counter()
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
                self.group.exchange([], [(b, m.peer) for m, b in zip(msgs, bufs)], self.timeout)
                for m, b in zip(msgs, bufs):
                    unpack(m, b, {name: full}, rank)
                    gather.recv_bytes += m.payload_bytes
            elif name in self.sends:
                m = Message(root, 0, self.sends[name])
                payload = pack(m, src_buffers, rank)
                staging += m.nbytes
                self.group.exchange([(payload, root)], [], self.timeout)
                gather.sent_bytes += m.payload_bytes
                gather.messages += 1
            t1 = time.perf_counter()
            if full is not None:
                flat = full.reshape(-1).view(torch.uint8)
                self.bcast_group.broadcast(flat, self.members.index(root), self.timeout)
                if rank == root:
                    bcast.sent_bytes += flat.numel() * (len(self.members) - 1)
                else:
                    bcast.recv_bytes += flat.numel()
                bcast.messages += 1
                for p in self.my_pieces.get(name, []):
                    buffer_view(dst_buffers[p.buffer], p.buffer_offsets, p.sizes).copy_(
                        full[box_slices(p.offsets, p.sizes)])
            gather.seconds += t1 - t0
            bcast.seconds += time.perf_counter() - t1
            gather.peak_staging_bytes = bcast.peak_staging_bytes = max(gather.peak_staging_bytes, staging)
        t = time.perf_counter()
        synchronize(device)
        bcast.seconds += time.perf_counter() - t
        gather.rounds = bcast.rounds = len(self.plan.tensors)
        return RunStats.of_phases(rank, [gather, bcast])
