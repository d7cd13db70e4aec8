"""The control plane of a refit: bounded waits, check-ins and one abort signal, over a TCP store.

Bytes move over the process group; everything that decides *whether* they moved goes through the
group's key-value store (the TCP store of its rendezvous), which stays usable when the group's
communicator is broken or a peer is dead. Every wait here has a deadline and watches the abort
signal, so a failure anywhere reaches every rank as a :class:`RefitError`:

    operation            keys (under the group's prefix)      on timeout
    gather(what, obj)    c/<n>/<rank>, c/<n>/count            names the ranks that never arrived
    abort(reason)        abort (first writer wins)            -
    wait(works, ...)     polls abort while works run          names the peers still pending
    decide(error)        o/<n>/<rank>, v/<n> (first rank in   the missing ranks are at fault
                         decides)

A rank these waits miss is probed when the group knows its liveness address
(:mod:`reshard.execution.liveness`: groups connected through a store): a dead one is named at once,
not at the timeout (a gather raises; a decision counts it as reported failed).

``<n>`` counts the gathers (or the decisions) of the group: every rank makes the same ones in the
same order (they are collective); decisions have their own count, since a rank that failed may
skip a gather but still takes part in the decision that follows. Example, a rank that never shows up::

    rank 0   gather("agreement", ...)  -> RefitError: agreement: rank 2 did not arrive within 5 s
    rank 1   gather("agreement", ...)  -> RefitError: agreement: rank 2 did not arrive within 5 s
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

from ..errors import ReshardError
from .liveness import probe

_POLL_START_S = 50e-6
_POLL_MAX_S = 5e-3
_ABORT_EVERY_S = 5e-3
_PROBE_EVERY_S = 0.25  # liveness probes of the ranks a wait misses, at most this often
_PROBES_PER_CHECK = 8  # ... and at most this many ranks at a time (each probe takes up to 0.1 s)


class RefitError(ReshardError, RuntimeError):
    """A refit, or connecting or recovering a session, failed. Raised on every rank of the group within
    the timeout; ``phase`` says where (``"connect"``, ``"agreement"``, ``"network round 3"``, ``"commit"``,
    ...), ``ranks`` the ranks at fault when they are known, and ``moved`` whether destination bytes may
    have moved (False: every destination still holds its previous version, untouched).

    >>> e = RefitError("agreement", "rank 2 did not arrive within 5 s", ranks=[2])
    >>> str(e), e.phase, e.ranks, e.moved
    ('agreement: rank 2 did not arrive within 5 s', 'agreement', (2,), False)
    """

    def __init__(self, phase: str, message: str, *, ranks: Sequence[int] = (), moved: bool = False) -> None:
        super().__init__(f"{phase}: {message}")
        self.phase = phase
        self.ranks = tuple(sorted({int(r) for r in ranks}))
        self.moved = bool(moved)

    @property
    def message(self) -> str:
        """The text after ``"<phase>: "``."""
        return str(self).partition(": ")[2]

    def but(self, *, phase: str | None = None, message: str | None = None, moved: bool | None = None) -> "RefitError":
        """A copy with another phase, message or ``moved`` (the same ranks), without a traceback."""
        return RefitError(self.phase if phase is None else phase, self.message if message is None else message,
                          ranks=self.ranks, moved=self.moved if moved is None else moved)

    def __reduce__(self):
        return (_rebuild, (self.phase, self.message, self.ranks, self.moved))


def _rebuild(phase: str, message: str, ranks: tuple[int, ...], moved: bool = False) -> RefitError:
    return RefitError(phase, message, ranks=ranks, moved=moved)


def _ranks_str(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class Control:
    """The control operations of one group (see module doc), over ``store`` (already prefixed for
    the group)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        self.ops = 0
        self.decisions = 0
        self._forgotten = 0  # gathers whose keys are deleted
        self._abort_checked = 0.0
        self.addresses: dict[int, str] = {}  # rank -> its liveness address (Group.connect); none: no probes
        self.gone: set[int] = set()  # ranks whose process a probe found dead
        self._probed = 0.0
        self._probe_turn = 0

    def _next(self) -> int:
        self.ops += 1
        return self.ops

    def _seconds(self, timeout: timedelta | None) -> float:
        return (timeout or self.timeout).total_seconds()

    # ------------------------------------------------------------------ abort
    def abort(self, error: RefitError) -> RefitError:
        """Raise the group's abort signal with ``error`` (the first one wins); returns the one that stands."""
        got = self.store.compare_set("abort", "", pickle.dumps(error))
        return pickle.loads(got)

    def aborted(self, *, throttle: bool = False) -> RefitError | None:
        """The error that aborted the group, if any rank raised the signal (``throttle``: ask the store at
        most every 5 ms)."""
        now = time.monotonic()
        if throttle and now - self._abort_checked < _ABORT_EVERY_S:
            return None
        self._abort_checked = now
        if not self.store.check(["abort"]):
            return None
        return pickle.loads(self.store.get("abort"))

    def raise_if_aborted(self, phase: str, *, throttle: bool = False) -> None:
        error = self.aborted(throttle=throttle)
        if error is not None:
            raise error

    # ------------------------------------------------------------------ liveness
    def probe_due(self) -> bool:
        """Whether :meth:`gone_among` would probe now (ranks have addresses; none probed lately)."""
        return bool(self.addresses) and time.monotonic() - self._probed >= _PROBE_EVERY_S

    def gone_among(self, ranks: Sequence[int]) -> list[int]:
        """Those of ``ranks`` whose process is gone (:func:`reshard.execution.liveness.probe` refused),
        probing when :meth:`probe_due`, a few at a time in turn; a rank without an address, or whose
        host does not answer, is never called gone (the wait's timeout decides)."""
        if self.probe_due():
            self._probed = time.monotonic()
            todo = self._unprobed(ranks)
            if todo:
                turn = self._probe_turn % len(todo)
                self._probe_turn += _PROBES_PER_CHECK
                self._probe((todo[turn:] + todo[:turn])[:_PROBES_PER_CHECK])
        return sorted(self.gone.intersection(ranks))

    def gone_now(self, ranks: Sequence[int]) -> list[int]:
        """Those of ``ranks`` whose process is gone, probing each not yet found gone now (no throttle:
        for a decision after a wait, not inside one)."""
        self._probe(self._unprobed(ranks))
        return sorted(self.gone.intersection(ranks))

    def _unprobed(self, ranks: Sequence[int]) -> list[int]:
        return [r for r in ranks if r not in self.gone and r in self.addresses and r != self.rank]

    def _probe(self, ranks: Sequence[int]) -> None:
        self.gone.update(r for r in ranks if probe(self.addresses[r]) is False)

    # ------------------------------------------------------------------ notes
    def note(self, key: str, obj=None) -> None:
        """Post ``obj`` (picklable) under ``key`` for another rank to read with :meth:`notes`; no one waits."""
        self.store.set(f"n/{key}/{self.rank}", pickle.dumps(obj))

    def notes(self, key: str, ranks: Sequence[int], timeout: float) -> dict[int, object]:
        """The notes ``ranks`` posted under ``key``, waiting at most ``timeout`` seconds for them all; a
        rank missing from the result posted none in time."""
        keys = {r: f"n/{key}/{r}" for r in ranks}
        deadline, pause = time.monotonic() + timeout, _POLL_START_S
        while not self.store.check(list(keys.values())) and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
        posted = [r for r, k in keys.items() if self.store.check([k])]
        return {r: pickle.loads(self.store.get(keys[r])) for r in posted}

    def drop_notes(self, key: str, ranks: Sequence[int]) -> None:
        """Delete the notes ``ranks`` posted under ``key`` (read, or no longer needed)."""
        for r in ranks:
            self.store.delete_key(f"n/{key}/{r}")

    # ------------------------------------------------------------------ waits
    def gather(self, what: str, obj=None, timeout: timedelta | None = None) -> list:
        """Every rank's ``obj`` (picklable), in rank order; raises naming the ranks that never arrived."""
        n = self._next()
        self.store.set(f"c/{n}/{self.rank}", pickle.dumps(obj))
        self.store.add(f"c/{n}/count", 1)
        limit = self._seconds(timeout)
        start = time.monotonic()
        deadline = start + limit
        grace = min(limit / 4, _PROBE_EVERY_S)
        pause = _POLL_START_S
        while self.store.add(f"c/{n}/count", 0) < self.size:
            self.raise_if_aborted(what)
            if time.monotonic() - start > grace and self.probe_due():
                dead = self.gone_among([r for r in range(self.size) if not self.store.check([f"c/{n}/{r}"])])
                if dead:
                    raise RefitError(what, f"{_ranks_str(dead)} did not arrive: {_GONE}", ranks=dead)
            if time.monotonic() > deadline:
                missing = [r for r in range(self.size) if not self.store.check([f"c/{n}/{r}"])]
                if not missing:  # the last ones arrived after the count was read: every rank is here
                    break
                raise RefitError(what, f"{_ranks_str(missing)} did not arrive within {limit:g} s "
                                       f"(dead, stalled, or not calling the same refit)", ranks=missing)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
        return [pickle.loads(v) for v in self.store.multi_get([f"c/{n}/{r}" for r in range(self.size)])]

    def wait(self, posted: Sequence[tuple[object, tuple[int, ...]]], phase: str,
             timeout: timedelta | None = None, *, blocking: bool = False) -> None:
        """Wait for posted ``(work, its peers)``; raise when a work fails, another rank aborts, or
        ``timeout`` passes, naming the peers still pending. ``blocking``: wait on each work in turn
        (gloo's point-to-point works only complete inside ``wait``, and a timed-out gloo wait closes
        the connection, so they cannot be polled; a failed peer closing its communicator ends the
        wait at once); otherwise poll ``is_completed`` and watch the abort signal (NCCL)."""
        limit = self._seconds(timeout)
        deadline = time.monotonic() + limit
        if blocking:
            for work, peers in posted:
                left = max(deadline - time.monotonic(), 0.001)
                try:
                    work.wait(timedelta(seconds=left))
                except Exception as e:  # noqa: BLE001 - a broken connection or the deadline: name the peers
                    text = str(e).splitlines()[0]
                    if "Timed out" in text or time.monotonic() >= deadline:
                        raise RefitError(phase, f"no progress with {_ranks_str(peers)} within {limit:g} s",
                                         ranks=peers) from None
                    raise RefitError(phase, f"transfer with {_ranks_str(peers)} failed: {_transport_text(text)}",
                                     ranks=peers) from None
            return
        pending = list(posted)
        pause = _POLL_START_S
        while pending:
            still = []
            for work, peers in pending:
                if not work.is_completed():
                    still.append((work, peers))
                    continue
                try:
                    work.wait()
                except Exception as e:  # noqa: BLE001 - a broken connection: name the peer
                    raise RefitError(phase, f"transfer with {_ranks_str(peers)} failed: "
                                            f"{_transport_text(str(e).splitlines()[0])}", ranks=peers) from None
            pending = still
            if not pending:
                return
            self.raise_if_aborted(phase, throttle=True)
            if self.probe_due():  # a dead peer's work never completes on NCCL: name it now, not at the deadline
                dead = self.gone_among(sorted({p for _, peers in pending for p in peers}))
                if dead:
                    raise RefitError(phase, f"transfer with {_gone_text(dead)}", ranks=dead)
            if time.monotonic() > deadline:
                slow = sorted({p for _, peers in pending for p in peers})
                raise RefitError(phase, f"no progress with {_ranks_str(slow)} within {limit:g} s", ranks=slow)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def decide(self, error: RefitError | None, timeout: timedelta | None = None) -> None:
        """Commit or abort, the same on every rank: each rank posts its outcome; the first rank to get
        here decides (a dead or stalled rank cannot hold the decision up) once every rank posted, or
        the timeout passed (ranks already named at fault get a short grace), and every rank reads that
        decision. Raises :class:`RefitError` unless every rank succeeded; it names the failures and the
        ranks at fault."""
        self.decisions += 1  # its own count: a rank that failed may have skipped a gather before it
        n = self.decisions
        self.store.set(f"o/{n}/{self.rank}", pickle.dumps(error))
        limit = self._seconds(timeout)
        if int(self.store.compare_set(f"v/{n}/leader", "", str(self.rank)).decode()) == self.rank:
            verdict = self._verdict(n, limit)
            self.store.set(f"v/{n}", pickle.dumps(verdict))
            if verdict is None:
                self._forget(n)
        else:
            verdict = self._read_verdict(n, 2 * limit)
        if verdict is not None:
            raise verdict

    def reported(self, n: int) -> list[int]:
        """The ranks that posted their outcome of decision ``n`` (:meth:`decide`): whatever a rank
        posted before deciding is in the store too."""
        return [r for r in range(self.size) if self.store.check([f"o/{n}/{r}"])]

    def _forget(self, n: int) -> None:
        """Delete the keys every rank is done with, so that the store does not grow refit after refit:
        every rank posted decision ``n``, so each finished the gathers before it and read decision
        ``n - 1``."""
        keys = [f"o/{n - 1}/{r}" for r in range(self.size)] + [f"v/{n - 1}", f"v/{n - 1}/leader"]
        for k in range(self._forgotten + 1, self.ops + 1):
            keys += [f"c/{k}/{r}" for r in range(self.size)] + [f"c/{k}/count"]
        self._forgotten = self.ops
        for key in keys:
            self.store.delete_key(key)

    def _verdict(self, n: int, limit: float) -> RefitError | None:
        keys = [f"o/{n}/{r}" for r in range(self.size)]
        start = time.monotonic()
        grace = min(limit / 4, 1.0)
        pause = _POLL_START_S
        while not self.store.check(keys):
            cause = self.aborted(throttle=True) or self.aborted()
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            waited = time.monotonic() - start
            named = set(cause.ranks) if cause is not None else set()
            # a missing rank not named at fault may still report, unless its process is gone
            gone = self.gone_among([r for r in missing if r not in named]) if waited > grace else []
            if waited > limit or ((cause is not None or gone) and waited > grace and set(missing) <= named | set(gone)):
                text = f"{_ranks_str(missing)} did not report within {waited:.3g} s"
                text += f" ({_gone_text(gone)})" if gone else ""
                return RefitError(cause.phase if cause else "commit", text + (f" ({cause})" if cause else ""),
                                  ranks=missing + list(cause.ranks if cause else ()))
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
        failed = [e for e in (pickle.loads(v) for v in self.store.multi_get(keys)) if e is not None]
        if not failed:
            return None
        first = failed[0]
        texts = _dedup(str(e) for e in failed)
        return RefitError(first.phase, "; ".join(t.partition(": ")[2] if t.startswith(first.phase + ": ") else t
                                                 for t in texts), ranks=[r for e in failed for r in e.ranks])

    def _read_verdict(self, n: int, limit: float) -> RefitError | None:
        start = time.monotonic()
        deadline = start + limit
        pause = _POLL_START_S
        while not self.store.check([f"v/{n}"]):
            if time.monotonic() - start > min(limit / 4, 1.0) and self.probe_due():
                leader = int(self.store.get(f"v/{n}/leader").decode())
                if self.gone_among([leader]) and not self.store.check([f"v/{n}"]):
                    return RefitError("commit", f"rank {leader} (which decides) {_GONE}",
                                      ranks=[leader])
            if time.monotonic() > deadline:
                leader = int(self.store.get(f"v/{n}/leader").decode())
                return RefitError("commit", f"rank {leader} (which decides) gave no decision within {limit:g} s",
                                  ranks=[leader])
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
        return pickle.loads(self.store.get(f"v/{n}"))


_GONE = "gone (its process refuses connections: dead)"


def _gone_text(ranks: Sequence[int]) -> str:
    return f"{_ranks_str(ranks)} {_GONE}"


def _transport_text(text: str) -> str:
    """A transport's error without its source location: ``[.../pair.cc:553] Connection closed by peer
    [127.0.0.1]:5000. ...`` -> ``Connection closed by peer [127.0.0.1]:5000``."""
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ")[0][:200]


def _dedup(texts) -> list[str]:
    return list(dict.fromkeys(texts))


__all__ = ["Control", "RefitError"]
