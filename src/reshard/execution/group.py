"""The process group a refit runs over, as the executors use it: one interface, three kinds of group.

    kind                                        made by                              ranks
    torch's default group                       Group() (after init_process_group,   its global ranks
                                                torchrun, rs.spawn)
    a registered subgroup                       Group(dist.new_group([...]))         0..size-1 in the subgroup
    a standalone group over a TCP store         Group.connect("host:port", rank, n)  0..n-1
    (beside a default group the process
    already has: inside vLLM's workers)

Plans use the group's own ranks. Every wait is bounded by ``timeout``. The operations are the
few a refit needs: a batch of point-to-point sends and receives, an all-gather of small Python
objects, a broadcast, a barrier, and splitting off a subgroup (for gather-and-broadcast).

NCCL note: a standalone NCCL group posts a round's sends and receives inside
``ProcessGroup._start_coalescing`` / ``_end_coalescing`` (what ``dist.batch_isend_irecv`` does for
registered groups), so that pairs exchanging both ways do not deadlock; torch's NCCL error
handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default) aborts the communicator when a
wait times out. Only the gloo paths run on this project's CI machines.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=5)


class Group:
    """A torch.distributed process group seen through the operations a refit uses (see module doc)."""

    def __init__(self, pg: dist.ProcessGroup | None = None, *, store: dist.Store | None = None,
                 timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if pg is None:
            if not dist.is_initialized():
                raise RuntimeError("no process group: call rs.init_process_group() (or torchrun), pass a "
                                   "group, or connect one with Group.connect(store_addr, rank, world_size)")
            pg = dist.group.WORLD
        self.pg = pg
        self.store = store  # set for standalone groups, which are not registered with torch
        self.timeout = timeout
        self.rank = pg.rank()
        self.size = pg.size()
        self.backend = (pg.name() if store is not None else dist.get_backend(pg)).lower()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))
        self._splits = 0

    @classmethod
    def of(cls, group: "Group | dist.ProcessGroup | None") -> "Group":
        """``group`` as a :class:`Group` (``None``: torch's default group)."""
        return group if isinstance(group, Group) else cls(group)

    @classmethod
    def connect(cls, store_addr: str, rank: int, world_size: int, *, backend: str | None = None,
                timeout: timedelta = DEFAULT_TIMEOUT, prefix: str = "reshard") -> "Group":
        """A standalone group of ``world_size`` ranks over the TCP store at ``"host:port"``; rank 0
        hosts the store. Works beside a default group this process already has."""
        host, _, port = store_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"store address {store_addr!r}: expected host:port")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=timeout, wait_for_workers=False)
        return cls._standalone(dist.PrefixStore(prefix, store), rank, world_size, backend, timeout)

    @classmethod
    def _standalone(cls, store: dist.Store, rank: int, size: int, backend: str, timeout: timedelta) -> "Group":
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            raise ValueError(f"backend {backend!r}: use 'gloo' or 'nccl'")
        return cls(pg, store=store, timeout=timeout)

    # ------------------------------------------------------------------ operations
    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.pg, rank) if self.pg is not dist.group.WORLD else rank

    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> list:
        """Post every send ``(tensor, peer)`` and receive at once; the work handles to wait on."""
        if not sends and not recvs:
            return []
        if self.store is None:
            ops = [dist.P2POp(dist.isend, t, self._global(p), self.pg) for t, p in sends]
            ops += [dist.P2POp(dist.irecv, t, self._global(p), self.pg) for t, p in recvs]
            return dist.batch_isend_irecv(ops)
        if self.backend == "gloo":
            return [self.pg.send([t], p, 0) for t, p in sends] + [self.pg.recv([t], p, 0) for t, p in recvs]
        self.pg._start_coalescing(self.device)
        for t, p in sends:
            self.pg.send([t], p, 0)
        for t, p in recvs:
            self.pg.recv([t], p, 0)
        return [self.pg._end_coalescing(self.device)]

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
                 timeout: timedelta | None = None) -> None:
        """Post every send ``(tensor, peer)`` and receive at once, then wait for all of them."""
        for w in self.post(sends, recvs):
            w.wait(timeout or self.timeout)

    def all_gather_object(self, obj, timeout: timedelta | None = None) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        timeout = timeout or self.timeout
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        self.pg.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64, device=self.device)]).wait(timeout)
        width = max(int(s) for s in sizes)
        padded = torch.zeros(width, dtype=torch.uint8, device=self.device)
        padded[: len(data)] = data
        out = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        self.pg.allgather([out], [padded]).wait(timeout)
        return [pickle.loads(o[: int(s)].cpu().numpy().tobytes()) for o, s in zip(out, sizes)]

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: timedelta | None = None) -> None:
        """``tensor`` from ``root`` to every rank, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.pg.broadcast([tensor], opts).wait(timeout or self.timeout)

    def barrier(self, timeout: timedelta | None = None) -> None:
        self.all_gather_object(None, timeout)

    def split(self, members: Sequence[int]) -> "Group | None":
        """A subgroup of ``members`` (ranks of this group); collective over the whole group. Returns
        ``None`` on ranks outside it."""
        members = sorted(int(m) for m in members)
        self._splits += 1
        if self.store is None:
            sub = dist.new_group([self._global(m) for m in members])
            return Group(sub, timeout=self.timeout) if self.rank in members else None
        if self.rank not in members:
            return None
        store = dist.PrefixStore(f"split{self._splits}", self.store)
        return Group._standalone(store, members.index(self.rank), len(members), self.backend, self.timeout)

    def close(self) -> None:
        """Release a standalone group's communicator and store (registered groups belong to torch)."""
        if self.store is None or self.pg is None:
            return
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.pg, self.store = None, None


__all__ = ["DEFAULT_TIMEOUT", "Group"]
