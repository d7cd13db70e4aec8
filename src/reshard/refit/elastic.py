"""Membership changes of a refit session: after a failure, between refits, and the newcomers' catch-up.

The methods :class:`~reshard.refit.session.RefitSession` has for them (it inherits this class)::

    s = s.recover()          # every survivor, after a failure: new group on the same store, the ranks
                             # that did not come back dropped, re-planned for the new membership
    s = RefitSession.join(store_addr, destination=...)   # a new process waits to be admitted
    s = s.resize()           # the members, between refits: the waiting processes admitted
    s.leave()                # one member, between refits: the next resize goes on without it
    s.catch_up()             # bring newcomers and poisoned engines to the session's version

The store protocol they speak (rosters, generations, who waits) is :mod:`reshard.refit.membership`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Mapping

import torch.distributed as dist

from ..execution import faults
from ..execution.control import RefitError
from ..execution.group import Group
from ..execution.methods import make_executor, make_plan
from ..options import RefitOptions
from ..planning.methods import AUTO, RESHARD
from ..tensors import LayoutError
from . import membership
from .exchange import member_name, renumbered
from .sides import Side
from .states import DestinationState

READY, EMPTY = DestinationState.READY, DestinationState.EMPTY


class MembershipChanges:
    """Recover, resize, join, leave and catch up (see module doc); a part of
    :class:`~reshard.refit.session.RefitSession`."""

    def recover(self, *, timeout: timedelta | None = None) -> "RefitSession":
        """After a failure (or to change membership between refits: :meth:`resize`): every surviving
        member calls it; returns a new session over a new group on the same store, without the
        members that did not come back within ``timeout`` (default: the session's) and with the
        processes waiting in :meth:`join`. Ranks are renumbered in the old order, joiners last; the
        plan is made anew. The store must have survived: its host is rank 0 unless the session was
        connected with ``host_store=False`` to a store another process (the job's driver) hosts."""
        return self._regroup("recovery", timeout)

    def resize(self, *, timeout: timedelta | None = None) -> "RefitSession":
        """Admit the processes waiting in :meth:`join` (collective over the members, between refits)."""
        return self._regroup("resize", timeout)

    def waiting(self) -> list[str]:
        """The processes waiting in :meth:`join` for the next :meth:`resize` (their member names)."""
        store = self.group.tcp_store
        if store is None:
            return []
        return membership.waiting(store)

    def leave(self) -> None:
        """Leave the session between refits (an engine scaled down): the members' next :meth:`resize`
        goes on without this rank at once instead of waiting for it. Closes this rank's group."""
        if self.group.tcp_store is not None:
            membership.mark_gone(self.group.tcp_store, self.generation + 1, self.rank, self.member)
        self.close()

    def _regroup(self, what: str, timeout: timedelta | None) -> "RefitSession":
        if self.group.tcp_store is None:
            raise RefitError(what, "only a session over a standalone group (connect(store_addr=...)) can change "
                                   "membership; torch's own groups belong to their owner")
        timeout = timeout or self.timeout
        store, gen = self.group.tcp_store, self.generation + 1
        at_fault = set(self.failure.ranks) if self.failure else set()
        try:
            faults.hit(what)
            roster = membership.roster(store, gen, self.rank, self.member, self.group.size, at_fault, timeout, what)
        except RefitError:
            raise
        except Exception as e:  # this rank fails its part: the others go on without it
            raise RefitError(what, f"rank {self.rank}: {type(e).__name__}: {e}", ranks=[self.rank]) from e
        if self.member not in roster:
            raise RefitError(what, f"rank {self.rank} ({self.member}) came back too late and was left out",
                             ranks=[self.rank])
        self._close_executor()
        self.group.close()
        return self._join_generation(store, gen, roster, timeout)

    def _join_generation(self, store, gen: int, roster: list[str], timeout: timedelta) -> "RefitSession":
        new_rank = roster.index(self.member)
        g = Group.connect(self.group.store_addr, new_rank, len(roster), backend=self.group.backend,
                          timeout=timeout, prefix=membership.generation_prefix(gen), store=store)
        source = renumbered(self.source, new_rank)
        destination = renumbered(self.destination, new_rank)
        try:
            return type(self)(g, source=source, destination=destination, options=self.options, generation=gen,
                                member=self.member, version=self.version, state=self.state)
        except BaseException:
            g.close()
            raise

    @classmethod
    def join(cls, store_addr: str, *, source: Side | None = None, destination: Side | None = None,
             backend: str | None = None, member: str | None = None, options: RefitOptions | Mapping | None = None,
             **option_values) -> "RefitSession":
        """A new process joins a running session (store at ``store_addr``): it waits, at most the
        options' ``timeout``, until the members call :meth:`resize` (or :meth:`recover`), then returns
        its session. Its sides are built for rank 0 and renumbered; its destination state is
        ``"empty"`` until :meth:`catch_up` or a refit. ``options`` as in :meth:`connect` (the members')."""
        options = RefitOptions.of(options, **option_values)
        timeout = options.timeout
        host, _, port = store_addr.rpartition(":")
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
        except (RuntimeError, ValueError) as e:
            raise RefitError("join", f"no session store at {store_addr}: {str(e).splitlines()[0][:200]}") from None
        member = member or member_name()
        membership.ask_to_join(store, member)
        gen, roster = membership.admitted(store, member, timeout)
        new_rank = roster.index(member)
        g = Group.connect(store_addr, new_rank, len(roster), backend=backend, timeout=timeout,
                          prefix=membership.generation_prefix(gen), store=store)
        try:
            return cls(g, source=renumbered(source, new_rank), destination=renumbered(destination, new_rank),
                       options=options, generation=gen, member=member, state=EMPTY)
        except BaseException:
            g.close()
            raise

    def catch_up(self, *, source: str = AUTO, version: object = None) -> RefitStats | None:
        """Bring members whose destination is not ready at the session's version (newcomers, poisoned
        ones) to it, collective over the group; the others keep serving (engines that lend bytes only
        read their weights). ``source``: ``"engines"`` (members that hold the version: exactly the
        bytes of that version, and the trainer keeps training), ``"trainer"`` (the trainer's current
        weights, committed as ``version``, default the session's), or ``"auto"`` (engines when those
        that hold the version cover every box needed). Returns None when nobody needed it."""
        version = self._current_version() if version is None else version
        behind = sorted(r for r, (v, st, has_dst) in self.members.items()
                        if has_dst and (st != READY or v != version))
        if not behind:
            return None
        donors = sorted(r for r, (v, st, has_dst) in self.members.items()
                        if has_dst and st == READY and v == version and r not in behind)
        held = self.writer_layout  # engines lend the bytes they hold (FP8 ones: FP8 values and scales)
        need = held.subset(behind)
        # catch-ups run the reshard method: from engines, on bytes already in the engines' precision
        direct = self.options.replace(method=RESHARD, domains=None, hybrid_rule=None)
        plan = None
        if source in (AUTO, "engines") and donors:
            try:
                plan = make_plan(direct.replace(precision=None), held.subset(donors), need)
            except (LayoutError, ValueError):
                if source == "engines":
                    raise RefitError("catch-up", f"the engines at version {version!r} (ranks {donors}) do not "
                                                 f"hold every box ranks {behind} need") from None
        from_engines = plan is not None
        if plan is None:
            if source == "engines":
                raise RefitError("catch-up", f"no engine holds version {version!r}")
            # from the trainer: quantized as in a refit, under the session's policy
            plan = make_plan(direct, self.source_layout, self.destination_layout.subset(behind))
        executor = make_executor(direct, plan, self.group)
        if from_engines:
            src = self.writer.read() if self.rank in donors else {}
        else:
            src = self.source.read() if self.source else {}
        stats = self._transfer(executor, src, self.writer if self.rank in behind else None, version,
                               f"catch-up to version {version!r}")
        if self.state == DestinationState.STAGED:  # a staged receiver puts the version in place at once
            self.apply()
        for r in behind:
            self.members[r] = (version, READY, True)
        self.version = version
        return stats


__all__ = ["MembershipChanges"]
