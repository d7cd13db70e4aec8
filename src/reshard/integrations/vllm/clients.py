"""The engines as the trainer drives them: weight-sync clients that can also pause, reset and gate.

vLLM's weight-sync protocol has four calls (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``). The trainer engine also
pauses an engine around a refit, drops its prefix cache when a refit commits (KV blocks computed
by older weights must not answer a request under the new version), and gates it after a failed
refit (:mod:`reshard.integrations.vllm.trainer`), so each kind of client gets an adapter::

    client                              adapter          pause, reset, gate
    an offline vllm.LLM                 OfflineClient    level-0 sleep; LLM.reset_prefix_cache;
                                                         a gate also refuses requests
    vLLM's HTTPVLLMWeightSyncClient     HTTPClient       the server's /pause, /reset_prefix_cache
                                                         and /resume routes
    an in-process AsyncLLM              AsyncLLMClient   pause_generation / resume_generation on
                                                         its event loop (a daemon thread); a gate
                                                         also refuses requests
    several engines                     EngineGroup      every call to each engine at once
    anything else                       (as it is)       only if it has the methods

``reset_prefix_cache()`` resets with ``reset_running_requests=True``: vLLM's scheduler
(``Scheduler.reset_prefix_cache``, ``v1/core/sched/scheduler.py``) first preempts every running
request (back to the waiting queue, its blocks freed), so the reset cannot be refused because a
request holds blocks, as it is without that flag (vLLM then returns False, which ``LLM`` passes
on without a word). A preempted request keeps the tokens it generated; when it is scheduled again
vLLM recomputes the KV of its prompt and those tokens, with the weights the engine holds then. A
reset that vLLM reports failed raises :class:`PrefixCacheResetError`.

:func:`as_client` picks the adapter.
"""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

from .threads import in_thread


class WeightsPoisonedError(RuntimeError):
    """A request to an offline ``LLM`` whose weights a failed refit may have torn, or whose prefix
    cache a committed refit could not reset (see :mod:`reshard.integrations.vllm.trainer`)."""


class PrefixCacheResetError(RuntimeError):
    """vLLM reported that it did not reset an engine's prefix cache."""


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

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache, preempting the running requests (see module doc); works while the
        engine is paused (a level-0 sleep stops the scheduler's steps, not its utility calls).
        Raises :class:`PrefixCacheResetError` if vLLM says it did not reset."""
        if not self._call(self.llm.reset_prefix_cache, reset_running_requests=True):
            raise PrefixCacheResetError("vLLM did not reset the prefix cache (LLM.reset_prefix_cache("
                                        "reset_running_requests=True) returned False)")

    def resume_generation(self, *, clear_cache: bool = True) -> None:
        """Take requests again (lifting a gate); ``clear_cache`` first drops the prefix cache
        (:meth:`reset_prefix_cache`; if that fails, the engine stays as it was)."""
        if clear_cache:
            self.reset_prefix_cache()
        self.llm.llm_engine.__dict__.pop("add_request", None)  # the refusal set by gate()
        self.gated = None
        self._call(self.llm.wake_up, tags=["scheduling"])

    def gate(self, reason: str, *, torn: bool = True) -> None:
        """Stop serving: refuse new requests, abort those in flight, pause the scheduler. ``torn``:
        the weights may be torn (a failed refit); else the refit committed but its prefix cache may
        still hold KV of older weights."""
        message = _gate_message(reason, torn)

        def refuse(*args, **kwargs):
            raise WeightsPoisonedError(message)

        self.gated = reason
        self.llm.llm_engine.add_request = refuse  # LLM.generate, chat, enqueue... all add through it
        self._call(self.llm.sleep, level=0, mode="abort")


def _gate_message(reason: str, torn: bool) -> str:
    """What a gated engine answers a new request with (``torn``: see :meth:`OfflineClient.gate`)."""
    what = "weights may be torn" if torn else "prefix cache may hold KV of older weights"
    return (f"this vLLM engine's {what}: {reason}; it takes no request until a refit completes (its weight "
            f"version stays the last complete one)")


class HTTPClient:
    """vLLM's ``HTTPVLLMWeightSyncClient`` plus the server's pause routes (``/pause?mode=``,
    ``/resume``) and its ``/reset_prefix_cache`` route (served with the weight-sync routes, under
    ``VLLM_SERVER_DEV_MODE=1``). A gated server is paused: its requests wait until a refit
    completes."""

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

    def _post(self, path: str, params: dict | None = None):
        import requests

        response = requests.post(f"{self.client.base_url}/{path}", params=params, timeout=self.client.timeout)
        response.raise_for_status()
        return response

    def pause_generation(self, mode: str) -> None:
        self._post("pause", {"mode": mode})  # the server clears its caches after abort and wait

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache?reset_running_requests=true`` (running requests preempted: see
        module doc); raises :class:`PrefixCacheResetError` if the server answers ``success: false``."""
        answer = self._post("reset_prefix_cache", {"reset_running_requests": "true"}).json()
        if not answer.get("success"):
            raise PrefixCacheResetError(f"the vLLM server did not reset its prefix cache (/reset_prefix_cache "
                                        f"answered {answer})")

    def resume_generation(self, *, clear_cache: bool = False) -> None:
        """``POST /resume`` (lifting a gate); ``clear_cache`` first drops the prefix cache
        (:meth:`reset_prefix_cache`). The trainer engine resets through :meth:`reset_prefix_cache`
        itself, before it resumes, so the default is False here."""
        if clear_cache:
            self.reset_prefix_cache()
        self.gated = None
        self._post("resume")

    def gate(self, reason: str, *, torn: bool = True) -> None:
        """Pause with mode ``"abort"`` until a refit completes (``torn``: as :meth:`OfflineClient.gate`)."""
        self.gated = reason
        self._post("pause", {"mode": "abort"})


class AsyncLLMClient:
    """vLLM's in-process ``AsyncLLM`` (``vllm.v1.engine.async_llm``) as a weight-sync client the
    trainer drives from its helper threads, as it drives an :class:`OfflineClient`.

    ``AsyncLLM``'s methods are coroutines, bound to the event loop its output handler runs in. This
    client runs that loop on a daemon thread (its own, or one it is given) and gives every method a
    blocking form: each call is a coroutine scheduled on the loop, waited for at most ``timeout``
    seconds (then ``TimeoutError``, the coroutine cancelled), its error raised, and given up on with
    ``EngineDeadError`` once the engine is dead. Never call these from the loop's own thread: they
    would wait for the loop they block.

    Pausing is ``pause_generation(mode=..., clear_cache=False)`` (the trainer resets the prefix cache
    itself once the new weights are in place; clearing it at the pause would preempt ``keep``-mode
    requests for nothing), resuming ``resume_generation()``. A gated engine is paused in ``"abort"``
    and refuses new requests: its ``add_request`` raises :class:`WeightsPoisonedError` (``generate``
    wraps that in vLLM's ``EngineGenerateError``; :meth:`stream` raises it as it is) until
    :meth:`resume_generation` or a refit completes.

    :meth:`stream` runs greedy requests and records, per token, when it reached this process and
    which weight version produced it (a benchmark's or a test's view of a refit under load)::

        client = AsyncLLMClient.start(model=path, tensor_parallel_size=2,
                                      weight_transfer_config=WeightTransferConfig(backend="reshard"))
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ReshardSource(model))
        streams = client.stream(["hello world", [5, 17, 9]], max_tokens=256)   # runs meanwhile
        engine.send_weights(weight_version="v2")
        for s in streams.wait(timeout=120):
            print(s.token_ids[:4], s.arrivals[:4], s.versions[:4])
        client.close()

    One client per engine: :func:`as_client` keeps it on the ``AsyncLLM``.
    """

    def __init__(self, engine, *, loop=None, timeout: float = 600.0) -> None:
        """``engine``: an ``AsyncLLM``; ``loop``: the running event loop it belongs to (on another
        thread). Without one: the loop its output handler was started in, if it was, else a new loop
        on a daemon thread of this client's (the engine's output handler then starts there)."""
        import asyncio

        self.engine = engine
        self.timeout = timeout
        self.gated: str | None = None
        self._own_loop = None
        if loop is None and getattr(engine, "output_handler", None) is not None:
            loop = engine.output_handler.get_loop()
        if loop is None:
            loop = self._own_loop = _loop_thread()
        self.loop: asyncio.AbstractEventLoop = loop

    @classmethod
    def start(cls, *, timeout: float = 600.0, **engine_args) -> "AsyncLLMClient":
        """A new ``AsyncLLM`` (``AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))``), built on
        this client's own loop, and the client driving it; :meth:`close` shuts both down."""
        import asyncio

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        loop = _loop_thread()

        async def build():
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))

        try:
            engine = asyncio.run_coroutine_threadsafe(build(), loop).result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            raise
        client = cls(engine, loop=loop, timeout=timeout)
        client._own_loop = loop
        engine._reshard_client = client
        return client

    def _run(self, coro, timeout: float | None = None):
        """Run ``coro`` on the loop and wait for it (see class doc)."""
        import asyncio
        import threading

        from vllm.v1.engine.exceptions import EngineDeadError

        if getattr(self.loop, "_thread_id", None) == threading.get_ident():
            coro.close()
            raise RuntimeError("AsyncLLMClient's blocking calls cannot run on the engine's event loop thread")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        limit = self.timeout if timeout is None else timeout
        resources = getattr(getattr(self.engine, "engine_core", None), "resources", None)
        waited = 0.0
        while True:
            try:
                return future.result(timeout=0.05)
            except FutureTimeout:
                waited += 0.05
                if getattr(resources, "engine_dead", False):
                    try:
                        return future.result(timeout=1.0)  # an answer already on its way
                    except FutureTimeout:
                        future.cancel()
                        raise EngineDeadError("(no answer from the AsyncLLM: its engine died)") from None
                if waited >= limit:
                    future.cancel()
                    raise TimeoutError(f"the AsyncLLM did not answer within {limit:g} s") from None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update())

    def update_weights(self, update_info) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.engine.finish_weight_update(weight_version))

    def get_weight_version(self) -> str:
        return self._run(self.engine.get_weight_version())

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """``AsyncLLM.collective_rpc`` (one result per worker); a function needs
        ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, as with ``LLM.collective_rpc``."""
        return self._run(self.engine.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs))

    def pause_generation(self, mode: str) -> None:
        self._run(self.engine.pause_generation(mode=mode, clear_cache=False))

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache, preempting running requests (see module doc; works while paused);
        raises :class:`PrefixCacheResetError` if vLLM says it did not reset."""
        if not self._run(self.engine.reset_prefix_cache(reset_running_requests=True)):
            raise PrefixCacheResetError("vLLM did not reset the prefix cache (AsyncLLM.reset_prefix_cache("
                                        "reset_running_requests=True) returned False)")

    def resume_generation(self, *, clear_cache: bool = False) -> None:
        """Take requests again (lifting a gate); ``clear_cache`` first drops the prefix cache
        (:meth:`reset_prefix_cache`). The trainer resets before it resumes, so the default is False."""
        if clear_cache:
            self.reset_prefix_cache()
        self.engine.__dict__.pop("add_request", None)  # the refusal set by gate()
        self.gated = None
        self._run(self.engine.resume_generation())

    def gate(self, reason: str, *, torn: bool = True) -> None:
        """Stop serving: refuse new requests, abort those in flight, pause (``torn``: as
        :meth:`OfflineClient.gate`)."""
        message = _gate_message(reason, torn)

        async def refuse(*args, **kwargs):
            raise WeightsPoisonedError(message)

        self.gated = reason
        self.engine.add_request = refuse  # generate and encode add through it
        self._run(self.engine.pause_generation(mode="abort", clear_cache=False))

    def stream(self, prompts: list, *, max_tokens: int = 64, sampling_params=None) -> "StreamHandle":
        """Start one request per prompt (a string, or a list of token ids) and return at once; the
        :class:`StreamHandle` fills in as tokens arrive. Greedy (temperature 0, EOS ignored) unless
        ``sampling_params`` is given; either way outputs come as deltas (``RequestOutputKind.DELTA``),
        each token's arrival timed with ``time.perf_counter()`` when its output reaches this process.
        Versions come from the final output's ``CompletionOutput.weight_versions`` spans (vLLM sets
        them on the final output only), so :attr:`TokenStream.versions` fills in when a request ends."""
        import asyncio
        import time
        import uuid

        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self.gated is not None:
            raise WeightsPoisonedError(f"this vLLM engine is gated: {self.gated}")
        params = (sampling_params or SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)).clone()
        params.output_kind = RequestOutputKind.DELTA
        streams = [TokenStream(list(p) if not isinstance(p, str) else p) for p in prompts]

        async def one(stream: TokenStream) -> None:
            prompt = stream.prompt if isinstance(stream.prompt, str) else TokensPrompt(prompt_token_ids=stream.prompt)
            try:
                async for out in self.engine.generate(prompt, params, request_id=f"stream-{uuid.uuid4().hex}"):
                    now = time.perf_counter()
                    completion = out.outputs[0]
                    stream.token_ids.extend(completion.token_ids)
                    stream.arrivals.extend([now] * (len(stream.token_ids) - len(stream.arrivals)))
                    if out.finished:
                        stream.finish_reason = completion.finish_reason
                        stream.spans = [(s.version, s.start, s.end) for s in completion.weight_versions or []]
            except Exception as error:
                cause = error.__cause__
                raise cause if isinstance(cause, WeightsPoisonedError) else error

        async def run_all() -> list[TokenStream]:
            await asyncio.gather(*(one(s) for s in streams))
            return streams

        return StreamHandle(streams, asyncio.run_coroutine_threadsafe(run_all(), self.loop))

    def close(self) -> None:
        """Shut the engine down (its EngineCore and workers), and this client's own loop if it has one.
        The engine's output handler is cancelled first, on the loop (else it sees the EngineCore go and
        logs an ``EngineDeadError``)."""
        import asyncio

        async def stop() -> None:
            handler = getattr(self.engine, "output_handler", None)
            if handler is not None and not handler.done():
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
            self.engine.shutdown()

        self._run(stop())
        if self._own_loop is not None:
            self._own_loop.call_soon_threadsafe(self._own_loop.stop)
            self._own_loop = None


@dataclass
class TokenStream:
    """One request of :meth:`AsyncLLMClient.stream`, as far as it got."""

    prompt: str | list[int]
    token_ids: list[int] = field(default_factory=list)  # the output tokens so far
    arrivals: list[float] = field(default_factory=list)  # time.perf_counter() when each token arrived here
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # (version, start, end): set when it ends
    finish_reason: str | None = None  # None while it runs

    @property
    def versions(self) -> list[str | None]:
        """The weight version of each output token (None where vLLM has not labelled it: before the end)."""
        labels: list[str | None] = [None] * len(self.token_ids)
        for version, start, end in self.spans:
            labels[start:end] = [version] * (end - start)
        return labels


class StreamHandle:
    """The requests :meth:`AsyncLLMClient.stream` started: ``streams`` fill in as they run; ``wait``
    returns them once every request ended (or raises the first error, a ``TimeoutError`` past
    ``timeout``)."""

    def __init__(self, streams: list[TokenStream], future) -> None:
        self.streams, self._future = streams, future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> list[TokenStream]:
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"the streamed requests did not end within {timeout:g} s") from None

    def cancel(self) -> None:
        """Abort the requests (vLLM aborts a request whose ``generate`` is cancelled)."""
        self._future.cancel()


def _loop_thread():
    """A new event loop, running on a daemon thread (it dies with the process)."""
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(started.set)
        loop.run_forever()

    threading.Thread(target=run, daemon=True, name="reshard-asyncllm-loop").start()
    started.wait()
    return loop


def as_client(client):
    """``client`` as the trainer drives it: an offline ``vllm.LLM`` as its :class:`OfflineClient`
    (the same one each time), vLLM's ``HTTPVLLMWeightSyncClient`` as an :class:`HTTPClient`, an
    ``AsyncLLM`` as an :class:`AsyncLLMClient` (on the loop its output handler runs in, else a loop
    of its own), anything else as it is."""
    from vllm import LLM
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient
    from vllm.v1.engine.async_llm import AsyncLLM

    for kind, adapter in ((LLM, OfflineClient), (HTTPVLLMWeightSyncClient, HTTPClient), (AsyncLLM, AsyncLLMClient)):
        if isinstance(client, kind):
            if not isinstance(getattr(client, "_reshard_client", None), adapter):
                client._reshard_client = adapter(client)
            return client._reshard_client
    return client


class EngineGroup:
    """Several vLLM engines driven as one weight-sync client: every call goes to all of them at once
    (a refit needs every engine inside ``update_weights`` while the trainer sends); engine ``i`` gets
    ``engine_index=i`` in its init info. The trainer engine drives each engine on its own when it
    refits (so that one dead engine does not keep the others from the refit that names it)."""

    def __init__(self, clients: list[VLLMWeightSyncClient]) -> None:
        self.clients = [as_client(client) for client in clients]

    def _all(self, call: Callable[[int, Any], None]) -> None:
        """``call(index, client)`` for every engine at once; waits for each in turn, raising the first error."""
        for future in [in_thread(call, index, client) for index, client in enumerate(self.clients)]:
            future.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all(lambda index, client: client.init_weight_transfer_engine({**init_info, "engine_index": index}))

    def start_weight_update(self) -> None:
        self._all(lambda index, client: client.start_weight_update())

    def update_weights(self, update_info) -> None:
        self._all(lambda index, client: client.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(lambda index, client: client.finish_weight_update(weight_version))


__all__ = ["AsyncLLMClient", "EngineGroup", "HTTPClient", "OfflineClient", "PrefixCacheResetError", "StreamHandle",
           "TokenStream", "WeightsPoisonedError", "as_client"]
