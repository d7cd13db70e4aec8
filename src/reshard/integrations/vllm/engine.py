"""Worker side of the ``reshard`` backend: each vLLM worker is one destination rank of a refit.

vLLM drives it through its weight-sync calls (``LLM`` methods, the HTTP server's routes, Ray)::

    init_weight_transfer_engine(init_info)   join the refit group, lay out this worker's parameters,
                                             exchange layouts, plan once, check the digest
    start_weight_update()                    check there is a connection
    update_weights({"version": v, "method": m}) receive this worker's boxes (the trainer sends at once)
    finish_weight_update(weight_version=v)   vLLM records v once every worker returned from update

**Receiving while serving** (``RefitOptions(receive="staged")``): the update comes in two steps,
``update_weights({"version": v, "method": m, "step": "receive"})`` starts ``session.receive(v)`` on
a thread of this worker (a :class:`~reshard.refit.background.RefitHandle`) and returns at once, so
the worker's main thread goes back to vLLM's RPC loop and serves on the current weights while the
bytes land in staging (on a CPU worker, which has only the cores it serves with, the repacking
that follows runs at the lowest priority, so that serving goes first: :mod:`.model`); ``update_weights({"step": "apply"})``, once the trainer's own session
committed and the engine is paused, waits for that thread (at most the session's timeout) and
puts the staged version in place (:meth:`RefitSession.apply`: copies into live parameters, and
the reprocessed layers' state swapped in: vLLM's post-load processing of them already ran on
shadow copies on the receive thread, before the commit; FusedMoE layers are reprocessed here).
A receive that failed leaves the worker ``ready`` at its version (nothing live was touched; the
apply step only records it); a failure while putting in place poisons it, and each worker posts
how its apply step ended to the session's store, where trainer rank 0 reads it before it records
the version. ``transfer_state`` says ``receiving`` (the version in flight)
and ``staging_bytes`` (the last staged receive's, in ``last_stats.receive_staging_bytes`` too).

The trainer picks the method in the init info's options (a :class:`~reshard.options.RefitOptions`,
as JSON): ``"auto"``, ``"reshard"``, ``"hierarchical"``, ``"hybrid"`` (its rule's tensors by
reshard, the other tensors by gather-and-broadcast), ``"gather-broadcast"`` (a refit session
each), or the ``gloo_broadcast`` backend's ``"broadcast"`` (``bucket_bytes`` set), the baseline of
:mod:`reshard.integrations.vllm.broadcast` (full tensors from trainer rank 0 into
``load_weights``), so one engine can be refitted every way a comparison needs.

**Failures.** vLLM 0.32's multiprocess executor stops reading the workers' replies at the first
failed one, so an error raised by several workers of one engine leaves replies queued and the
engine's next RPC hangs. Errors here are the same on every worker (sessions fail collectively)::

    call                 on failure
    init (connect)       only the engine's last worker raises: vLLM reads every reply, reports the
                         error and keeps serving; the model and the worker's state are as they were
    update (a refit)     every worker returns normally (below); the trainer's session raised
                         ``RefitError``, and the worker records what happened to its weights
    update (broadcast)   only the last worker raises; the worker is poisoned

A refit's ``update_weights`` does not raise because vLLM's worker keeps an update window (open
from ``start_weight_update`` to ``finish_weight_update``) that it closes only on a worker whose
call raised: raising on one worker would leave the window open on the others, and the engine's
next update would fail there. Every worker returns alike, and the trainer closes the window with
``finish_weight_update()`` without a version (vLLM's version stays).

**Poisoned.** A refit that fails after bytes arrived leaves this worker's weights a mix of
versions: the worker is *poisoned* (``state``, a :class:`~reshard.refit.states.DestinationState` as
the session's destination side has), logs an error naming the failed version, and stays poisoned,
across reconnections too, until a refit commits on every rank.
``llm.collective_rpc(transfer_state)`` (:func:`reshard.integrations.vllm.inspect.transfer_state`)
reads every worker's state, and so does ``collective_rpc("reshard_transfer_state")`` on an engine
started with the worker extension
:class:`~reshard.integrations.vllm.inspect.ReshardWorkerExtension` (an HTTP server's
``/collective_rpc`` route included). A worker cannot stop its engine's scheduler: the trainer,
which hears the same failure from its own session, gates the engine
(:mod:`reshard.integrations.vllm.trainer`: paused, and an offline ``LLM`` refuses requests) until a
refit completes.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.logger import init_logger

from ...execution.group import Group
from ...options import RefitOptions
from ...refit.background import RefitHandle
from ...refit.session import RefitSession
from ...refit.states import DestinationState
from .broadcast import BROADCAST, receive_broadcast
from .broadcast import DEFAULT_BUCKET_BYTES as BROADCAST_BUCKET_BYTES
from .model import VLLMModelSide, redo_cpu_moe_packing

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its format (worker pid) and VLLM_LOGGING_LEVEL


@dataclass(kw_only=True)
class ReshardWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs to join a refit (plain JSON: it rides vLLM's HTTP routes too)."""

    store_addr: str  # host:port of the refit group's TCP store, hosted by trainer rank 0
    world_size: int  # the group: trainer ranks (trainer rank 0 alone for "broadcast") + every engine's workers
    rank_offsets: list[int]  # first rank of each engine's workers in that group, engine by engine
    engine_index: int = 0
    comm_backend: str | None = None  # "gloo" or "nccl"; default: nccl when CUDA is available
    options: dict | None = None  # the refit's RefitOptions as JSON (RefitOptions.to_json); None: the defaults
    bucket_bytes: int | None = None  # set by the baseline "gloo_broadcast" backend: bytes per bucket, no session

    def __post_init__(self) -> None:
        if not 0 <= self.engine_index < len(self.rank_offsets):
            raise ValueError(f"engine_index {self.engine_index} is not one of the {len(self.rank_offsets)} engines")
        self.refit_options = RefitOptions.from_json(self.options or {})  # OptionsError naming a bad one

    @property
    def method(self) -> str:
        """``"broadcast"`` for the baseline backend, else the refit's method (the session's key)."""
        return BROADCAST if self.bucket_bytes is not None else self.refit_options.method


@dataclass
class ReshardWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    version: str | None = None
    method: str | None = None  # which of the engine's refit sessions (by its init method); None: the last connected
    names: list[str] | None = None  # "broadcast": the tensors coming, in order
    dtype_names: list[str] | None = None
    shapes: list[list[int]] | None = None
    step: str | None = None  # None: a whole refit; "receive": start a staged receive; "apply": put it in place


STEPS = (None, "receive", "apply")


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardWeightTransferInitInfo,
                                                       ReshardWeightTransferUpdateInfo]):
    """The ``reshard`` backend's worker engine (see module doc)."""

    init_info_cls = ReshardWeightTransferInitInfo
    update_info_cls = ReshardWeightTransferUpdateInfo
    supports_draft_weight_update = False  # the plan is made for the model this engine was built for

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.sessions: dict[str, RefitSession] = {}  # one per init method: an engine refitted several ways
        self.session: RefitSession | None = None  # the last connected (or last used) of them
        self.broadcast: tuple[Group, int] | None = None  # ("broadcast") the group and bucket size
        self._reload_pending = False
        self.last_stats = None
        self.last_error: Exception | None = None
        self.rank: int | None = None  # this worker's rank in the refit group (set at init)
        self.state = DestinationState.READY  # ready, updating or poisoned (see module doc)
        self.version: str | None = None  # the last version a refit committed here (None after a broadcast)
        self.failed_version: str | None = None  # while poisoned: the version whose refit failed
        self.error: str | None = None  # while poisoned: why
        self.receiving: RefitHandle | None = None  # a staged receive in flight or waiting for its apply step
        self.receiving_version: str | None = None
        self.staging_bytes = 0  # the last staged receive's staging (a copy of this worker's part)
        self.apply_s: float | None = None  # how long the last apply step put the staged version in place

    def init_transfer_engine(self, init_info: ReshardWeightTransferInitInfo) -> None:
        """Connect to a trainer; a new connection replaces the one of the same kind (a refit session
        of the same ``method``, or the broadcast group: an engine can hold a session per method and a
        broadcast group at once, to be refitted every way in turn; updates name the method)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        first = init_info.rank_offsets[init_info.engine_index]
        rank = self.rank = first + get_tensor_model_parallel_rank()
        timeout = init_info.refit_options.timeout
        if init_info.method == BROADCAST:
            self._close(broadcast=True)
            with self._last_worker_raises():
                group = Group.connect(init_info.store_addr, rank, init_info.world_size,
                                      backend=init_info.comm_backend, timeout=timeout, prefix=BROADCAST)
                self.broadcast = (group, init_info.bucket_bytes or BROADCAST_BUCKET_BYTES)
            return
        if self.receiving is not None:  # a staged receive never applied: the new connection drops it
            self._wait_receive()
            self.receiving_version = None
        self._close_session(init_info.method)
        side, failure = None, None
        try:
            side = VLLMModelSide.from_worker(self.model, self.vllm_config, rank, first,
                                             policy=init_info.refit_options.policy)
        except Exception as error:  # noqa: BLE001 - every rank of the session hears it
            failure = f"{type(error).__name__}: {error}"
        with self._last_worker_raises():
            self.session = self.sessions[init_info.method] = RefitSession.connect(
                destination=side, store_addr=init_info.store_addr, rank=rank, world_size=init_info.world_size,
                backend=init_info.comm_backend, options=init_info.refit_options, failure=failure)

    def start_weight_update(self) -> None:
        if not self.sessions and self.broadcast is None:
            raise RuntimeError("reshard weight transfer is not initialized: call init_weight_transfer_engine first")

    def receive_weights(self, update_info: ReshardWeightTransferUpdateInfo) -> None:
        """A refit (``{"version": v}``), or a broadcast update (names, dtypes and shapes of the full
        tensors coming): full tensors through ``load_weights`` in vLLM's layerwise reload."""
        self.start_weight_update()
        if update_info.names is not None:
            self._receive_broadcast(update_info)
        else:
            self._receive_refit(update_info)

    def _receive_broadcast(self, update_info: ReshardWeightTransferUpdateInfo) -> None:
        """Every full tensor from trainer rank 0, through ``load_weights`` inside a layerwise reload
        (finalized at ``finish_weight_update``)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.broadcast is None:
            raise RuntimeError("a broadcast update arrived, but no broadcast trainer is connected")
        redo_cpu_moe_packing(self.model)
        initialize_layerwise_reload(self.model)
        self._reload_pending = True
        before, self.state = self.state, DestinationState.UPDATING
        with self._last_worker_raises():
            group, bucket_bytes = self.broadcast
            try:
                self.last_stats = receive_broadcast(self.model, group, update_info, bucket_bytes)
            except Exception as error:
                self._failed("a broadcast update", None, error, poisoned=True)
                raise
            self._committed(None, before)  # the version is vLLM's, recorded at finish

    def _receive_refit(self, update_info: ReshardWeightTransferUpdateInfo) -> None:
        """One refit by the session of the update's method; a failure is recorded, not raised (see
        module doc)."""
        if update_info.step not in STEPS:
            raise ValueError(f"update step {update_info.step!r}: use one of {STEPS}")
        if update_info.step == "apply":
            self._apply_staged()
            return
        self._pick_session(update_info)
        if update_info.step == "receive":
            self._start_receive(update_info.version)
            return
        before, self.state = self.state, DestinationState.UPDATING
        try:
            self.last_stats = self.session.refit(update_info.version)
        except Exception as error:  # noqa: BLE001 - every rank of the session raised it; see module doc
            self._refit_failed(update_info.version, before, error)
            return
        self._committed(update_info.version, before)

    def _pick_session(self, update_info: ReshardWeightTransferUpdateInfo) -> None:
        if update_info.method is not None:
            if update_info.method not in self.sessions:
                raise RuntimeError(f"a refit by method {update_info.method!r} arrived, but this engine is connected "
                                   f"for {sorted(self.sessions) or 'no refit session'}")
            self.session = self.sessions[update_info.method]
        if self.session is None:
            raise RuntimeError("a refit arrived, but no reshard trainer is connected")

    def _refit_failed(self, version: str | None, before: DestinationState, error: Exception) -> None:
        self.last_error = error
        session_state = getattr(self.session, "state", DestinationState.POISONED)
        poisoned = before == DestinationState.POISONED or session_state != DestinationState.READY
        if not poisoned:
            self.state = before
        self._failed(f"refit to version {version!r}", version, error, poisoned=poisoned)

    def _start_receive(self, version: str | None) -> None:
        """Start ``session.receive(version)`` on a thread and return: the worker serves meanwhile."""
        if self.receiving is not None:  # a receive whose apply step never came (the trainer died): drop it
            logger.warning("reshard: rank %s: a staged receive of version %r was never applied; starting version %r",
                           self.rank, self.receiving_version, version)
            self._wait_receive()
        session = self.session
        self.receiving_version = version
        self.receiving = RefitHandle(lambda: session.receive(version), name=f"reshard-receive-{version}")

    def _wait_receive(self):
        """The staged receive's stats, or its error (a TimeoutError past the session's timeout)."""
        handle, self.receiving = self.receiving, None
        timeout = self.session.options.timeout.total_seconds() if self.session is not None else None
        try:
            return handle.wait(timeout), None
        except Exception as error:  # noqa: BLE001 - recorded by the caller
            return None, error

    def _apply_staged(self) -> None:
        """Wait for the staged receive, then put it in place (see module doc); a failure is recorded."""
        if self.receiving is None:
            logger.warning("reshard: rank %s: an apply step arrived without a staged receive", self.rank)
            return
        version, before = self.receiving_version, self.state
        stats, error = self._wait_receive()
        self.receiving_version = None
        if error is not None:  # nothing live was touched: the worker keeps its version (unless already poisoned)
            self._refit_failed(version, before, error)
            return
        self.staging_bytes = stats.receive_staging_bytes
        self.state = DestinationState.UPDATING
        t0 = time.perf_counter()
        try:
            report = self.session.apply()
        except Exception as error:  # noqa: BLE001 - local: this worker's live weights may be half put in place
            self.last_error = error
            self._failed(f"putting version {version!r} in place", version, error, poisoned=True)
            self._note_applied(version, f"{type(error).__name__}: {error}")
            return
        self._note_applied(version, None)
        self.last_stats = replace(stats, seconds=stats.seconds + time.perf_counter() - t0,
                                  in_place_bytes=report.in_place_bytes,
                                  reprocessed_bytes=report.reprocessed_bytes, paths=report.paths)
        self.apply_s = time.perf_counter() - t0
        self._committed(version, before)

    def _note_applied(self, version: str | None, error: str | None) -> None:
        """Tell trainer rank 0 (through the session's store) how this worker's apply step ended: its update
        call returns nothing, and raising there would leave vLLM's update window open on the other
        workers (module doc)."""
        try:
            self.session.group.control.note(f"applied/{version}", error)
        except Exception as exc:  # noqa: BLE001 - the trainer then hears nothing and reports this worker
            logger.warning("reshard: rank %s: could not report its apply step to the trainer: %s", self.rank, exc)

    def _committed(self, version: str | None, before: DestinationState) -> None:
        if before == DestinationState.POISONED:
            logger.info("reshard: rank %s is ready again at version %r (it was poisoned by the failed refit to "
                        "version %r)", self.rank, version, self.failed_version)
        self.state, self.version, self.failed_version, self.error = DestinationState.READY, version, None, None

    def _failed(self, what: str, version: str | None, error: Exception, *, poisoned: bool) -> None:
        if not poisoned:
            logger.warning("reshard: rank %s: %s failed before any byte reached this worker (%s); it keeps version "
                           "%r", self.rank, what, error, self.version)
            return
        self.state, self.failed_version = DestinationState.POISONED, version
        self.error = f"{type(error).__name__}: {error}"
        logger.error("reshard: rank %s is POISONED: %s failed (%s); its weights may mix versions and must not be "
                     "served until a refit completes (last complete version: %r)", self.rank, what, self.error,
                     self.version)

    def transfer_state(self) -> dict:
        """This worker's refit state (plain data; :func:`~reshard.integrations.vllm.inspect.transfer_state`
        reads it through ``collective_rpc``); the state as its plain name."""
        return {"rank": self.rank, "state": self.state.value, "version": self.version,
                "failed_version": self.failed_version, "error": self.error, "connected": bool(self.sessions),
                "receiving": self.receiving_version, "staging_bytes": self.staging_bytes}

    def finish_weight_update(self) -> None:
        if self._reload_pending:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._reload_pending = False
            finalize_layerwise_reload(self.model, self.model_config)

    @contextmanager
    def _last_worker_raises(self):
        """Run a collective step; on failure only the engine's last worker raises (see module doc)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        try:
            yield
        except Exception as error:  # noqa: BLE001
            self.last_error = error
            if get_tensor_model_parallel_rank() == get_tensor_model_parallel_world_size() - 1:
                raise

    def shutdown(self) -> None:
        if self.receiving is not None:
            self._wait_receive()
        self._close(session=True, broadcast=True)

    def _close(self, *, session: bool = False, broadcast: bool = False) -> None:
        if session:
            for method in list(self.sessions):
                self._close_session(method)
        if broadcast and self.broadcast is not None:
            self.broadcast[0].close()
            self.broadcast = None

    def _close_session(self, method: str) -> None:
        old = self.sessions.pop(method, None)
        if old is None:
            return
        if self.session is old:
            self.session = None
        try:
            old.close()
        except Exception as error:  # noqa: BLE001 - a broken session's group: the new connection goes on
            logger.warning("reshard: rank %s: closing the previous %r session: %s", self.rank, method, error)


__all__ = ["ReshardWeightTransferEngine", "ReshardWeightTransferInitInfo",
           "ReshardWeightTransferUpdateInfo"]
