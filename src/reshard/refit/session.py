"""The refit session: a trainer and its inference engines, connected once, refitted every step.

Call sequence, on every rank of the refit group (training ranks, inference ranks, colocated ranks
with both sides)::

    s = RefitSession.connect(source=..., destination=..., store_addr="host:5678", rank=r,
                             world_size=n)            # or group=..., or env:// as torchrun sets it
        - rendezvous: a standalone process group (beside any the process has), or the given one
        - every rank contributes its sides' parts; all ranks merge them into the same two layouts
        - one plan (direct, hierarchical over NVLink domains, or hybrid: the tensors a rule picks by
          reshard, the others by gather-and-broadcast), and its digest checked by every rank before
          any byte moves; a mismatch (shape, missing tensor, buffer, rule) raises the same
          RefitError on every rank, naming the tensor and rank
    stats = s.refit(version=3)  # every step: sources send, destinations receive in place
    stats = s.refit(version=4)  # the same plan, replayed
    s.close()

A refit either commits its version on every rank or raises :class:`RefitError` on every rank,
naming the phase and the rank(s) at fault, within ``timeout`` of the failure (one timeout bounds
every wait: check-in, agreement, each round, the commit decision). A rank that raises, dies,
stalls or never shows up is detected (:mod:`reshard.execution.control`); the error's ``moved``
says whether destination bytes may have moved. Destination states: :mod:`reshard.refit.states`
(ready, updating, poisoned, empty). The options (method, staging cap, timeout, ...) are one
:class:`~reshard.options.RefitOptions`; the method's plan and executor come from the registry
(:mod:`reshard.planning.methods`, :mod:`reshard.execution.methods`).

A failure before any destination byte moved (bad buffers, a plan that differs) leaves every
destination ready at its version and the session usable. After a failure while bytes moved the
group is broken; the survivors go on without restarting::

    except RefitError as e:
        s = s.recover()        # every survivor: new group on the same store, the ranks that did not
                               # come back dropped, re-planned for the new membership
        s.refit(version=5)     # destinations go back to ready

Membership also changes between refits: a new process calls :meth:`RefitSession.join` and the
members call :meth:`RefitSession.resize`; the newcomer then takes the current version with
:meth:`RefitSession.catch_up` (from the trainer, or from engines that hold it), while the other
engines only lend bytes.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Mapping

import torch.distributed as dist

from ..execution import faults
from ..execution.base import Executor, RunStats, agree
from ..execution.control import RefitError
from ..execution.group import Group
from ..execution.methods import make_executor, make_plan
from ..layout import Layout
from ..options import DEFAULT_BUCKET_BYTES, STAGED, RefitOptions
from ..planning.methods import AUTO
from ..tensors import LayoutError
from .background import RefitHandle, copies_of, sources_sent
from .elastic import MembershipChanges
from .exchange import check_ranks, detect_domains, layout_part, member_name, merged_layout
from .sides import Side, WriteReport
from .staged import StagedSide
from .states import DestinationState

READY, UPDATING, POISONED, EMPTY = (DestinationState.READY, DestinationState.UPDATING, DestinationState.POISONED,
                                    DestinationState.EMPTY)
STAGED_STATE = DestinationState.STAGED


@dataclass
class RefitStats:
    """What one rank did in one refit."""

    rank: int
    version: object
    seconds: float  # the whole refit on this rank: transfer, post-processing, commit
    sent_bytes: int
    recv_bytes: int
    peak_staging_bytes: int  # transfer staging (two rounds in flight, <= max_bucket_bytes) + staged destinations
    in_place_bytes: int  # destination bytes written straight into live storage
    reprocessed_bytes: int  # destination bytes staged, then put in place by the engine's post-load path
    run: RunStats  # the executor's figures, per phase
    receive_staging_bytes: int = 0  # a staged destination's staging (a copy of its part of the version)
    paths: dict = field(default_factory=dict)  # destination buffer -> the way its bytes went


class RefitSession(MembershipChanges):
    """One pairing of a trainer and its inference engines (see module doc)."""

    def __init__(self, group: Group, *, source: Side | None = None, destination: Side | None = None,
                 options: RefitOptions = RefitOptions(), failure: str | None = None, generation: int = 0,
                 member: str | None = None, version: object = None, state: DestinationState = READY) -> None:
        self.group = group
        self.rank = group.rank
        self.source, self.destination = source, destination
        self.options = options
        self.timeout = options.timeout
        self.executor: Executor | None = None
        self.writer = destination  # the side refits write: the destination, in its policy's precision
        self.generation = generation
        self.member = member or member_name()
        self.version: object = version
        self.staged_version: object = None  # a committed version waiting in staging (state staged)
        self.state = DestinationState(state) if destination is not None else READY
        self.failure: RefitError | None = None
        for side, what in ((source, "source"), (destination, "destination")):
            if side is not None and side.rank != self.rank:
                raise RefitError("connect", f"rank {self.rank}: its {what} side was built for rank {side.rank}",
                                 ranks=[self.rank])
        t0 = time.perf_counter()
        faults.hit("connect")
        me = (self.rank, layout_part(source), layout_part(destination), failure, self.version, self.state.value)
        parts = group.all_gather_object(me, self.timeout, what="connect")
        failed = [f"rank {r}: {f}" for r, _, _, f, _, _ in parts if f]
        if failed:  # a rank could not build its side: every rank stops here, with its reason
            raise RefitError("connect", "; ".join(failed), ranks=[r for r, *_, f, _, _ in parts if f])
        self.members = {r: (v, DestinationState(st), d is not None) for r, _, d, _, v, st in parts}
        error = None
        try:
            self.source_layout = merged_layout([p for _, p, *_ in parts], "source")
            self.destination_layout = merged_layout([d for _, _, d, *_ in parts], "destination")
            found = detect_domains(group) if options.domains is None and options.method in (AUTO, "hybrid") else None
            self.plan_options = options.resolved(found)  # "auto" resolved, the domains found filled in
            self.method = self.plan_options.method
            self.plan = make_plan(self.plan_options, self.source_layout, self.destination_layout)
            # collective for executors with collective_setup (the ranks agree, then split off a subgroup)
            self.executor = make_executor(self.plan_options, self.plan, group)
            if destination is not None and options.precision is not None:
                self.writer = destination.with_layout(self.plan.destination)  # FP8 weights and scales
            if destination is not None and options.receive == STAGED:
                self.writer = StagedSide(self.writer, options.max_receive_staging_bytes)
            error = self.executor.setup_error or self.executor.check(
                source.read() if source else {}, destination.begin_write() if destination else {})
            if destination is not None:
                destination.abort_write()
        except (LayoutError, ValueError) as e:
            error = f"rank {self.rank}: {e}"
        fingerprint = self.plan.fingerprint() if error is None else "-"
        try:
            agree(group, fingerprint, error, self.executor.options if error is None else {}, self.timeout)
        except (LayoutError, RefitError) as e:
            self._close_executor()
            if isinstance(e, RefitError):
                raise
            raise RefitError("connect", str(e)) from None
        self.connect_s = time.perf_counter() - t0

    @classmethod
    def connect(cls, *, source: Side | None = None, destination: Side | None = None,
                group: Group | dist.ProcessGroup | None = None, store_addr: str | None = None,
                rank: int | None = None, world_size: int | None = None, backend: str | None = None,
                options: RefitOptions | Mapping | None = None, host_store: bool | None = None,
                failure: str | None = None, member: str | None = None, version: object = None,
                **option_values) -> "RefitSession":
        """Rendezvous and build the session. The group is ``group`` if given; else a standalone group
        over the TCP store at ``store_addr`` (``"host:port"``, hosted by rank 0) with explicit ``rank``
        and ``world_size`` (``host_store``: whether this rank hosts the store; default rank 0; ``False``
        on every rank when the job's driver hosts it, so that the store outlives any rank); else torch's
        default group (``env://`` as torchrun sets it, or ``rs.init_process_group``). Only a standalone
        group can be recovered after a failure.

        ``options``: a :class:`~reshard.options.RefitOptions` (method, staging cap, timeout, checksum,
        lossy casts, hybrid rule, precision, domains; the same on every rank), or its fields as keyword
        arguments (``method="hybrid", checksum=True``); a wrong option raises
        :class:`~reshard.errors.OptionsError` before any process connects. Under a dtype policy
        (``precision``) the destination side declares the engine's layout at the source's precision
        and holds the buffers of :func:`~reshard.planning.precision.precision_layout`, FP8 weights and
        ``<buffer>_scale_inv``. ``failure``: why this rank has no side to offer (every rank raises it
        at once instead of waiting); ``member``: this process's name in membership changes; ``version``:
        the version this rank's destination already holds (None: none yet)."""
        options = RefitOptions.of(options, **option_values)
        check_ranks(rank, world_size)
        timeout = options.timeout
        if group is not None:
            g = Group.of(group)
        elif store_addr is not None:
            if rank is None or world_size is None:
                raise RefitError("connect", "store_addr needs rank and world_size")
            try:
                g = Group.connect(store_addr, rank, world_size, backend=backend, timeout=timeout, prefix="reshard/g0",
                                  host_store=host_store)
            except RefitError:
                raise
            except Exception as e:  # noqa: BLE001 - the transport's own setup failed (a peer vanished)
                raise RefitError("connect", f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                                 ranks=[rank]) from None
        else:
            g = Group()
        try:
            return cls(g, source=source, destination=destination, options=options, failure=failure, member=member,
                       version=version)
        except RefitError as e:
            if g is not group:
                g.fail(e.with_traceback(None))
                g.close()
            raise
        except Exception as e:  # noqa: BLE001 - this rank failed while connecting: every rank hears of it
            error = RefitError("connect", f"rank {g.rank}: {type(e).__name__}: {e}", ranks=[g.rank])
            if g is not group:
                g.fail(error)
                g.close()
            raise error from None

    # ------------------------------------------------------------------ refits
    def refit(self, version: object = None, *, wait: bool = True, snapshot: bool = False,
              source_tensors: Mapping[str, object] | None = None) -> RefitStats | RefitHandle[RefitStats]:
        """Move this step's weights: sources send, destinations receive, every rank commits ``version``
        (staged destinations put it in place right after). Collective over the group; raises
        :class:`RefitError` on every rank if any rank fails (see module doc for the destination's
        state afterwards). ``wait=False``: return a :class:`~reshard.refit.background.RefitHandle` as
        soon as the refit has started on a thread; optimizer steps that would change a source tensor
        wait for it, and ``wait()`` gives the stats or raises the error (``snapshot``: send copies
        of the sources instead, so nothing waits). ``source_tensors``: send these (copies the
        caller made, by the source side's buffer names and shapes) instead of the source's own."""
        src = self._read_source()
        if source_tensors is not None:
            src = _replacing(src, source_tensors, self.rank)
        if wait:
            return self._refit(version, src, apply=True)
        sources = [] if snapshot else list(src.values())
        snapshot_bytes = 0
        if snapshot:
            src, snapshot_bytes = copies_of(src)
        return RefitHandle(lambda: self._refit(version, src, apply=True), sources=sources,
                           snapshot_bytes=snapshot_bytes)

    def receive(self, version: object = None) -> RefitStats:
        """A refit whose staged destinations keep serving: like :meth:`refit`, but a destination with
        ``receive="staged"`` keeps its version in place and holds ``version`` staged (state
        ``staged``) until :meth:`apply`. Collective."""
        return self._refit(version, self._read_source(), apply=False)

    def apply(self) -> WriteReport:
        """Put the staged version in place (local, on a staged destination after :meth:`receive`): the
        destination is then ready at it. A failure here (the engine's post-processing) leaves it
        poisoned and raises RefitError on this rank only."""
        if not isinstance(self.writer, StagedSide) or self.state != STAGED_STATE:
            raise RuntimeError(f"rank {self.rank}: no received version is staged here (state {self.state})")
        try:
            report = self.writer.apply()
        except Exception as e:  # noqa: BLE001 - local: the other ranks committed
            self.state, self.version = POISONED, self.staged_version
            raise RefitError("apply", f"rank {self.rank}: putting version {self.staged_version!r} in place: "
                             f"{type(e).__name__}: {e}", ranks=[self.rank], moved=True) from None
        self.version, self.state, self.staged_version = self.staged_version, READY, None
        return report

    def _read_source(self) -> dict:
        return self.source.read() if self.source else {}

    def _refit(self, version: object, src: dict, *, apply: bool) -> RefitStats:
        if self.state == STAGED_STATE:
            raise RuntimeError(f"rank {self.rank}: version {self.staged_version!r} is staged: apply() it first")
        with self.writer.receiving() if isinstance(self.writer, StagedSide) else nullcontext():
            stats = self._transfer(self.executor, src, self.writer, version, f"refit to version {version!r}")
        if apply and self.state == STAGED_STATE:
            t0 = time.perf_counter()
            report = self.apply()
            stats = replace(stats, seconds=stats.seconds + time.perf_counter() - t0,
                            in_place_bytes=report.in_place_bytes, reprocessed_bytes=report.reprocessed_bytes,
                            paths=report.paths)
        return stats

    def _transfer(self, executor: Executor, src: dict, destination: Side | None, version: object,
                  what: str) -> RefitStats:
        """Run ``executor`` from ``src`` into ``destination`` (None: this rank receives nothing), then
        decide together; commit ``version`` where bytes arrived."""
        t0 = time.perf_counter()
        self.group.check_usable(what)
        before = self.state
        staged = isinstance(destination, StagedSide)  # its live tensors stay as they are until apply()
        if destination is not None and not staged:
            self.state = UPDATING
        report, error, run = WriteReport(), None, None
        try:
            dst = destination.begin_write() if destination else {}
            run = executor.run(src, dst, decide=False)
            if src:
                sources_sent()  # an optimizer step waiting in a background refit's guard may go on
            faults.hit("commit")
            if destination is not None:
                report = destination.end_write()
        except LayoutError as e:  # found before any byte moved, the same on every rank
            if destination is not None:
                destination.abort_write()
            self.state = before
            raise RefitError("agreement", f"{what}: {e}") from None
        except RefitError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - the decision below reports it to every rank
            error = RefitError(executor.where if run is None else "commit",
                               f"rank {self.rank}: {type(e).__name__}: {e}", ranks=[self.rank])
        decision = self.group.control.decisions + 1  # the same number on every rank
        if destination is not None:
            self._note_written(decision, executor.touched and not staged)
        try:
            self.group.control.decide(error, self.timeout)
        except RefitError as e:
            moved = self._moved(executor, decision)
            self.failure = self.group.fail(e)
            if destination is not None:
                destination.abort_write()
                self.state = POISONED if (executor.touched and not staged) or before == POISONED else before
            raise RefitError(e.phase, f"{what} failed: {e.message}", ranks=e.ranks, moved=moved) from None
        except Exception as e:  # the store itself is gone (its host died)
            self.failure = self.group.fail(RefitError("commit", f"the control store is gone: {e}", ranks=[0]))
            if destination is not None:
                destination.abort_write()
                self.state = POISONED if (executor.touched and not staged) or before == POISONED else before
            raise self.failure.but(moved=self._moved(executor)) from None
        if destination is not None:
            self.group.control.drop_notes(f"written/{decision}", [self.rank])  # committed: no one reads it
        if staged:
            self.staged_version, self.state = version, STAGED_STATE
        elif destination is not None:
            self.version, self.state = version, READY
        elif self.destination is None:
            self.version = version
        return RefitStats(self.rank, version, time.perf_counter() - t0, run.sent_bytes, run.recv_bytes,
                          run.peak_staging_bytes + report.staging_bytes, report.in_place_bytes,
                          report.reprocessed_bytes, run, report.staging_bytes if staged else 0, report.paths)

    def _note_written(self, decision: int, written: bool) -> None:
        """Post whether this destination's live bytes may have been written in this refit (read by
        :meth:`_moved` on the other ranks if it fails)."""
        try:
            self.group.control.note(f"written/{decision}", written)
        except Exception:  # noqa: BLE001 - the store is gone: the others then assume the worst
            pass

    def _moved(self, executor: Executor, decision: int | None = None) -> bool:
        """Whether live destination bytes may have moved: never before the commit under
        ``receive="staged"`` (the same option on every rank); else not if this rank's executor never
        got past the agreement, nor if every destination rank says it wrote nothing (its note for
        ``decision``: a source that went on alone, after the others gave up at the agreement, moved
        no destination byte); a destination rank that posted no note in time counts as written. Only
        the notes of ranks that reported to the decision are waited for (each posted its note before
        it decided); one that did not report (dead, stalled) is looked up once, not waited for: a
        killed destination must not add ``MOVED_NOTE_WAIT_S`` to every rank's failure."""
        if not executor.touched or self.options.receive == STAGED:
            return False
        if decision is None:
            return True
        destinations = [rank for rank, (_, _, has_dst) in self.members.items() if has_dst]
        key = f"written/{decision}"
        try:
            control = self.group.control
            reported = set(control.reported(decision))
            notes = control.notes(key, [r for r in destinations if r in reported], timeout=MOVED_NOTE_WAIT_S)
            notes.update(control.notes(key, [r for r in destinations if r not in reported], timeout=0.0))
        except Exception:  # noqa: BLE001 - the store is gone: assume the worst
            return True
        return len(notes) < len(destinations) or any(notes.values())

    @property
    def writer_layout(self) -> Layout:
        """The destination layout as refits write it: :attr:`destination_layout`, or under the session's
        dtype policy its :func:`~reshard.planning.precision.precision_layout` (FP8 weights and scales)."""
        return self.plan.destination if self.options.precision is not None else self.destination_layout

    def _current_version(self) -> object:
        versions = [v for r, (v, st, has_dst) in sorted(self.members.items()) if has_dst and st == READY and v is not None]
        return versions[0] if versions else self.version

    def close(self) -> None:
        """Release the session's executor (a hybrid's subgroup) and its group (a standalone one; torch's
        groups belong to their owner)."""
        self._close_executor()
        self.group.close()

    def _close_executor(self) -> None:
        if self.executor is not None:
            self.executor.close()  # a reshard executor holds nothing; a hybrid one its broadcast subgroup


MOVED_NOTE_WAIT_S = 2.0  # how long a failed refit waits for the destinations' notes (they post before deciding)


def _replacing(src: dict, given: Mapping[str, object], rank: int) -> dict:
    """``given`` in place of the source buffers ``src``: the same names, shapes and dtypes (else a
    LayoutError naming the buffer and the rank, before any byte moves)."""
    for name in sorted(set(src) | set(given)):
        if name not in src or name not in given:
            raise LayoutError(f"rank {rank}: source_tensors {'has' if name in given else 'lacks'} buffer {name!r}, "
                              f"which the source side {'lacks' if name in given else 'has'}")
        mine, theirs = src[name], given[name]
        if tuple(mine.shape) != tuple(theirs.shape) or mine.dtype != theirs.dtype:
            raise LayoutError(f"rank {rank}: source_tensors[{name!r}] is {tuple(theirs.shape)} {theirs.dtype}, the "
                              f"source side's buffer is {tuple(mine.shape)} {mine.dtype}")
    return dict(given)


__all__ = ["AUTO", "DEFAULT_BUCKET_BYTES", "EMPTY", "POISONED", "READY", "RefitError", "RefitSession", "RefitStats",
           "UPDATING", "detect_domains"]
