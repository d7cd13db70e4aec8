"""The process group a refit runs over, as the executors use it: one interface, three kinds of group.

    kind                                        made by                              ranks
    torch's default group                       Group() (after init_process_group,   its global ranks
                                                torchrun, rs.spawn)
    a registered subgroup                       Group(dist.new_group([...]))         0..size-1 in the subgroup
    a standalone group over a TCP store         Group.connect("host:port", rank, n)  0..n-1
    (beside a default group the process
    already has: inside vLLM's workers)

Plans use the group's own ranks. Every wait is bounded by ``timeout`` and watches the group's
abort signal (:mod:`reshard.execution.control`: the control plane over the group's TCP store), so
a rank that fails, dies or stalls makes every rank raise :class:`~reshard.execution.control.RefitError`
naming it; in a standalone group, a rank that died is named at once wherever a wait misses it
(:mod:`reshard.execution.liveness`). The operations are the few a refit needs: a batch of point-to-point sends and
receives, gathers of Python objects, a broadcast, a barrier, and splitting off a subgroup (for
gather-and-broadcast).

After a failure a group is *broken* (its communicator's state is unknown): a standalone group is
closed and a new one connected (:meth:`Group.connect` with another ``prefix``, on the same store);
torch's own groups belong to their owner, so a refit over them cannot be recovered in place.

NCCL note: a standalone NCCL group posts a round's sends and receives inside
``ProcessGroup._start_coalescing`` / ``_end_coalescing`` (what ``dist.batch_isend_irecv`` does for
registered groups), so that pairs exchanging both ways do not deadlock; torch's NCCL error
handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default) aborts the communicator when a
wait times out; on a failure the executor also aborts a standalone NCCL communicator
(``ProcessGroupNCCL.abort``) so that no kernel waits on a dead peer. Only the gloo paths run on
this project's CI machines.
"""

from __future__ import annotations

import pickle
import weakref
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from ..options import DEFAULT_TIMEOUT
from .control import Control, RefitError
from .liveness import listen_address, probe

STORE_TIMEOUT = timedelta(seconds=60)


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
        self.control = _control_of(pg, store, self.rank, self.size, timeout)
        self.broken: RefitError | None = None  # the failure that broke the group, if any
        self.tcp_store: dist.TCPStore | None = None  # set by connect(): the store behind a standalone group
        self.store_addr: str | None = None
        self.store_host: str | None = None  # set for standalone groups: where their store is

    @classmethod
    def of(cls, group: "Group | dist.ProcessGroup | None", timeout: timedelta | None = None) -> "Group":
        """``group`` as a :class:`Group` (``None``: torch's default group; ``timeout``: its waits' default)."""
        if isinstance(group, Group):
            return group
        return cls(group) if timeout is None else cls(group, timeout=timeout)

    @classmethod
    def connect(cls, store_addr: str, rank: int, world_size: int, *, backend: str | None = None,
                timeout: timedelta = DEFAULT_TIMEOUT, prefix: str = "reshard",
                store: dist.TCPStore | None = None, host_store: bool | None = None) -> "Group":
        """A standalone group of ``world_size`` ranks over the TCP store at ``"host:port"``; rank 0
        hosts the store (``host_store=False``: another process does). Works beside a default group
        this process already has. ``store``: a TCP
        store this process already holds for that address (a new group of a recovering session
        reuses it under another ``prefix``)."""
        host, _, port = store_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"store address {store_addr!r}: expected host:port")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if store is None:
            try:
                hosting = rank == 0 if host_store is None else host_store
                # the store's own timeout bounds connecting to it (a loaded host can be slow to accept);
                # refit waits poll it and carry their own deadlines
                store = dist.TCPStore(host, int(port), None if not hosting else world_size, hosting,
                                      timeout=max(timeout, STORE_TIMEOUT), wait_for_workers=False)
            except (RuntimeError, dist.DistStoreError) as e:
                raise RefitError("connect", f"rank {rank}: no TCP store at {store_addr} "
                                            f"({str(e).splitlines()[0][:200]})", ranks=[rank] if rank else [0]) from None
        group = cls._standalone(dist.PrefixStore(prefix, store), rank, world_size, backend, timeout, host)
        group.tcp_store, group.store_addr = store, store_addr
        return group

    @classmethod
    def _standalone(cls, store: dist.Store, rank: int, size: int, backend: str, timeout: timedelta,
                    store_host: str) -> "Group":
        # every rank checks in first, so that a missing one is named rather than timing out the transport's
        # setup, with the address of its liveness port (a wait that misses it probes it: dead or slow?)
        addresses = Control(dist.PrefixStore("arrive", store), rank, size, timeout).gather(
            "connect", listen_address(store_host))
        try:
            group = cls._make(store, rank, size, backend, timeout)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - the transport's setup waits on every peer
            raise RefitError("connect", f"rank {rank}: setting up the {backend} communicator failed: "
                                        f"{str(e).splitlines()[0][:200]}") from None
        group.control.addresses = _probed_addresses(addresses, rank)
        group.store_host = store_host
        # every rank's transport is up before any goes on: a rank that closes its group at once (it has
        # nothing to send) would otherwise cut a peer still finishing its handshake ("closed by peer")
        group.control.gather("connected", None, max(timeout, STORE_TIMEOUT))
        return group

    @classmethod
    def _make(cls, store: dist.Store, rank: int, size: int, backend: str, timeout: timedelta) -> "Group":
        if backend == "gloo":
            # its setup connects every pair now, after every rank checked in: on a loaded host it gets the
            # store's floor, and its operations then the group's timeout
            pg = dist.ProcessGroupGloo(store, rank, size, max(timeout, STORE_TIMEOUT))
            pg.set_timeout(timeout)
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

    def check_usable(self, phase: str) -> None:
        """Raise at once if the group is closed or broken by an earlier failure."""
        if self.broken is None and self.pg is None:
            raise RefitError(phase, "the group is closed")
        if self.broken is not None:
            raise RefitError(phase, f"the group is broken by an earlier failure ({self.broken}); connect a new "
                                    f"one (RefitSession.reconnect)", ranks=self.broken.ranks)

    def fail(self, error: RefitError) -> RefitError:
        """Mark the group broken and tell every rank (the first failure wins); returns it. A standalone
        group's communicator is aborted: its peers' pending transfers with this rank fail at once
        (and theirs with their peers, in turn), and no NCCL kernel waits on a dead peer."""
        try:
            error = self.control.abort(error)
        except Exception:  # noqa: BLE001 - the store is gone (its host died): keep our own error
            pass
        self.broken = self.broken or error
        if self.store is not None and self.pg is not None:
            self.pg.abort()
            self.pg = None  # gloo closes its connections when the communicator is freed
        return error

    def gather(self, what: str, obj=None, timeout: timedelta | None = None) -> list:
        """Every rank's small picklable ``obj`` through the store, naming any rank that never arrives."""
        return self.control.gather(what, obj, timeout)

    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
             ) -> list[tuple[object, tuple[int, ...]]]:
        """Post every send ``(tensor, peer)`` and receive at once; ``[(work, its peers)]`` to :meth:`wait` on."""
        if not sends and not recvs:
            return []
        if self.store is None:
            ops = [dist.P2POp(dist.isend, t, self._global(p), self.pg) for t, p in sends]
            ops += [dist.P2POp(dist.irecv, t, self._global(p), self.pg) for t, p in recvs]
            works = dist.batch_isend_irecv(ops)
        elif self.backend == "gloo":
            works = [self.pg.send([t], p, 0) for t, p in sends] + [self.pg.recv([t], p, 0) for t, p in recvs]
        else:
            self.pg._start_coalescing(self.device)
            for t, p in sends:
                self.pg.send([t], p, 0)
            for t, p in recvs:
                self.pg.recv([t], p, 0)
            works = [self.pg._end_coalescing(self.device)]
        peers = [p for _, p in list(sends) + list(recvs)]
        if len(works) == len(peers):
            return [(w, (p,)) for w, p in zip(works, peers)]
        return [(w, tuple(sorted(set(peers)))) for w in works]  # coalesced: one work for the whole batch

    def wait(self, posted: Sequence[tuple[object, tuple[int, ...]]], phase: str,
             timeout: timedelta | None = None) -> None:
        """Wait for what :meth:`post` returned: bounded, abort-aware, naming the peers still pending."""
        self.control.wait(posted, phase, timeout, blocking=self.backend == "gloo")

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
                 timeout: timedelta | None = None, phase: str = "transfer") -> None:
        """Post every send ``(tensor, peer)`` and receive at once, then wait for all of them."""
        self.wait(self.post(sends, recvs), phase, timeout)

    def all_gather_object(self, obj, timeout: timedelta | None = None, what: str = "gather") -> list:
        """Every rank's ``obj`` (picklable, any size), in rank order, over the communicator; a check-in on
        the store first names any rank that never arrives."""
        timeout = timeout or self.timeout
        self.control.gather(what, None, timeout)
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        work = self.pg.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64, device=self.device)])
        self.wait([(work, tuple(range(self.size)))], what, timeout)
        width = max(int(s) for s in sizes)
        padded = torch.zeros(width, dtype=torch.uint8, device=self.device)
        padded[: len(data)] = data
        out = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        self.wait([(self.pg.allgather([out], [padded]), tuple(range(self.size)))], what, timeout)
        return [pickle.loads(o[: int(s)].cpu().numpy().tobytes()) for o, s in zip(out, sizes)]

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: timedelta | None = None) -> None:
        """``tensor`` from ``root`` to every rank, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.wait([(self.pg.broadcast([tensor], opts), (root,))], "broadcast", timeout)

    def barrier(self, timeout: timedelta | None = None, what: str = "barrier") -> None:
        self.control.gather(what, None, timeout)

    def split(self, members: Sequence[int]) -> "Group | None":
        """A subgroup of ``members`` (ranks of this group); collective over the whole group. Returns
        ``None`` on ranks outside it."""
        members = sorted(int(m) for m in members)
        self._splits += 1
        if self.store is None:
            sub = dist.new_group([self._global(m) for m in members], timeout=self.timeout)
            if self.rank not in members:
                return None
            group = Group(sub, timeout=self.timeout)
            group._owned = True
            return group
        if self.rank not in members:
            return None
        store = dist.PrefixStore(f"split{self._splits}", self.store)
        return Group._standalone(store, members.index(self.rank), len(members), self.backend, self.timeout,
                                 self.store_host)

    def close(self) -> None:
        """Release a standalone group's communicator and store, or a subgroup :meth:`split` registered
        with torch (other registered groups belong to their owner)."""
        if self.pg is None:
            self.store, self.tcp_store = None, None
            return
        if self.store is None:
            if getattr(self, "_owned", False):
                dist.destroy_process_group(self.pg)
                self.pg = None
            return
        if self.broken is None:
            shutdown = getattr(self.pg, "shutdown", None)
            if callable(shutdown):
                shutdown()
        self.pg, self.store, self.tcp_store = None, None, None


def _probed_addresses(addresses: list, rank: int) -> dict[int, str]:
    """The liveness addresses a group's waits may probe: all of them, if the next rank's answers now
    (it just checked in, so it is alive); none where the network refuses or drops probes (a firewall
    that resets unlisted ports would make every late rank look dead), so waits fall back to their timeouts."""
    found = {r: a for r, a in enumerate(addresses) if isinstance(a, str)}
    peer = (rank + 1) % len(addresses)
    if peer != rank and not (peer in found and probe(found[peer]) is True):
        return {}
    return found


_controls: "weakref.WeakKeyDictionary[dist.ProcessGroup, Control]" = weakref.WeakKeyDictionary()


def _control_of(pg: dist.ProcessGroup, store: dist.Store | None, rank: int, size: int,
                timeout: timedelta) -> Control:
    """One control plane per process group, shared by every :class:`Group` over it (ranks count the
    group's control operations, so two views of one group must share the count). Torch's groups use
    the default store under a prefix of the group's name."""
    got = _controls.get(pg)
    if got is not None:
        return got
    if store is None:
        base = dist.distributed_c10d._get_default_store()
        store = dist.PrefixStore(f"reshard-control/{pg.group_name}", base)
    else:
        store = dist.PrefixStore("control", store)
    control = _controls[pg] = Control(store, rank, size, timeout)
    return control


__all__ = ["DEFAULT_TIMEOUT", "Group"]
