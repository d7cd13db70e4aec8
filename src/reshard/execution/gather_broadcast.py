"""The baseline executor: gather each full tensor on one source rank, broadcast it to every destination.

It runs a :class:`~reshard.planning.baseline.GatherBroadcastPlan` one tensor at a time, as RL
stacks do: the sources send their parts of the tensor to the root, the root assembles it and
broadcasts it to every destination rank (a broadcast group of the root and the destinations), and
each destination copies its pieces out of it. It meets the executor contract
(:mod:`reshard.execution.base`): the same checks before any byte moves, a ``RefitError`` on every
rank when a rank fails, dies or stalls, and one commit decision, so that a refit session runs it
as it runs any method::

    ex = GatherBroadcastExecutor(gather_broadcast_plan(plan), group)   # collective: agree, then split
    stats = ex.run(src_buffers, dst_buffers)                           # phases: gather, broadcast
    ex.close()                                                         # releases the broadcast group

Its broadcast group is a subgroup it makes itself, so it owns it: :meth:`~GatherBroadcastExecutor.close`
(or a ``with`` block) releases it. Unreleased, each executor would keep a communicator and its
sockets (torch keeps every group registered with it), and a process building one per refit would run
out of file descriptors after a few dozen refits. Before the split, every rank checks that all ranks
have the same plan and the same root (:func:`~reshard.execution.base.agree`), so ranks that pass
different roots raise the same ``LayoutError`` instead of waiting in two different splits.
Fault point (:mod:`reshard.execution.faults`): ``agreement``, then ``gather-broadcast`` as the
bytes start to move.
"""

from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

from ..planning.baseline import GatherBroadcastPlan
from ..planning.schedule import Copy, Message
from ..tensors import box_slices, buffer_view
from . import faults
from .base import (Executor, PhaseStats, RunStats, agree, agree_before_moving, check_buffers, check_storage,
                   device_of, end_of_run, lossy_cast_problem, synchronize)
from .control import RefitError
from .group import DEFAULT_TIMEOUT, Group
from .heap import return_free_heap
from .packing import Buffers, copy_within, pack, unpack

STEP = "gather-broadcast"  # its fault point, and the phase of errors while it moves bytes


class GatherBroadcastExecutor(Executor):
    """Gather-and-broadcast over ``group`` (see module doc). Every rank of the group must construct
    it with the same plan and ``root`` (construction is collective: it agrees on both, then creates
    the broadcast group), call :meth:`run`, and finally :meth:`close` it (or use it as a context
    manager). Its stats have two phases, ``gather`` and ``broadcast``, each summed over the tensors."""

    name = "gather-broadcast"
    needed_bytes_only = False
    bounded_staging = False
    collective_setup = True
    checksums = False

    def __init__(self, plan: GatherBroadcastPlan, group: Group | dist.ProcessGroup | None = None, *,
                 timeout: timedelta = DEFAULT_TIMEOUT, allow_lossy: bool = False) -> None:
        if not isinstance(plan, GatherBroadcastPlan):
            raise TypeError(f"GatherBroadcastExecutor runs a GatherBroadcastPlan (rs.gather_broadcast_plan(plan, "
                            f"root=...)), got {type(plan).__name__}")
        self.bcast_group: Group | None = None
        super().__init__(plan, group, timeout=timeout, allow_lossy=allow_lossy)
        self.root = plan.root
        if self.setup_error is None and not 0 <= self.root < self.group.size:
            self.setup_error = (f"rank {self.rank}: root {self.root} is outside this group of {self.group.size} ranks "
                                f"(0..{self.group.size - 1})")
        # collective before the split: ranks with another plan or root would otherwise each wait
        # in a different split (or the same split with other members) until the timeout
        agree(self.group, plan.fingerprint(), self.setup_error, self.options, timeout)
        self.gather = plan.gather
        self.members = plan.members
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
        return {**super().options, "root": self.root}

    def buffers_used(self) -> tuple[set[str], set[str]]:
        """(source buffers read, destination buffers written) by this rank."""
        read = {c.src_buffer for cs in self.sends.values() for c in cs} | {
            c.src_buffer for cs in self.local.values() for c in cs}
        return read, {p.buffer for ps in self.my_pieces.values() for p in ps}

    def check(self, src_buffers: Buffers, dst_buffers: Buffers) -> str | None:
        """The first problem with this rank's buffers, or None: missing, wrong shape or dtype, sharing
        storage, not writable in place, or (unless ``allow_lossy``) values a narrowing cast loses."""
        if self.setup_error:
            return self.setup_error
        read, written = self.buffers_used()
        return (check_buffers(self.plan.source, self.rank, src_buffers, read, "source")
                or check_buffers(self.plan.destination, self.rank, dst_buffers, written, "destination")
                or check_storage(self.rank, {n: src_buffers[n] for n in sorted(read)},
                                 {n: dst_buffers[n] for n in sorted(written)})
                or (None if self.allow_lossy else self._cast_problem(src_buffers)))

    def cast_pairs(self) -> list[tuple[str, object]]:
        """``(source buffer, destination dtype)`` of every copy this rank makes from a source buffer."""
        return [(c.src_buffer, c.dtype) for cs in list(self.sends.values()) + list(self.local.values()) for c in cs]

    def _cast_problem(self, src_buffers: Buffers) -> str | None:
        return lossy_cast_problem(self.rank, src_buffers, self.cast_pairs(), "GatherBroadcastExecutor")

    def close(self) -> None:
        """Release the broadcast group (local, not collective; idempotent). The executor cannot run after."""
        super().close()
        bcast, self.bcast_group = self.bcast_group, None
        if bcast is not None:
            bcast.close()

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

    def run(self, src_buffers: Buffers, dst_buffers: Buffers, *, decide: bool = True) -> RunStats:
        """Move the bytes; ``dst_buffers`` are written in place. Collective over the group.

        Raises ``LayoutError`` on every rank, with no byte moved, for bad buffers or a plan, root or
        options that differ between ranks; :class:`RefitError` on every rank when a rank fails, dies
        or stalls while bytes move. ``decide=False`` leaves the commit decision to the caller."""
        self.check_open()
        self.where, self.touched = "agreement", False
        self.group.check_usable("agreement")
        error = self.check(src_buffers, dst_buffers)
        agree_before_moving(self.group, self.plan.fingerprint(), error, self.options, self.timeout, fail=self.fail)
        failure, phases = None, []
        try:
            self.touched, self.where = True, STEP
            faults.hit(STEP)
            with torch.inference_mode():  # writes autograd leaves and inference tensors in place
                phases = self.move(src_buffers, dst_buffers, device_of(src_buffers, dst_buffers))
        except RefitError as e:
            failure = RefitError(STEP if e.phase in ("transfer", "broadcast") else e.phase, e.message, ranks=e.ranks)
        except Exception as e:  # noqa: BLE001 - every rank hears of it
            failure = RefitError(STEP, f"rank {self.rank}: {type(e).__name__}: {e}", ranks=[self.rank])
        end_of_run(self.group, failure, decide, self.timeout, fail=self.fail)
        return RunStats.of_phases(self.rank, phases)

    def fail(self, error: RefitError) -> RefitError:
        """Break the group, then the broadcast group (its members may wait in a broadcast); every rank
        hears. The group's abort signal goes first: a peer whose broadcast breaks reads this error from
        it, instead of racing it with an error of its own."""
        first = self.group.fail(error)
        if self.bcast_group is not None:
            self.bcast_group.fail(first)
        return first

    def move(self, src_buffers: Buffers, dst_buffers: Buffers, device: torch.device) -> list[PhaseStats]:
        """The gather and broadcast of every tensor, with no check, agreement or decision (the part of
        :meth:`run` a composite executor runs after its own checks): phases ``gather``, ``broadcast``."""
        rank, root = self.rank, self.root
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
        return [gather, bcast]


def _aligned(nbytes: int, to: int = 64) -> int:
    """``nbytes`` rounded up so that the next staging view starts aligned for any dtype."""
    return -(-nbytes // to) * to
