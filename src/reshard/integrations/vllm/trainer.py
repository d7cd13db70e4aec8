"""Trainer side of the ``reshard`` backend: every trainer rank sends its own shards, at once.

Built on every trainer rank by vLLM's factory, like the ``nccl`` and ``nccl_m2n`` backends::

    info = ReshardTrainerInitInfo(rank=rank, master_address=host, master_port=port,
                                  num_trainer_ranks=M, world_size=M + N)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ReshardSource(model))
    stats = engine.send_weights(weight_version="7")

``client`` is anything that speaks vLLM's weight-sync protocol (an ``LLM``, vLLM's HTTP or Ray
clients), or an :class:`EngineGroup` of several. Trainer rank 0 hosts the refit group's TCP store
at ``master_address:master_port`` and drives the control plane: it starts the workers' init (they
join inside it) and their update (they receive inside it) on helper threads while every trainer
rank sends; it calls ``finish_weight_update(weight_version=...)`` only after every rank of the
session committed, so vLLM's version advances only when every worker holds every byte.

Serving around a refit (trainer rank 0, engine by engine; ``pause_mode`` of the init info or of
``send_weights``, vLLM's pause modes)::

    pause_mode   before the refit                 after it committed
    "keep"       requests in flight frozen, new   resumed: frozen requests go on with the new
    (default)    ones queued                      weights (their outputs' weight_versions spans
                                                  show where the version changed)
    "wait"       requests in flight finish on     resumed
                 the old weights first (the
                 drain counts against the
                 session's timeout)
    "abort"      requests in flight returned      resumed
                 with finish_reason "abort"
    None         nothing (the caller pauses)      -

Every output carries the version that produced it: vLLM labels each step's tokens with the
engine's weight version (``CompletionOutput.weight_versions``), and with the engine paused from
before the first byte lands until the version is recorded, no step runs on weights the label
does not name (with ``None``, a step may run between the update and the version's record). After a complete refit, ``abort`` and ``wait`` also drop the prefix cache (KV of
the old weights); ``keep`` keeps the frozen requests' KV, as vLLM's ``keep`` does.

**A failed refit gates the engines.** When a refit fails after bytes may have moved (any
``RefitError`` but one at connect or agreement, which move none), the destinations may hold a
mix of versions (the trainer cannot see which were written, so it treats every engine alike; the
workers' ``transfer_state`` says which are). Trainer rank 0 then, for every engine it can still
reach: pauses generation with
mode ``"abort"`` (requests in flight come back with finish reason ``"abort"``; new ones are not
scheduled), closes vLLM's update window with ``finish_weight_update()`` without a version (the
engine's reported weight version stays the last complete one), and keeps it so until a refit
completes, then resumes it. An offline ``LLM`` also refuses requests at once (a paused offline
engine would make ``generate`` wait forever): ``generate`` raises :class:`WeightsPoisonedError`
naming the failed version. An HTTP server stays paused (its requests wait). The workers say the
same on their side (``transfer_state``, their logs: :mod:`reshard.integrations.vllm.engine`). A
client that cannot pause (one with only vLLM's four weight-sync methods) is not gated: a warning
says so. A dead engine (its calls fail) is named in a note on the error.

After a failure the session is broken: :meth:`ReshardTrainerWeightTransferEngine.reconnect`
connects a new one (new store port; other engines, when one died and another replaced it), and
its first complete refit ungates the engines.

Switching from ``nccl_m2n``: change the init info to :class:`ReshardTrainerInitInfo` and the source
to :class:`ReshardSource` (the module itself, not a list of tensors).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, ClassVar, Iterator, Mapping, Self

import torch
from vllm.distributed.weight_transfer.base import (ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine,
                                                   VLLMWeightSyncClient, WeightSource)

from ...execution.methods import HYBRID, check_method
from ...planning.hybrid import as_rule
from ...refit.session import AUTO, DEFAULT_BUCKET_BYTES, RefitSession, RefitStats
from ...refit.sides import Side
from .plugin import BACKEND, register

register()  # trainer processes run no vLLM engine, so no plugin loading: using the init info registers it

logger = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "wait", "keep")
_NOTHING_MOVED = ("connect", "agreement")  # RefitError phases before any byte moves


@dataclass(kw_only=True)
class ReshardTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``reshard`` backend (``rank``: this trainer rank, also its refit rank).

    The refit group is the trainer ranks ``0..num_trainer_ranks-1`` followed by each engine's
    workers, engine by engine (``engine_world_sizes``, in the client's order; default: one engine
    with every other rank).
    """

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int  # trainer ranks + every engine's workers
    num_trainer_ranks: int = 1
    engine_world_sizes: list[int] | None = None
    # "auto" (hierarchical over NVLink domains when they exist), "reshard", "hierarchical", "hybrid"
    # (hybrid_patterns by reshard, the other tensors by gather-and-broadcast), "gather-broadcast"
    method: str = AUTO
    max_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES  # transfer staging cap per rank (two rounds in flight share it)
    timeout_s: float = 300.0  # bounds every wait of the session
    comm_backend: str | None = None  # "gloo" or "nccl"; default: nccl when CUDA is available
    pause_mode: str | None = "keep"  # vLLM's pause mode around each refit ("abort", "wait", "keep"), or None
    checksum: bool = False  # an xxh3-64 digest per message, checked on arrival (catches corruption on the wire)
    # rank 0's extra wait for an engine's weight-sync call once its own side of the same step ended:
    # a worker that stalls keeps vLLM's RPC busy, so gating its engine waits up to timeout_s + this
    engine_grace_s: float = 30.0
    # method "hybrid": regular expressions (re.search) of the tensors it moves by reshard; None: FFN and
    # expert weights (reshard.planning.hybrid.FFN_PATTERNS); [] sends every tensor by gather-and-broadcast
    hybrid_patterns: list[str] | None = None

    def __post_init__(self) -> None:
        for name in ("timeout_s", "engine_grace_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)
                    and (value > 0 if name == "timeout_s" else value >= 0)):
                raise ValueError(f"{name} must be a finite number of seconds (timeout_s > 0, engine_grace_s >= 0), "
                                 f"got {value!r}")
        if self.method != AUTO:
            check_method(self.method)  # ValueError naming the methods
        if self.hybrid_patterns is not None:
            if self.method != HYBRID:
                raise ValueError(f"hybrid_patterns is the rule of method 'hybrid', not of method {self.method!r}")
            as_rule(self.hybrid_patterns)  # ValueError naming a pattern that is no regular expression
        if not 0 <= self.rank < self.num_trainer_ranks < self.world_size:
            raise ValueError(f"trainer rank {self.rank} of {self.num_trainer_ranks} must leave room for inference "
                             f"ranks in world_size {self.world_size}")
        sizes = self.engine_sizes
        if sum(sizes) != self.world_size - self.num_trainer_ranks or min(sizes) < 1:
            raise ValueError(f"engine_world_sizes {sizes} must add up to the {self.world_size - self.num_trainer_ranks} "
                             f"inference ranks")
        _check_pause_mode(self.pause_mode)

    @property
    def engine_sizes(self) -> list[int]:
        return list(self.engine_world_sizes or [self.world_size - self.num_trainer_ranks])

    @property
    def rank_offsets(self) -> list[int]:
        sizes = self.engine_sizes
        return [self.num_trainer_ranks + sum(sizes[:i]) for i in range(len(sizes))]

    def engine_ranks(self, index: int) -> list[int]:
        """The refit ranks of engine ``index``'s workers."""
        first = self.rank_offsets[index]
        return list(range(first, first + self.engine_sizes[index]))

    def worker_init_info(self) -> dict[str, Any]:
        """The workers' init info (plain JSON), without ``engine_index``."""
        return {"store_addr": f"{self.master_address}:{self.master_port}", "world_size": self.world_size,
                "rank_offsets": self.rank_offsets, "method": self.method,
                "max_bucket_bytes": self.max_bucket_bytes, "timeout_s": self.timeout_s,
                "comm_backend": self.comm_backend, "checksum": self.checksum, "hybrid_patterns": self.hybrid_patterns}


def _check_pause_mode(mode: str | None) -> None:
    if mode is not None and mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode {mode!r}: use one of {', '.join(PAUSE_MODES)}, or None")


class ReshardSource(WeightSource):
    """A trainer's weights as ``reshard`` sends them: this rank's local shards and where they sit.

    ``ReshardSource(model)`` reads a module (DTensor parameters of FSDP2, FSDP2 over TP or a
    Hugging Face ``tp_plan`` model by their placements; plain tensors as replicas; transformers 5's
    fused experts by checkpoint names); ``ReshardSource(side)`` takes an explicit
    :class:`~reshard.refit.sides.Side` (a Megatron-Core layout, say). ``rank_of`` maps the ranks of
    the module's device meshes to refit ranks (default: the same numbers).
    """

    def __init__(self, module_or_side: torch.nn.Module | Side, *, rank_of: Mapping[int, int] | None = None) -> None:
        self._what = module_or_side
        self._rank_of = rank_of
        self._side: Side | None = module_or_side if isinstance(module_or_side, Side) else None

    def side(self, rank: int) -> Side:
        """This rank's source side (read from the module once; its tensors are the live shards)."""
        if self._side is None or self._side.rank != rank:
            if isinstance(self._what, Side):
                raise ValueError(f"the source side was built for rank {self._what.rank}, not {rank}")
            self._side = Side.from_module(self._what, rank, rank_of=self._rank_of)
        return self._side

    def metadata(self) -> list[ParamMeta]:
        side = self._side if self._side is not None else self.side(0 if not isinstance(self._what, Side)
                                                                    else self._what.rank)
        return [ParamMeta(s.name, s.dtype, s.shape) for s in side.layout.specs.values()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers (local shards), not full tensors: reshard never gathers."""
        if self._side is None:
            raise RuntimeError("the source has no rank yet: trainer_init reads it")
        yield from self._side.read().items()


# ---------------------------------------------------------------------- clients


class WeightsPoisonedError(RuntimeError):
    """A request to an offline ``LLM`` whose weights a failed refit may have torn (see module doc)."""


class OfflineClient:
    """An offline ``vllm.LLM`` as a weight-sync client that can pause and gate its engine.

    vLLM 0.32's ``LLM`` methods take request dicts (``{"init_info": ...}``, ``{"update_info": ...}``)
    rather than the protocol's plain payloads; this wraps them. Pausing is vLLM's level-0 sleep
    (``sleep(level=0, mode=...)`` / ``wake_up(tags=["scheduling"])``: the scheduler stops, requests
    in flight are handled per mode). A gated ``LLM`` also refuses new requests: its engine's
    ``add_request`` raises :class:`WeightsPoisonedError` until :meth:`resume_generation` (vLLM has
    no hook to refuse requests, and a paused offline engine would keep ``generate`` waiting). One
    client per ``LLM`` (:func:`as_client` keeps it on the ``LLM``), so a gate outlives the trainer
    engine that set it.

    Every call fails once the engine is dead: vLLM 0.32's offline front end never answers a call it
    sent to an EngineCore that died before replying (its future stays pending: a gate sent while a
    killed worker takes its engine down would wait forever), so each call waits on the front end's
    ``engine_dead`` too and then raises ``EngineDeadError``.
    """

    def __init__(self, llm) -> None:
        self.llm = llm
        self.gated: str | None = None  # why the engine takes no request, while it is gated

    def _call(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` (a method of the ``LLM``), failing once the engine is dead (see class doc)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        future = in_thread(lambda: fn(*args, **kwargs))
        resources = getattr(getattr(self.llm.llm_engine, "engine_core", None), "resources", None)
        while True:
            try:
                return future.result(timeout=0.05)
            except FutureTimeout:
                if getattr(resources, "engine_dead", False):
                    try:
                        return future.result(timeout=1.0)  # an answer already on its way
                    except FutureTimeout:
                        raise EngineDeadError(f"(no answer to {getattr(fn, '__name__', fn)}: the engine died)"
                                              ) from None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call(self.llm.init_weight_transfer_engine, {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call(self.llm.start_weight_update)

    def update_weights(self, update_info) -> None:
        self._call(self.llm.update_weights, {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call(self.llm.finish_weight_update, weight_version)

    def pause_generation(self, mode: str) -> None:
        self._call(self.llm.sleep, level=0, mode=mode)

    def resume_generation(self, *, clear_cache: bool = True) -> None:
        """Take requests again (lifting a gate); ``clear_cache`` drops the prefix cache first."""
        self.llm.llm_engine.__dict__.pop("add_request", None)  # the refusal set by gate()
        self.gated = None
        if clear_cache:
            self._call(self.llm.reset_prefix_cache)
        self._call(self.llm.wake_up, tags=["scheduling"])

    def gate(self, reason: str) -> None:
        """Stop serving: refuse new requests, abort those in flight, pause the scheduler."""
        message = (f"this vLLM engine's weights may be torn: {reason}; it takes no request until a refit "
                   f"completes (its weight version stays the last complete one)")

        def refuse(*args, **kwargs):
            raise WeightsPoisonedError(message)

        self.gated = reason
        self.llm.llm_engine.add_request = refuse  # LLM.generate, chat, enqueue... all add through it
        self._call(self.llm.sleep, level=0, mode="abort")


class HTTPClient:
    """vLLM's ``HTTPVLLMWeightSyncClient`` plus the server's pause routes (``/pause?mode=``,
    ``/resume``; served with the weight-sync routes, under ``VLLM_SERVER_DEV_MODE=1``). A gated
    server is paused: its requests wait until a refit completes."""

    def __init__(self, client) -> None:
        self.client = client
        self.gated: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(weight_version)

    def _post(self, path: str, params: dict | None = None) -> None:
        import requests

        requests.post(f"{self.client.base_url}/{path}", params=params, timeout=self.client.timeout).raise_for_status()

    def pause_generation(self, mode: str) -> None:
        self._post("pause", {"mode": mode})  # the server clears its caches after abort and wait

    def resume_generation(self, *, clear_cache: bool = True) -> None:
        self.gated = None
        self._post("resume")

    def gate(self, reason: str) -> None:
        self.gated = reason
        self._post("pause", {"mode": "abort"})


def as_client(client):
    """``client`` as the trainer drives it: an offline ``vllm.LLM`` as its :class:`OfflineClient`
    (the same one each time), vLLM's ``HTTPVLLMWeightSyncClient`` as an :class:`HTTPClient`, anything
    else as it is."""
    from vllm import LLM
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    for kind, adapter in ((LLM, OfflineClient), (HTTPVLLMWeightSyncClient, HTTPClient)):
        if isinstance(client, kind):
            if not isinstance(getattr(client, "_reshard_client", None), adapter):
                client._reshard_client = adapter(client)
            return client._reshard_client
    return client


def in_thread(fn: Callable, *args) -> Future:
    """``fn(*args)`` on a daemon thread (a call into a dead engine may never return: it must not
    keep the process from exiting, as a thread pool's worker would)."""
    future: Future = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(e)

    threading.Thread(target=run, daemon=True, name="reshard-weight-sync").start()
    return future


def outcome(future: Future, seconds: float | None) -> BaseException | None:
    """Wait at most ``seconds`` for ``future``: its exception, a ``TimeoutError`` if it is still
    running, or None."""
    try:
        return future.exception(timeout=seconds)
    except FutureTimeout:
        return TimeoutError(f"no answer within {seconds:g} s")


class EngineGroup:
    """Several vLLM engines driven as one weight-sync client: every call goes to all of them at once
    (a refit needs every engine inside ``update_weights`` while the trainer sends); engine ``i`` gets
    ``engine_index=i`` in its init info. The trainer engine drives each engine on its own when it
    refits (so that one dead engine does not keep the others from the refit that names it)."""

    def __init__(self, clients: list[VLLMWeightSyncClient]) -> None:
        self.clients = [as_client(c) for c in clients]

    def _all(self, call) -> None:
        for f in [in_thread(call, i, c) for i, c in enumerate(self.clients)]:
            f.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all(lambda i, c: c.init_weight_transfer_engine({**init_info, "engine_index": i}))

    def start_weight_update(self) -> None:
        self._all(lambda i, c: c.start_weight_update())

    def update_weights(self, update_info) -> None:
        self._all(lambda i, c: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(lambda i, c: c.finish_weight_update(weight_version))


@contextmanager
def with_pending_call(pending: Future | None, grace_s: float | None = None):
    """Run the body, then wait for the control-plane call ``pending`` (the workers' side of the same
    collective); raise the body's error if it failed (the session's, which names the rank and
    tensor), else the call's. ``grace_s`` bounds the wait for the call after the body."""
    try:
        yield
    except BaseException:
        if pending is not None:
            outcome(pending, grace_s)  # wait for it; the workers fail the same way
        raise
    if pending is not None:
        error = outcome(pending, grace_s)
        if error is not None:
            raise error


# ---------------------------------------------------------------------- the trainer engine


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
            raise TypeError(f"the reshard backend sends local shards with their layout: pass source=ReshardSource(model)"
                            f" (or the module itself), not {type(source).__name__}")
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
                world_size=info.world_size, backend=info.comm_backend, timeout=timedelta(seconds=info.timeout_s),
                method=info.method, max_bucket_bytes=info.max_bucket_bytes, checksum=info.checksum,
                hybrid_rule=info.hybrid_patterns)

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
            except Exception as e:  # noqa: BLE001 - a broken group: the new session goes on
                logger.warning("closing the previous refit session: %s", e)
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

    def send_weights(self, weight_version: str | None = None, *, pause_mode: str | None = "default") -> RefitStats:
        """One refit (on every trainer rank): rank 0 pauses each engine (``pause_mode``: ``"default"`` for
        the init info's, a vLLM pause mode, or None), starts its update, every rank sends while the
        workers receive, every rank commits; then rank 0 records the version on each engine and
        resumes it. If the refit fails, rank 0 gates the engines (see module doc) and every rank
        raises the session's ``RefitError``."""
        if self.session is None:
            raise RuntimeError("the reshard trainer engine is not connected")
        mode = self.init_info.pause_mode if pause_mode == "default" else pause_mode
        _check_pause_mode(mode)
        self.steps += 1
        version = str(self.steps) if weight_version is None else str(weight_version)
        engines = self._engines() if self.is_sender else []
        paused = [bool(mode) and hasattr(c, "pause_generation") for c in engines]
        # one thread per engine: a dead engine fails its own calls, the others join the refit that names it
        rounds = [in_thread(self._engine_round, c, mode if p else None, version, self.init_info.method)
                  for c, p in zip(engines, paused)]
        try:
            self.last_stats = self.session.refit(version)
        except Exception as e:
            if self.is_sender:
                self._after_failure(e, version, engines, rounds, paused)
            raise
        if self.is_sender:
            self._after_commit(version, mode, engines, rounds, paused)
        return self.last_stats

    @staticmethod
    def _engine_round(client, mode: str | None, version: str, method: str) -> None:
        if mode:
            client.pause_generation(mode)
        client.start_weight_update()
        client.update_weights({"version": version, "method": method})

    def _each_engine(self, engines: list, handle: Callable[[int, Any], list[str]]) -> list[list[str]]:
        """``handle(i, client)`` for every engine at once (each engine's calls in turn, on its own
        thread): the problems each one reports, bounded by the grace."""
        futures = [in_thread(handle, i, c) for i, c in enumerate(engines)]
        deadline = time.monotonic() + 2 * self.grace_s
        out = []
        for f in futures:
            try:
                out.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                out.append([f"no answer within {2 * self.grace_s:g} s"])
        return out

    def _after_commit(self, version: str, mode: str | None, engines: list, rounds: list[Future],
                      paused: list[bool]) -> None:
        def handle(i: int, client) -> list[str]:
            if (e := outcome(rounds[i], self.grace_s)) is not None:
                return [f"its update call failed: {type(e).__name__}: {e}"]
            client.finish_weight_update(weight_version=version)
            if paused[i] or getattr(client, "gated", None):
                client.resume_generation(clear_cache=mode != "keep" or bool(client.gated))
            return []

        for i, problems in enumerate(self._each_engine(engines, handle)):
            if problems:
                raise RuntimeError(f"{self._engine_name(i)}: the refit to version {version!r} committed on every "
                                   f"rank, but {'; '.join(problems)}")

    def _after_failure(self, error: Exception, version: str, engines: list, rounds: list[Future],
                       paused: list[bool]) -> None:
        gate = getattr(error, "phase", None) not in _NOTHING_MOVED
        reason = f"the refit to weight version {version!r} failed ({error})"

        def handle(i: int, client) -> list[str]:
            problems = []
            round_error = outcome(rounds[i], self.grace_s)
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
                    if not gate and paused[i] and not getattr(client, "gated", None):
                        client.resume_generation(clear_cache=False)
            except Exception as e:  # noqa: BLE001 - reported on the refit's error
                problems.append(f"{type(e).__name__}: {e}")
            return problems

        for i, problems in enumerate(self._each_engine(engines, handle)):
            if problems:
                note = f"{self._engine_name(i)}: " + "; ".join(problems)
                logger.warning(note)
                error.add_note(note)

    def shutdown(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


__all__ = ["EngineGroup", "HTTPClient", "OfflineClient", "PAUSE_MODES", "ReshardSource", "ReshardTrainerInitInfo",
           "ReshardTrainerWeightTransferEngine", "WeightsPoisonedError", "as_client", "in_thread", "outcome"]
