"""Trainer side of the ``reshard`` backend: every trainer rank sends its own shards, at once.

Built on every trainer rank by vLLM's factory, like the ``nccl`` and ``nccl_m2n`` backends::

    info = ReshardTrainerInitInfo(rank=rank, master_address=host, master_port=port,
                                  num_trainer_ranks=M, world_size=M + N)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ReshardSource(model))
    stats = engine.send_weights(weight_version="7")

``client`` is anything that speaks vLLM's weight-sync protocol (an ``LLM``, vLLM's HTTP or Ray
clients), or an :class:`~reshard.integrations.vllm.clients.EngineGroup` of several. Trainer rank 0
hosts the refit group's TCP store at ``master_address:master_port`` and drives the control plane:
it starts the workers' init (they join inside it) and their update (they receive inside it) on
helper threads while every trainer rank sends; it calls
``finish_weight_update(weight_version=...)`` only after every rank of the session committed, so
vLLM's version advances only when every worker holds every byte.

Serving around a refit (trainer rank 0, engine by engine; ``pause_mode`` of the init info or of
``send_weights``, vLLM's pause modes)::

    pause_mode   before the refit                 after it committed
    "keep"       requests in flight frozen, new   prefix cache reset, then resumed: the frozen
    (default)    ones queued                      requests, preempted by the reset, have the KV
                                                  of their prompt and tokens so far recomputed
                                                  with the new weights, then go on (their
                                                  outputs' weight_versions spans show where the
                                                  version changed)
    "wait"       requests in flight finish on     prefix cache reset, then resumed
                 the old weights first (the
                 drain counts against the
                 session's timeout)
    "abort"      requests in flight returned      prefix cache reset, then resumed
                 with finish_reason "abort"
    None         nothing (the caller pauses)      prefix cache reset (running requests
                                                  preempted and recomputed, as in "keep")

Every output carries the version that produced it: vLLM labels each step's tokens with the
engine's weight version (``CompletionOutput.weight_versions``), and with the engine paused from
before the first byte lands until the version is recorded, no step runs on weights the label
does not name (with ``None``, a step may run between the update and the version's record).

**Prefix cache.** vLLM keeps the KV blocks of finished requests for later prompts that share
their prefix (prefix caching is on by default), and nothing in a weight update drops them: a
prompt cached before a refit would be answered after it from KV computed by the old weights,
under the new version's label. So every committed refit resets the prefix cache of every engine,
in every pause mode, in this order (trainer rank 0, engine by engine):

1. ``finish_weight_update(weight_version=...)``: the workers finish the update (on CPU, vLLM's
   layerwise reload repacks the weights here, so the new weights are complete only now) and the
   engine records the version;
2. ``reset_prefix_cache()`` (``reset_running_requests=True``): every cached block is dropped, and
   every running request is preempted (back to vLLM's waiting queue, its blocks freed, its tokens
   kept): when it is scheduled again vLLM recomputes the KV of its prompt and of the tokens it has
   generated, with the new weights. A reset vLLM reports failed is not ignored: the engine is
   gated (as after a failed refit, below, though its weights are whole; the next complete refit
   resets and ungates it) and the refit raises ``RuntimeError`` naming the engine;
3. ``resume_generation()`` (in the pause modes): the scheduler steps again.

Why this order: the reset has to come after the last moment KV could be computed with older
weights, which is step 1 (on CPU the weights change there), and before the first step that could
read the cache with the new weights, which follows step 3. The engine is paused through all three
(since before the first byte landed), so no step runs in between: no KV of older weights survives
into a step on the new ones. A paused engine takes the reset (vLLM's level-0 sleep stops the
scheduler's steps, not its utility calls). With ``None`` the trainer does not pause the engine:
until step 2 its steps may read KV of older weights (and, as said above, run on weights the
version label does not name); from step 2 on none does. Pause it around the refit (or use a
pause mode) for a clean cut. In ``keep`` mode the frozen requests lose nothing but time: each
costs one prefill of its prompt and tokens so far when it resumes; its tokens before the cut came
from the old weights, those after from the new weights and KV of the new weights only. A client
that pauses but has no reset of its own has its ``resume_generation(clear_cache=True)`` do steps 2
and 3. One that cannot be reset without being resumed (no ``reset_prefix_cache``, and not paused
by the trainer: a client with only vLLM's four weight-sync methods, or such a client under
``None``) is not reset: a warning says so, once per client.

**Receiving while serving** (``RefitOptions(receive="staged")``): rank 0 does not pause before
the transfer. Per engine it calls ``start_weight_update()`` and ``update_weights({..., "step":
"receive"})``, which return at once (the workers receive on a thread of their own while the engine
serves its current version; rank 0 stops waiting for the calls of an engine with a worker found
dead, which vLLM may leave unanswered for seconds while it shuts that engine down); every rank runs
its refit; once it committed, per engine: ``pause_generation(mode)`` (if pausing),
``update_weights({..., "step": "apply"})`` (the workers put the staged version in place), then
steps 1-3 above. The engine's pause is the apply step only
(:attr:`ReshardTrainerWeightTransferEngine.last_pause_s`, per engine). A refit that fails before
its commit moved no live byte (``error.moved`` is False): no engine is paused or gated; each gets
the apply step (its workers record the failed receive and stay ready at their version) and
``finish_weight_update()`` without a version. ``send_weights(..., wait=False)`` runs the whole
send on a thread and returns a :class:`~reshard.refit.background.RefitHandle` (an optimizer step
over a parameter it sends waits for it). docs/vllm.md, "Receiving while serving", says how vLLM
lets this happen.

**A failed refit gates the engines.** When a refit fails after bytes may have moved (any
``RefitError`` but one at connect or agreement, which move none), the destinations may hold a mix
of versions (the trainer cannot see which were written, so it treats every engine alike; the
workers' ``transfer_state`` says which are). Trainer rank 0 then, for every engine it can still
reach: pauses generation with mode ``"abort"`` (requests in flight come back with finish reason
``"abort"``; new ones are not scheduled), closes vLLM's update window with
``finish_weight_update()`` without a version (the engine's reported weight version stays the last
complete one), and keeps it so until a refit completes, then resumes it. An offline ``LLM`` also
refuses requests at once (a paused offline engine would make ``generate`` wait forever):
``generate`` raises :class:`~reshard.integrations.vllm.clients.WeightsPoisonedError` naming the
failed version. An HTTP server stays paused (its requests wait). The workers say the same on their
side (``transfer_state``, their logs: :mod:`reshard.integrations.vllm.engine`). A client that
cannot pause (one with only vLLM's four weight-sync methods) is not gated: a warning says so. A
dead engine (its calls fail) is named in a note on the error.

After a failure the session is broken: :meth:`ReshardTrainerWeightTransferEngine.reconnect`
connects a new one (new store port; other engines, when one died and another replaced it), and
its first complete refit ungates the engines.

Switching from ``nccl_m2n``: change the init info to :class:`ReshardTrainerInitInfo` and the source
to :class:`ReshardSource` (the module itself, not a list of tensors).

This module holds the trainer engine; its parts live beside it: the init info in
:mod:`~reshard.integrations.vllm.init_info`, the source in :mod:`~reshard.integrations.vllm.source`,
the engines' client adapters in :mod:`~reshard.integrations.vllm.clients`, the bounded calls on
helper threads in :mod:`~reshard.integrations.vllm.threads`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Self

import torch
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, VLLMWeightSyncClient, WeightSource

from ...options import STAGED
from ...refit.background import RefitHandle, copies_of
from ...refit.session import RefitSession, RefitStats
from .clients import AsyncLLMClient, EngineGroup, HTTPClient, OfflineClient, PrefixCacheResetError, as_client
from .init_info import ReshardTrainerInitInfo, check_pause_mode
from .source import ReshardSource
from .threads import in_thread, outcome, with_pending_call

RECEIVE_CHECK_S = 0.25  # a staged refit's wait for the receive calls looks for dead workers this often

logger = logging.getLogger(__name__)


class ReshardTrainerWeightTransferEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """The ``reshard`` backend's trainer engine (see module doc)."""

    init_info_cls = ReshardTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: ReshardSource, init_info: ReshardTrainerInitInfo
                 ) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        self.session: RefitSession | None = None
        self.steps = 0
        self.last_stats: RefitStats | None = None
        # rank 0: each engine's pause in the last refit, seconds from pause to resume as seen here (None: not
        # paused by the trainer); with receive="staged" only the apply step, else the whole refit
        self.last_pause_s: list[float | None] = []

    @property
    def grace_s(self) -> float:
        """How long rank 0 waits for an engine's call once its own side of the same step is done."""
        return self.init_info.timeout_s + self.init_info.engine_grace_s

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | torch.nn.Module | None = None) -> Self:
        """Connect this trainer rank to the engines (collective over every trainer rank and worker)."""
        if isinstance(source, torch.nn.Module):
            source = ReshardSource(source)
        if not isinstance(source, ReshardSource):
            raise TypeError(f"the reshard backend sends local shards with their layout: pass "
                            f"source=ReshardSource(model) (or the module itself), not {type(source).__name__}")
        engine = cls(client=as_client(client), source=source, init_info=init_info)
        engine._connect()
        return engine

    def _connect(self) -> None:
        info = self.init_info
        side = self.source.side(info.rank)
        pending: Future | None = None
        if self.is_sender:
            worker_info = info.worker_init_info()
            if not isinstance(self.client, EngineGroup):
                if len(info.engine_sizes) > 1:
                    raise ValueError(f"{len(info.engine_sizes)} engines need an EngineGroup of their clients")
                worker_info["engine_index"] = 0
            pending = in_thread(self.client.init_weight_transfer_engine, worker_info)
        with with_pending_call(pending, self.grace_s):
            self.session = RefitSession.connect(
                source=side, store_addr=f"{info.master_address}:{info.master_port}", rank=info.rank,
                world_size=info.world_size, backend=info.comm_backend, options=info.options)

    def reconnect(self, init_info: ReshardTrainerInitInfo | None = None, *,
                  client: VLLMWeightSyncClient | None = None) -> None:
        """Close the session (after a failed refit it is broken) and connect a new one, on every trainer
        rank (collective, like :meth:`trainer_init`). ``init_info``: the new connection (a fresh
        ``master_port``; new ``engine_world_sizes`` when the engines changed); ``client``: the engines
        now (rank 0; an engine that died replaced by a new one). Engines gated by a failed refit stay
        gated until the next refit completes."""
        if self.session is not None:
            try:
                self.session.close()
            except Exception as error:  # noqa: BLE001 - a broken group: the new session goes on
                logger.warning("closing the previous refit session: %s", error)
            self.session = None
        if init_info is not None:
            self.init_info = init_info
            self.is_sender = init_info.is_sender
        if client is not None:
            self.client = as_client(client)
        self._connect()

    def _engines(self) -> list:
        return list(self.client.clients) if isinstance(self.client, EngineGroup) else [self.client]

    def _engine_name(self, index: int) -> str:
        ranks = self.init_info.engine_ranks(index)
        return f"engine {index} (refit rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"

    def send_weights(self, weight_version: str | None = None, *, pause_mode: str | None = "default",
                     wait: bool = True, snapshot: bool = False) -> RefitStats | RefitHandle[RefitStats]:
        """One refit (on every trainer rank): rank 0 pauses each engine (``pause_mode``: ``"default"`` for
        the init info's, a vLLM pause mode, or None), starts its update, every rank sends while the
        workers receive, every rank commits; then rank 0 records the version on each engine and
        resumes it. If the refit fails, rank 0 gates the engines (see module doc) and every rank
        raises the session's ``RefitError``. With ``receive="staged"`` in the options the engines
        serve while they receive and pause only to put the version in place (see module doc,
        "Receiving while serving"). ``wait=False``: the whole send runs on a thread; the returned
        :class:`~reshard.refit.background.RefitHandle` gives the stats or raises the error on
        ``wait()``, and an optimizer step over a parameter it sends waits for it first (``snapshot``:
        this rank's shards are copied first, :attr:`RefitHandle.snapshot_bytes` more memory until the
        refit ends, and nothing waits)."""
        if self.session is None:
            raise RuntimeError("the reshard trainer engine is not connected")
        mode = self.init_info.pause_mode if pause_mode == "default" else pause_mode
        check_pause_mode(mode)
        self.steps += 1
        version = str(self.steps) if weight_version is None else str(weight_version)
        if wait:
            return self._send(version, mode)
        source = self.session.source
        sources = source.read() if source is not None else {}
        if not snapshot:
            return RefitHandle(lambda: self._send(version, mode), sources=list(sources.values()),
                               name=f"reshard-send-{version}")
        copies, snapshot_bytes = copies_of(sources)
        return RefitHandle(lambda: self._send(version, mode, copies), name=f"reshard-send-{version}",
                           snapshot_bytes=snapshot_bytes)

    def _send(self, version: str, mode: str | None, copies: dict | None = None) -> RefitStats:
        engines = self._engines() if self.is_sender else []
        paused = [bool(mode) and hasattr(client, "pause_generation") for client in engines]
        self.last_pause_s = [None] * len(engines)
        pause_started: list[float | None] = [None] * len(engines)
        if self.init_info.options.receive == STAGED:
            return self._send_staged(version, mode, engines, paused, pause_started, copies)
        # one thread per engine: a dead engine fails its own calls, the others join the refit that names it
        rounds = [in_thread(self._engine_round, client, mode if pause else None, version, self.init_info.options.method,
                            pause_started, index)
                  for index, (client, pause) in enumerate(zip(engines, paused))]
        try:
            self.last_stats = self._refit(version, copies)
        except Exception as error:
            if self.is_sender:
                self._after_failure(error, version, engines, rounds, paused)
            raise
        if self.is_sender:
            self._after_commit(version, mode, engines, rounds, paused, pause_started)
        return self.last_stats

    def _refit(self, version: str, copies: dict | None) -> RefitStats:
        """This rank's side of the refit, from ``copies`` of its shards where a snapshot was taken."""
        if copies is None:
            return self.session.refit(version)
        return self.session.refit(version, source_tensors=copies)

    @staticmethod
    def _engine_round(client, mode: str | None, version: str, method: str, pause_started: list, index: int) -> None:
        _pause(client, mode, pause_started, index)
        client.start_weight_update()
        client.update_weights({"version": version, "method": method})

    def _send_staged(self, version: str, mode: str | None, engines: list, paused: list[bool],
                     pause_started: list, copies: dict | None = None) -> RefitStats:
        """A refit the engines receive while serving (see module doc): each engine's workers start their
        receive (the call returns at once), every rank sends and commits, then each engine pauses for
        the apply step only."""
        method = self.init_info.options.method

        def start(client) -> None:
            client.start_weight_update()
            client.update_weights({"version": version, "method": method, "step": "receive"})

        receives = [in_thread(start, client) for client in engines]
        deadline = time.monotonic() + self.grace_s
        for index, future in enumerate(receives):  # they return at once; a dead engine's ranks fail the refit below
            self._await_receive(future, index, deadline)
        try:
            self.last_stats = self._refit(version, copies)
        except Exception as error:
            if self.is_sender:
                self._after_staged_failure(error, version, engines, receives, paused)
            raise
        if self.is_sender:
            applies = [in_thread(self._apply_round, receives[index], client, mode if paused[index] else None, version,
                                 method, pause_started, index) for index, client in enumerate(engines)]
            self._after_commit(version, mode, engines, applies, paused, pause_started)
        return self.last_stats

    def _await_receive(self, receive: Future, index: int, deadline: float) -> None:
        """Wait until engine ``index``'s receive call returned (at once, normally), ``deadline`` passed, or a
        worker of the engine is found dead: vLLM then shuts the engine down and the call may get no answer
        until it has (seconds), while the refit, which this rank would join only after the wait, fails at
        once naming the dead rank. Looks for dead workers every :data:`RECEIVE_CHECK_S`."""
        ranks = self.init_info.engine_ranks(index)
        while (left := deadline - time.monotonic()) > 0:
            outcome(receive, min(left, RECEIVE_CHECK_S))
            if receive.done() or self.session.group.control.gone_now(ranks):
                return

    def _apply_round(self, receive: Future, client, mode: str | None, version: str, method: str,
                     pause_started: list, index: int) -> None:
        """After the commit: pause the engine (``mode``), then its workers put the staged version in place."""
        error = outcome(receive, self.grace_s)
        if error is not None:
            raise error
        _pause(client, mode, pause_started, index)
        client.update_weights({"version": version, "method": method, "step": "apply"})
        ranks = self.init_info.engine_ranks(index)
        control = self.session.group.control
        notes = control.notes(f"applied/{version}", ranks, timeout=self.grace_s)
        control.drop_notes(f"applied/{version}", list(notes))
        problems = [f"rank {rank}: {notes[rank]}" if rank in notes else f"rank {rank} did not report its apply step "
                    f"within {self.grace_s:g} s" for rank in ranks if notes.get(rank, "missing") is not None]
        if problems:  # some workers hold the new version, others not: the engine must not serve
            reason = (f"the refit to weight version {version!r} committed, but putting it in place failed on "
                      f"{'; '.join(problems)}")
            client.finish_weight_update()  # vLLM's update window closes; its version stays the previous one
            if hasattr(client, "gate"):
                client.gate(reason)
            raise RuntimeError(reason + "; the engine is gated until a refit completes")

    def _after_staged_failure(self, error: Exception, version: str, engines: list, receives: list[Future],
                              paused: list[bool]) -> None:
        """A staged refit that failed before its commit: no engine was paused and no live byte moved
        (``error.moved`` is False), so none is gated; each engine's workers drop their staging (the
        apply step records the failed receive) and vLLM's update window closes without a version.
        Only an error that says bytes moved (not a staged session's) gates them, as in-place."""
        if getattr(error, "moved", True):
            self._after_failure(error, version, engines, receives, [False] * len(engines))
            return
        method = self.init_info.options.method

        def handle(index: int, client) -> list[str]:
            if gone := self._gone_workers(index):
                return gone
            round_error = outcome(receives[index], self.grace_s)
            if round_error is not None:
                return [f"its receive call: {type(round_error).__name__}: {round_error}"]
            try:
                client.update_weights({"version": version, "method": method, "step": "apply"})
                client.finish_weight_update()
            except Exception as exc:  # noqa: BLE001 - reported on the refit's error
                return [f"{type(exc).__name__}: {exc}"]
            return []

        self._note_problems(error, self._each_engine(engines, handle))

    def _gone_workers(self, index: int) -> list[str]:
        """After a failed refit: engine ``index``'s workers whose process a liveness probe found dead, as
        a problem to note, or nothing. vLLM shuts an engine with a dead worker down, and a call made while
        it does may get no answer until the grace runs out, so such an engine is not called at all."""
        gone = self.session.group.control.gone_now(self.init_info.engine_ranks(index))
        if not gone:
            return []
        return [f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} gone (the process is dead): "
                f"not called (vLLM shuts an engine with a dead worker down)"]

    def _note_problems(self, error: Exception, problems: list[list[str]]) -> None:
        """Each engine's problems (by index) after a failed refit: logged and noted on ``error``."""
        for index, engine_problems in enumerate(problems):
            if engine_problems:
                note = f"{self._engine_name(index)}: " + "; ".join(engine_problems)
                logger.warning(note)
                error.add_note(note)

    def _each_engine(self, engines: list, handle: Callable[[int, Any], list[str]]) -> list[list[str]]:
        """``handle(index, client)`` for every engine at once (each engine's calls in turn, on its own
        thread): the problems each one reports, bounded by the grace."""
        futures = [in_thread(handle, index, client) for index, client in enumerate(engines)]
        deadline = time.monotonic() + 2 * self.grace_s
        problems = []
        for future in futures:
            try:
                problems.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                problems.append([f"no answer within {2 * self.grace_s:g} s"])
        return problems

    def _after_commit(self, version: str, mode: str | None, engines: list, rounds: list[Future],
                      paused: list[bool], pause_started: list | None = None) -> None:
        """Per engine: record the version, drop the prefix cache, resume (see module doc, "Prefix cache")."""
        warned = self.__dict__.setdefault("_warned_no_reset", set())  # ids of clients warned about, once each

        def handle(index: int, client) -> list[str]:
            if (error := outcome(rounds[index], self.grace_s)) is not None:
                return [f"its update call failed: {type(error).__name__}: {error}"]
            client.finish_weight_update(weight_version=version)  # the workers finish (CPU: repack), version set
            resume = paused[index] or bool(getattr(client, "gated", None))
            reset = getattr(client, "reset_prefix_cache", None)
            if reset is None and not resume:
                if id(client) not in warned:
                    warned.add(id(client))
                    logger.warning("%s: %s cannot reset its prefix cache: after a refit it may answer prompts it "
                                   "cached from KV blocks of older weights", self._engine_name(index),
                                   type(client).__name__)
                return []
            try:
                if reset is None:  # a client that pauses but has no reset of its own: its resume resets first
                    client.resume_generation(clear_cache=True)
                    return []
                if reset() is False:
                    raise PrefixCacheResetError("reset_prefix_cache() returned False")
            except Exception as exc:  # noqa: BLE001 - reported on the refit
                return [self._stale_cache(client, version, exc)]
            if resume:
                client.resume_generation(clear_cache=False)
                if pause_started is not None and pause_started[index] is not None:
                    self.last_pause_s[index] = time.perf_counter() - pause_started[index]
            return []

        for index, problems in enumerate(self._each_engine(engines, handle)):
            if problems:
                raise RuntimeError(f"{self._engine_name(index)}: the refit to version {version!r} committed on every "
                                   f"rank, but {'; '.join(problems)}")

    def _stale_cache(self, client, version: str, exc: Exception) -> str:
        """A committed refit whose prefix-cache reset failed: gate the engine (if it can be gated) so that no
        request reads KV of older weights; the problem, for the refit's error."""
        problem = f"its prefix cache could not be reset ({type(exc).__name__}: {exc})"
        if not hasattr(client, "gate"):
            return problem + f"; {type(client).__name__} cannot be gated: it may answer from KV of older weights"
        reason = f"the refit to weight version {version!r} committed, but {problem}"
        try:
            if isinstance(client, (OfflineClient, HTTPClient, AsyncLLMClient)):
                client.gate(reason, torn=False)
            else:
                client.gate(reason)
        except Exception as gate_error:  # noqa: BLE001 - reported with the rest
            return problem + f"; gating it failed too ({type(gate_error).__name__}: {gate_error})"
        return problem + "; the engine is gated (it takes no request) until a refit completes"

    def _after_failure(self, error: Exception, version: str, engines: list, rounds: list[Future],
                       paused: list[bool]) -> None:
        gate = getattr(error, "moved", True)  # not a RefitError: assume the worst
        reason = f"the refit to weight version {version!r} failed ({error})"

        def handle(index: int, client) -> list[str]:
            if gone := self._gone_workers(index):
                return gone
            problems = []
            round_error = outcome(rounds[index], self.grace_s)
            if round_error is not None:
                problems.append(f"its update call: {type(round_error).__name__}: {round_error}")
            try:
                if gate and hasattr(client, "gate"):
                    client.gate(reason)
                elif gate:
                    problems.append(f"{type(client).__name__} cannot pause generation: the engine keeps serving "
                                    f"weights that may be torn")
                if round_error is None:  # the workers returned: close vLLM's update window, without a version
                    client.finish_weight_update()
                    if not gate and paused[index] and not getattr(client, "gated", None):
                        client.resume_generation(clear_cache=False)
            except Exception as exc:  # noqa: BLE001 - reported on the refit's error
                problems.append(f"{type(exc).__name__}: {exc}")
            return problems

        self._note_problems(error, self._each_engine(engines, handle))

    def shutdown(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def _pause(client, mode: str | None, pause_started: list, index: int) -> None:
    """Pause engine ``index`` in ``mode`` (None: not at all), noting when its pause began."""
    if mode:
        pause_started[index] = time.perf_counter()
        client.pause_generation(mode)


__all__ = ["ReshardTrainerWeightTransferEngine"]
