"""The hybrid executor: the tensors a rule picks by reshard, the others by gather-and-broadcast, as one refit.

It runs a :class:`~reshard.planning.hybrid.HybridPlan` on this rank: first the reshard part (every
phase of its plan, as :class:`~reshard.execution.executor.ReshardExecutor` runs them), then the
broadcast part (:class:`~reshard.execution.gather_broadcast.GatherBroadcastExecutor`, tensor by
tensor from the part's root), both writing into the caller's destination buffers::

    ex = HybridExecutor(HybridPlan(src, dst, HybridRule(...)), group)  # collective
    stats = ex.run(src_buffers, dst_buffers)    # phases: transfer, gather, broadcast
    ex.close()                                  # releases the broadcast part's subgroup

One refit, one outcome. Before any byte moves, every rank checks its buffers for both parts
(shapes and dtypes, buffers sharing storage across the two parts, buffers that cannot be written in
place, values a narrowing cast would lose) and all ranks compare the hybrid plan's fingerprint
(which covers the rule) and the options: a problem raises the same ``LayoutError`` on every rank
with nothing written. A failure in either part (a rank that raises, dies or stalls) aborts the
group and its broadcast subgroup and raises :class:`~reshard.execution.control.RefitError` on
every rank; the run ends with one commit/abort decision for both parts
(:meth:`~reshard.execution.control.Control.decide`; ``decide=False`` leaves it to a refit session).

Fault points (:mod:`reshard.execution.faults`): those of the reshard part (``agreement``,
``<phase> round <j>``), and ``gather-broadcast``, passed by every rank as the broadcast part starts.
``checksum`` covers the reshard part's messages; the broadcast part sends none.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..planning.hybrid import HybridPlan
from . import faults
from .base import (Executor, PhaseStats, RunStats, agree, agree_before_moving, check_buffers, check_storage, device_of,
                   end_of_run, lossy_cast_problem)
from .control import RefitError
from .executor import ReshardExecutor
from .gather_broadcast import GatherBroadcastExecutor
from .group import DEFAULT_TIMEOUT, Group
from .packing import Buffers

BROADCAST_PART = "gather-broadcast"  # the broadcast part's phase in errors and its fault point


class HybridExecutor(Executor):
    """Runs a :class:`HybridPlan` over ``group`` (see module doc). Every rank of the group constructs it
    with the same plan (construction is collective: the ranks agree on the plan and options, then
    the broadcast part creates its subgroup), calls :meth:`run`, and :meth:`close` s it (or uses it
    as a context manager). ``overlap``, ``checksum`` and ``allow_lossy`` are the reshard executor's
    (``allow_lossy`` covers both parts). With no broadcast part it is a reshard run; with no
    reshard part, a gather-and-broadcast run with the refit's checks and decision."""

    name = "hybrid"
    needed_bytes_only = False  # the broadcast part sends every destination the full tensors
    bounded_staging = False  # the broadcast part stages full tensors
    collective_setup = True

    def __init__(self, plan: HybridPlan, group: Group | dist.ProcessGroup | None = None, *,
                 timeout: timedelta = DEFAULT_TIMEOUT, overlap: bool = True, checksum: bool = False,
                 allow_lossy: bool = False) -> None:
        if not isinstance(plan, HybridPlan):
            raise TypeError(f"HybridExecutor runs a HybridPlan (rs.HybridPlan(...)), got {type(plan).__name__}")
        super().__init__(plan, group, timeout=timeout, checksum=checksum, allow_lossy=allow_lossy)
        self._where = "agreement"
        self._in_reshard = False
        self.reshard = None if plan.reshard is None or self.setup_error else ReshardExecutor(
            plan.reshard, self.group, timeout=timeout, overlap=overlap, checksum=checksum, allow_lossy=allow_lossy)
        self.broadcaster: GatherBroadcastExecutor | None = None
        # collective before the broadcast part splits the group: ranks with another plan or rule would
        # otherwise wait in different splits until the timeout
        agree(self.group, plan.fingerprint(), self.setup_error, self.options, timeout)
        if plan.gather_broadcast is not None:
            self.broadcaster = GatherBroadcastExecutor(plan.gather_broadcast, self.group, timeout=timeout,
                                                       allow_lossy=allow_lossy)

    @property
    def options(self) -> dict:
        """What every rank must agree on besides the plan."""
        return {**super().options, "rule": self.plan.rule.key, "root": self.plan.root}

    @property
    def where(self) -> str:
        """The step a run is in (for errors): a reshard round, or the broadcast part."""
        return self.reshard.where if self._in_reshard and self.reshard is not None else self._where

    @where.setter
    def where(self, value: str) -> None:
        self._where = value

    # ------------------------------------------------------------------ checks
    def _broadcast_buffers(self) -> tuple[set[str], set[str]]:
        """(source buffers read, destination buffers written) by this rank in the broadcast part."""
        return self.broadcaster.buffers_used() if self.broadcaster is not None else (set(), set())

    def _reshard_buffers(self) -> tuple[set[str], set[str]]:
        """(source buffers read, destination buffers written) by this rank in the reshard part."""
        return self.reshard.buffers_used() if self.reshard is not None else (set(), set())

    def buffers_used(self) -> tuple[set[str], set[str]]:
        """(source buffers read, destination buffers written) by this rank in either part."""
        (r_read, r_written), (b_read, b_written) = self._reshard_buffers(), self._broadcast_buffers()
        return r_read | b_read, r_written | b_written

    def check(self, src: Buffers, dst: Buffers) -> str | None:
        """The first problem with this rank's buffers for either part, or None (see module doc)."""
        if self.setup_error:
            return self.setup_error
        if self.reshard is not None:
            problem = self.reshard.check(src, dst)
            if problem:
                return problem
        b_read, b_written = self._broadcast_buffers()
        if self.broadcaster is not None:
            problem = (check_buffers(self.plan.broadcast.source, self.rank, src, b_read, "source")
                       or check_buffers(self.plan.broadcast.destination, self.rank, dst, b_written, "destination"))
            if problem:
                return problem
        read, written = map(sorted, self.buffers_used())
        return check_storage(self.rank, {n: src[n] for n in read}, {n: dst[n] for n in written}) or (
            None if self.allow_lossy else self._cast_problem(src))

    def _cast_problem(self, src: Buffers) -> str | None:
        """Values of a source buffer the broadcast part's cast to the destination dtype would lose (the
        reshard executor checks its own part)."""
        if self.broadcaster is None:
            return None
        return lossy_cast_problem(self.rank, src, self.broadcaster.cast_pairs(), "HybridExecutor")

    # ------------------------------------------------------------------ run
    def run(self, src_buffers: Buffers, dst_buffers: Buffers, *, decide: bool = True) -> RunStats:
        """Move the bytes of both parts; ``dst_buffers`` are written in place. Collective over the group.

        Raises ``LayoutError`` on every rank, with no byte moved, for bad buffers or a plan, rule or
        options that differ between ranks; :class:`RefitError` on every rank when either part fails
        (destination buffers may then hold a mix of old and new values). ``decide=False`` leaves the
        final decision to the caller (a refit session)."""
        self.check_open()
        self._where, self._in_reshard, self.touched = "agreement", False, False
        self.group.check_usable("agreement")
        error = self.check(src_buffers, dst_buffers)
        agree_before_moving(self.group, self.plan.fingerprint(), error, self.options, self.timeout, fail=self.fail)
        failure, phases = None, []
        try:
            self.touched = True
            with torch.inference_mode():  # writes autograd leaves and inference tensors in place
                phases = self.move(src_buffers, dst_buffers, device_of(src_buffers, dst_buffers))
        except RefitError as e:
            failure = RefitError(e.phase, e.message, ranks=e.ranks)
        except Exception as e:  # noqa: BLE001 - every rank hears of it
            failure = RefitError(self.where, f"rank {self.rank}: {type(e).__name__}: {e}", ranks=[self.rank])
        end_of_run(self.group, failure, decide, self.timeout, fail=self.fail)
        return RunStats.of_phases(self.rank, phases)

    def move(self, src_buffers: Buffers, dst_buffers: Buffers, device: torch.device) -> list[PhaseStats]:
        """Both parts' bytes, the reshard part first, with no check, agreement or decision. A failure of
        the broadcast part names the phase ``gather-broadcast``."""
        phases: list[PhaseStats] = []
        if self.reshard is not None:
            self._in_reshard = True
            phases += self.reshard.move(src_buffers, dst_buffers, device)
            self._in_reshard = False
        if self.broadcaster is not None:
            self._where = BROADCAST_PART
            try:
                faults.hit(BROADCAST_PART)
                phases += self.broadcaster.move(src_buffers, dst_buffers, device)
            except RefitError as e:
                phase = BROADCAST_PART if e.phase in ("transfer", "broadcast") else e.phase
                raise RefitError(phase, e.message, ranks=e.ranks) from None
        return phases

    def fail(self, error: RefitError) -> RefitError:
        """Break the group and the broadcast subgroup: :meth:`GatherBroadcastExecutor.fail`."""
        if self.broadcaster is not None:
            return self.broadcaster.fail(error)
        return self.group.fail(error)

    def close(self) -> None:
        """Release the broadcast part's subgroup (local, idempotent). The executor cannot run after."""
        super().close()
        if self.broadcaster is not None:
            self.broadcaster.close()


__all__ = ["BROADCAST_PART", "HybridExecutor"]
