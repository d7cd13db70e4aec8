"""Who is in a refit session: the membership protocol over the session's TCP store.

A session's members change between refits (:meth:`~reshard.refit.session.RefitSession.resize`,
``recover``, ``join``, ``leave``). Generation ``g`` of the session is a group under the store
prefix ``reshard/g<g>``; the keys below say who is in it. Every key is written here, nowhere else::

    key                              written by                     means
    members/joiners                  a joiner (add 1)               how many processes ever asked to join
    members/joiner/<i>               joiner number i                its member name
    members/admitted                 the leader of a regroup        how many joiners were admitted so far
    members/generation               the leader                     the newest generation with a roster
    members/g<g>/back/<rank>         each old member that is back   its member name
    members/g<g>/gone/<rank>         a member leaving on purpose    do not wait for it
    members/g<g>/leader              the first member back          (compare-and-set) it publishes the roster
    members/g<g>/roster              the leader                     the members of generation g, in rank order

>>> generation_prefix(3)
'reshard/g3'
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta

import torch.distributed as dist

from ..execution.control import RefitError

JOINERS, ADMITTED, GENERATION = "members/joiners", "members/admitted", "members/generation"


def generation_prefix(generation: int) -> str:
    """The store prefix of generation ``generation``'s group."""
    return f"reshard/g{generation}"


def _key(generation: int, what: str) -> str:
    return f"members/g{generation}/{what}"


def waiting(store: dist.Store) -> list[str]:
    """The member names of the processes waiting to join (not admitted yet)."""
    admitted, joiners = int(store.add(ADMITTED, 0)), int(store.add(JOINERS, 0))
    return [store.get(f"members/joiner/{i}").decode() for i in range(admitted + 1, joiners + 1)]


def mark_gone(store: dist.Store, generation: int, rank: int, member: str) -> None:
    """``rank`` leaves before generation ``generation``: its regroup goes on without waiting for it."""
    store.set(_key(generation, f"gone/{rank}"), member)


def ask_to_join(store: dist.Store, member: str) -> None:
    index = store.add(JOINERS, 1)
    store.set(f"members/joiner/{index}", member)


def admitted(store: dist.Store, member: str, timeout: timedelta) -> tuple[int, list[str]]:
    """Wait, at most ``timeout``, until a roster names ``member``; its ``(generation, roster)``."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        generation = int(store.add(GENERATION, 0))
        if generation:
            roster = pickle.loads(store.get(_key(generation, "roster")))
            if member in roster:
                return generation, roster
        if time.monotonic() > deadline:
            raise RefitError("join", f"{member} was not admitted within {timeout.total_seconds():g} s (no member "
                                     f"called resize() or recover())")
        time.sleep(0.01)


def roster(store: dist.Store, generation: int, rank: int, member: str, size: int, at_fault: set[int],
           timeout: timedelta, what: str) -> list[str]:
    """The members of generation ``generation``: the first member to come back leads (``compare_set``
    on the store); it waits for the others (those at fault in the failure get a short grace, the
    rest ``timeout``) and publishes the old members that came back, in old rank order, then the
    processes waiting to join. Every member reads the same list."""
    store.set(_key(generation, f"back/{rank}"), member)
    if int(store.compare_set(_key(generation, "leader"), "", str(rank)).decode()) == rank:
        return _lead(store, generation, size, at_fault, timeout)
    limit = 2 * timeout.total_seconds()
    deadline = time.monotonic() + limit
    while not store.check([_key(generation, "roster")]):
        if time.monotonic() > deadline:
            leader = store.get(_key(generation, "leader")).decode()
            raise RefitError(what, f"rank {leader}, which leads the {what}, published no membership within "
                                   f"{limit:g} s", ranks=[int(leader)])
        time.sleep(0.005)
    return pickle.loads(store.get(_key(generation, "roster")))


def _lead(store: dist.Store, generation: int, size: int, at_fault: set[int], timeout: timedelta) -> list[str]:
    """The leader's part of :func:`roster`: wait for the old members, admit the joiners, publish."""
    start = time.monotonic()
    limit = timeout.total_seconds()
    grace = min(limit / 4, 1.0)
    while True:
        back = [r for r in range(size) if store.check([_key(generation, f"back/{r}")])]
        pending = [r for r in range(size) if r not in back and not store.check([_key(generation, f"gone/{r}")]) and (
            time.monotonic() - start < (grace if r in at_fault else limit))]
        if not pending:
            break
        time.sleep(0.005)
    members = [store.get(_key(generation, f"back/{r}")).decode() for r in back]
    newcomers = waiting(store)
    members += newcomers
    store.add(ADMITTED, len(newcomers))
    store.set(_key(generation, "roster"), pickle.dumps(members))
    store.add(GENERATION, generation - int(store.add(GENERATION, 0)))
    return members


__all__ = ["admitted", "ask_to_join", "generation_prefix", "mark_gone", "roster", "waiting"]
