"""The rollout engine: a vLLM engine (``backend="reshard"``) as the RL loop's actor.

One object per engine, in its own process (a local actor or a Ray actor: :mod:`.orchestrate`).
The driver calls :meth:`RolloutEngine.generate`; trainer rank 0 calls the weight-sync methods
(vLLM's four, plus pausing) through :class:`EngineClient`, and :meth:`RolloutEngine.reload` for a
refit by checkpoint. Every completion comes back with the weight versions vLLM labelled its tokens
with. The engine times its own pause window: from the first call that stops serving (pause, start
of an update, a reload) to the last that restarts it (resume, finish, the reload's end); a staged
receive (``update_weights`` step ``"receive"``, bytes into staging while the engine serves) is
outside it, timed as ``receive``.

The asynchronous loop generates in the background: :meth:`RolloutEngine.submit` hands the engine a
batch and the version it must be sampled with, and returns; :meth:`RolloutEngine.collect` gives it
back. A :class:`~.batch_gate.BatchGate` keeps batches and weight changes apart (a batch never
straddles one). The batch runs on a thread of this process (``LLM.enqueue``, then
``LLM.wait_for_completion``) while the actor keeps answering calls, so a staged receive's calls
reach vLLM while it generates. That is safe with vLLM 0.32's offline front end because, once the
requests are queued, the generating thread only reads outputs (``LLMEngine.step``: its
``abort_requests`` sends nothing for an empty list, and there are no stop strings here) and a
utility call's answer is routed to its own future by the front end's output thread
(``v1/engine/core_client.py``, ``SyncMPClient``); every call into the front end that sends
(queueing a batch, every weight-sync call) holds one lock. Timestamps are ``time.monotonic()``
(Linux: one clock for every process of the machine), so the driver can order the engine's events
against the trainers'.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .batch_gate import BatchGate

VERSION0 = "0"  # the engine's weight version at start: the checkpoint both sides loaded


def engine_env(tp: int, first_core: int = 0) -> dict[str, str]:
    """The environment a CPU vLLM engine of ``tp`` workers needs here (set before vLLM is imported):
    1 GiB of KV cache, workers bound to cores ``first_core..first_core+tp-1`` (modulo the cores there
    are: several engines spread over them), quiet logs, no hub, ``collective_rpc`` with functions
    (engine digests).

    >>> cores = os.cpu_count() or 1
    >>> engine_env(2, first_core=1)["VLLM_CPU_OMP_THREADS_BIND"] == f"{1 % cores}|{2 % cores}"
    True
    """
    cores = os.cpu_count() or 1
    bind = "|".join(str((first_core + r) % cores) for r in range(tp))
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "HF_HUB_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": "ERROR", "VLLM_CPU_OMP_THREADS_BIND": bind, "TOKENIZERS_PARALLELISM": "false"}


class RolloutEngine:
    """An offline vLLM engine for rollouts and refits (see module doc)."""

    def __init__(self, path: str, tp: int, seed: int = 0, max_model_len: int = 128, timeout_s: float = 300.0,
                 first_core: int = 0) -> None:
        os.environ.update(engine_env(tp, first_core))
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        from ...integrations.vllm.clients import as_client

        self.llm = LLM(model=path, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True, seed=seed,
                       max_model_len=max_model_len, enable_prefix_caching=False,
                       distributed_executor_backend="mp",  # also inside a Ray actor: its workers are our children
                       weight_transfer_config=WeightTransferConfig(backend="reshard"))
        self.client = as_client(self.llm)  # pausing and gating an offline LLM
        self.llm.update_weight_version(VERSION0)
        self._front = threading.RLock()  # one call into vLLM's front end that sends at a time (see module doc)
        self.batches = BatchGate(VERSION0, timeout_s)
        self._version, self._paused = VERSION0, False  # the last version recorded; paused by the trainer
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rl-batch")  # the background batch
        self._batch: Future | None = None
        self._window: list[float | None] = [None, None]
        self._calls: dict[str, float] = {}
        self._start_t: float | None = None  # when the update window was opened (start_weight_update)

    # ------------------------------------------------------------------ rollouts

    @staticmethod
    def _params(n: int, max_tokens: int, temperature: float, seeds: list[int]) -> list:
        from vllm import SamplingParams

        return [SamplingParams(n=n, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                               temperature=temperature, top_p=1.0, top_k=0, seed=seed, logprobs=0, detokenize=False)
                for seed in seeds]

    @staticmethod
    def _groups(outputs) -> list[list[dict[str, Any]]]:
        return [[{"ids": list(c.token_ids),
                  "logprobs": [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)],
                  "versions": [(s.version, s.start, s.end) for s in (c.weight_versions or [])]}
                 for c in out.outputs] for out in outputs]

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, seeds: list[int]
                 ) -> list[list[dict[str, Any]]]:
        """``n`` completions of ``max_tokens`` tokens per prompt (token ids), prompt ``i`` sampled from
        ``seeds[i]`` (its completions from ``seeds[i] + 0 .. n - 1``): per completion its ``ids``, the
        engine's ``logprobs`` of them, and ``versions``, ``[(version, start, end)]`` spans."""
        from vllm import TokensPrompt

        with self._front:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                        self._params(n, max_tokens, temperature, seeds), use_tqdm=False)
        return self._groups(outputs)

    def submit(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, seeds: list[int],
               version: str) -> None:
        """:meth:`generate` in the background, sampled with weight version ``version``: the batch starts
        once the engine serves it (see :class:`~.batch_gate.BatchGate`). One batch at a time:
        :meth:`collect` it before the next."""
        from vllm import TokensPrompt

        if self._batch is not None:
            raise RuntimeError("a batch is still waiting to be collected")
        submitted = time.monotonic()
        params = self._params(n, max_tokens, temperature, seeds)

        def run() -> dict[str, Any]:
            started = self.batches.begin_batch(version)
            try:
                with self._front:
                    self.llm.enqueue([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
                outputs = self.llm.wait_for_completion(use_tqdm=False)  # in request order, as generate's
            finally:
                ended = self.batches.end_batch()
            if len(outputs) != len(prompts):
                raise RuntimeError(f"{len(prompts)} prompts queued, {len(outputs)} outputs came back")
            return {"groups": self._groups(outputs), "asked": version, "submitted": submitted,
                    "started": started, "ended": ended}

        self._batch = self._pool.submit(run)

    def collect(self, wait_s: float = 0.02) -> dict[str, Any] | None:
        """The submitted batch once it is done (``groups`` as :meth:`generate` gives them; ``asked``: its
        version; ``submitted``, ``started``, ``ended``: monotonic times), else None after ``wait_s``
        (short: the actor answers one call at a time, and the weight-sync calls must get in)."""
        from concurrent.futures import TimeoutError as FutureTimeout

        if self._batch is None:
            raise RuntimeError("no batch was submitted")
        try:
            result = self._batch.result(timeout=wait_s)
        except FutureTimeout:
            return None
        finally:
            if self._batch.done():  # collected, or failed: its error is raised here
                self._batch = None
        return result

    def weight_version(self) -> str:
        with self._front:
            return self.llm.get_weight_version()

    # ------------------------------------------------------------------ weight sync (trainer rank 0)

    def _stop(self, at: float | None = None) -> None:
        if self._window[0] is None:
            self._window = [time.monotonic() if at is None else at, None]

    def _restart(self) -> None:
        self._window[1] = time.monotonic()
        if not self._paused:
            self.batches.serve(self._version)

    def _timed(self, name: str, fn, *args, **kwargs):
        start = time.monotonic()
        try:
            with self._front:
                return fn(*args, **kwargs)
        finally:
            self._calls[name] = self._calls.get(name, 0.0) + time.monotonic() - start

    def _weights_change(self) -> None:
        """Before a call that changes what the engine serves: the batch in flight ends first (and one
        asked for the version served now runs first); the window opens when the engine stops serving."""
        last_end = self.batches.stop_serving()
        # opened by start_weight_update (vLLM's update window), but not before the last batch ended
        self._stop(None if self._start_t is None else max(self._start_t, last_end or 0.0))

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        with self._front:
            self.client.init_weight_transfer_engine(init_info)

    def pause_generation(self, mode: str) -> None:
        self._weights_change()
        self._paused = True
        self._timed("pause", self.client.pause_generation, mode)

    def start_weight_update(self) -> None:
        self._start_t = time.monotonic()  # vLLM's update window: the weights do not change yet
        self._timed("start", self.client.start_weight_update)

    def update_weights(self, update_info) -> None:
        step = update_info.get("step") if isinstance(update_info, dict) else getattr(update_info, "step", None)
        if step == "receive":  # into staging, while the engine serves: outside the pause window
            self._calls["receive"] = self._calls.pop("start", 0.0)
            self._start_t = None
            self._timed("receive", self.client.update_weights, update_info)
            return
        self._weights_change()
        self._timed("apply" if step == "apply" else "update", self.client.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._timed("finish", self.client.finish_weight_update, weight_version)
        self._start_t = None
        if weight_version is not None:
            self._version = weight_version
        self._restart()

    def resume_generation(self, clear_cache: bool = True) -> None:
        self._timed("resume", self.client.resume_generation, clear_cache=clear_cache)
        self._paused = False
        self._restart()

    def gate(self, reason: str) -> None:
        with self._front:
            self.client.gate(reason)

    def reload(self, directory: str, version: str) -> None:
        """A refit by checkpoint: vLLM reloads every weight from the safetensors in ``directory``."""
        self._weights_change()
        self._timed("reload", self.llm.collective_rpc, "reload_weights", kwargs={"weights_path": directory})
        with self._front:
            self.llm.update_weight_version(version)
        self._version = version
        self._restart()

    def take_window(self) -> dict[str, Any] | None:
        """The last refit as the engine saw it (then forgotten): ``seconds`` it stopped serving, ``start``
        and ``end`` of that window (monotonic), and the seconds of each call (``pause``, ``start``,
        ``update``, ``apply``, ``finish``, ``resume``, ``reload`` in the window; ``receive`` before it)."""
        (start, end), calls = self._window, self._calls
        self._window, self._calls = [None, None], {}
        if start is None or end is None:
            return None
        return {"seconds": end - start, "calls": calls, "start": start, "end": end}

    # ------------------------------------------------------------------ inspection, shutdown

    def digests(self) -> list[str]:
        """One digest per worker of every tensor it computes with (packed weights included)."""
        from ...integrations.vllm.inspect import engine_digest

        with self._front:
            return self.llm.collective_rpc(engine_digest)

    def pid(self) -> int:
        return os.getpid()

    def worker_pids(self) -> list[int]:
        """The process ids of the engine's workers (vLLM's, one per TP rank)."""
        with self._front:
            return self.llm.collective_rpc(_getpid)

    def close(self) -> None:
        from ...integrations.vllm.inspect import close_engine

        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.llm is not None:
            close_engine(self.llm)
            self.llm = None


def _getpid(worker) -> int:
    return os.getpid()


class EngineClient:
    """A :class:`RolloutEngine` actor as trainer rank 0's weight-sync client (vLLM's four calls plus
    pause, resume and gate, so the ``reshard`` backend pauses the engine around each refit).
    ``handle`` is an actor handle of :mod:`.orchestrate` (``handle.call(name, *args)`` gives a future)."""

    def __init__(self, handle, timeout_s: float) -> None:
        self.handle, self.timeout_s = handle, timeout_s
        self.gated: str | None = None

    def _call(self, name: str, *args, **kwargs):
        return self.handle.call(name, *args, **kwargs).result(self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def pause_generation(self, mode: str) -> None:
        self._call("pause_generation", mode)

    def resume_generation(self, *, clear_cache: bool = True) -> None:
        self.gated = None
        self._call("resume_generation", clear_cache)

    def gate(self, reason: str) -> None:
        self.gated = reason
        self._call("gate", reason)

    def reload(self, directory: str, version: str) -> None:
        self._call("reload", directory, version)


__all__ = ["VERSION0", "EngineClient", "RolloutEngine", "engine_env"]
