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
        what = "weights may be torn" if torn else "prefix cache may hold KV of older weights"
        message = (f"this vLLM engine's {what}: {reason}; it takes no request until a refit "
                   f"completes (its weight version stays the last complete one)")

        def refuse(*args, **kwargs):
            raise WeightsPoisonedError(message)

        self.gated = reason
        self.llm.llm_engine.add_request = refuse  # LLM.generate, chat, enqueue... all add through it
        self._call(self.llm.sleep, level=0, mode="abort")


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


__all__ = ["EngineGroup", "HTTPClient", "OfflineClient", "PrefixCacheResetError", "WeightsPoisonedError",
           "as_client"]
