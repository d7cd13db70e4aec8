"""The baseline executor: gather each full tensor on one source rank, broadcast it to every destination.

It runs the steps of :mod:`reshard.planning.baseline` one tensor at a time, as RL stacks do: the
sources send their parts of the tensor to the root, the root assembles it and broadcasts it to
every destination rank (a broadcast group of the root and the destinations), and each destination
copies its pieces out of it. It takes the same plan and buffers as
:class:`~reshard.execution.executor.ReshardExecutor`, so both run in one program on the same data.

Its broadcast group is a subgroup it makes itself, so it owns it: :meth:`~GatherBroadcastExecutor.close`
(or a ``with`` block) releases it. Unreleased, each executor would keep a communicator and its
sockets (torch keeps every group registered with it), and a process building one per refit would run
out of file descriptors after a few dozen refits. Before the split, every rank checks that all ranks
have the same plan and the same root (:func:`~reshard.execution.base.agree`), so ranks that pass
different roots raise the same ``LayoutError`` instead of waiting in two different splits.
"""

from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

from ..planning.baseline import broadcast_members, default_root, gather_plan
from ..planning.plan import Plan
from ..planning.schedule import Copy, Message
from ..tensors import box_slices, buffer_view
from .base import Executor, PhaseStats, RunStats, agree, check_buffers, device_of, plan_ranks_problem, synchronize
from .group import DEFAULT_TIMEOUT, Group
from .heap import return_free_heap
from .packing import Buffers, copy_within, pack, unpack


class GatherBroadcastExecutor(Executor):
    """Gather-and-broadcast over ``group`` (see module doc). Every rank of the group must construct
    it with the same plan and ``root`` (construction is collective: it agrees on both, then creates
    the broadcast group), call :meth:`run`, and finally :meth:`close` it (or use it as a context
    manager). Its stats have two phases, ``gather`` and ``broadcast``, each summed over the tensors."""

    needed_bytes_only = False
    bounded_staging = False

    def __init__(self, plan: Plan, group: Group | dist.ProcessGroup | None = None, *, root: int | None = None,
                 timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        self.bcast_group: Group | None = None
        self.closed = False
        self.plan = plan
        self.group = Group.of(group)
        self.timeout = timeout
        self.rank = self.group.rank
        self.root = int(default_root(plan) if root is None else root)
        # collective before the split: ranks with another plan or root would otherwise each wait
        # in a different split (or the same split with other members) until the timeout
        agree(self.group, plan.fingerprint(), self._setup_problem(), self.options)
        self.gather = gather_plan(plan, self.root)
        self.members = broadcast_members(plan, self.root)
        self.bcast_group = self.group.split(self.members)
        try:
            if self.bcast_group is not None:
                # every member has finished connecting before any member may close the group again
                self.bcast_group.barrier(timeout)
        except BaseException:
            self.close()
            raise
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
        self.full_bytes = {}
        for name in plan.tensors:
            shape, dtype = self.gather.destination.buffer_spec(self.root, name)
            self.full_bytes[name] = math.prod(shape) * dtype.itemsize

    def _arena_layout(self) -> tuple[int, int, int, int]:
        """Offsets in the run's staging arena of the full tensor, the root's incoming messages and
        this rank's outgoing message (each sized for the largest tensor), and the arena's size."""
        full = max(self.full_bytes.values(), default=0) if self.rank in self.members else 0
        recv = max((sum(_aligned(Message(p, 0, cs).nbytes) for p, cs in by_peer.items())
                    for by_peer in self.recvs.values()), default=0) if self.rank == self.root else 0
        send = max((Message(self.root, 0, cs).nbytes for cs in self.sends.values()), default=0)
        return 0, _aligned(full), _aligned(full) + recv, _aligned(full) + recv + send

    @property
    def options(self) -> dict:
        """What every rank must agree on besides the plan."""
        return {"executor": "gather-broadcast", "root": self.root}

    def _setup_problem(self) -> str | None:
        """A plan or root this group cannot run, or None."""
        size = self.group.size
        if not 0 <= self.root < size:
            return f"rank {self.rank}: root {self.root} is outside this group of {size} ranks (0..{size - 1})"
        return plan_ranks_problem(self.plan, size, self.rank)

    def close(self) -> None:
        """Release the broadcast group (local, not collective; idempotent). The executor cannot run after."""
        self.closed = True
        bcast, self.bcast_group = self.bcast_group, None
        if bcast is not None:
            bcast.close()

    def __enter__(self) -> "GatherBroadcastExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # a forgotten close: release a gloo subgroup (local and quick). Not at interpreter exit (torch's
        # state may be gone), not after torch's default group was destroyed (it took its subgroups
        # with it), and not for NCCL, whose teardown may wait for the device inside a finalizer.
        bcast = getattr(self, "bcast_group", None)
        if bcast is None or sys.is_finalizing() or bcast.backend != "gloo":
            return
        if bcast.store is None and not dist.is_initialized():
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise
            pass

    def run(self, src_buffers: Buffers, dst_buffers: Buffers) -> RunStats:
        """Move the bytes; ``dst_buffers`` are written in place. Collective over the group."""
        if self.closed:
            raise RuntimeError(f"rank {self.rank}: this GatherBroadcastExecutor is closed")
        rank, root = self.rank, self.root
        need_src = {c.src_buffer for cs in self.sends.values() for c in cs} | {
            c.src_buffer for cs in self.local.values() for c in cs}
        need_dst = {p.buffer for ps in self.my_pieces.values() for p in ps}
        agree(self.group, self.plan.fingerprint(),
              check_buffers(self.plan.source, rank, src_buffers, need_src, "source")
              or check_buffers(self.plan.destination, rank, dst_buffers, need_dst, "destination"), self.options)
        device = device_of(src_buffers, dst_buffers)
        gather = PhaseStats("gather", 0.0, 0, 0, 0, 0, 0, 0)
        bcast = PhaseStats("broadcast", 0.0, 0, 0, 0, 0, 0, 0)
        # one staging arena for the whole run, reused by every tensor: the full tensor (broadcast
        # members), the messages the root receives, the message a source sends. Fresh buffers per
        # tensor made glibc's heap grow by a large block per refit on the root (benchmarks/bench_soak.py)
        full_at, recv_at, send_at, size = self._arena_layout()
        arena = torch.empty(size, dtype=torch.uint8, device=device)
        gather.peak_staging_bytes = bcast.peak_staging_bytes = size
        for name in self.plan.tensors:
            t0 = time.perf_counter()
            shape, dtype = self.gather.destination.buffer_spec(root, name)
            full = None
            if rank in self.members:
                nbytes = self.full_bytes[name]
                full = arena[full_at: full_at + nbytes].view(dtype).view(shape)
            if rank == root:
                copy_within(self.local.get(name, []), src_buffers, {name: full}, rank)
                msgs = [Message(peer, 0, cs) for peer, cs in sorted(self.recvs.get(name, {}).items())]
                bufs, pos = [], recv_at
                for m in msgs:
                    bufs.append(arena[pos: pos + m.nbytes])
                    pos += _aligned(m.nbytes)
                self.group.exchange([], [(b, m.peer) for m, b in zip(msgs, bufs)], self.timeout)
                for m, b in zip(msgs, bufs):
                    unpack(m, b, {name: full}, rank)
                    gather.recv_bytes += m.payload_bytes
            elif name in self.sends:
                m = Message(root, 0, self.sends[name])
                payload = pack(m, src_buffers, rank, arena[send_at: send_at + m.nbytes])
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
        t = time.perf_counter()
        synchronize(device)
        del arena
        return_free_heap()
        bcast.seconds += time.perf_counter() - t
        gather.rounds = bcast.rounds = len(self.plan.tensors)
        return RunStats.of_phases(rank, [gather, bcast])


def _aligned(nbytes: int, to: int = 64) -> int:
    """``nbytes`` rounded up so that the next staging view starts aligned for any dtype."""
    return -(-nbytes // to) * to
