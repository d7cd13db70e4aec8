"""The rollout engine: a vLLM engine (``backend="reshard"``) as the RL loop's actor.

One object per engine, in its own process (a local actor or a Ray actor: :mod:`.orchestrate`).
The driver calls :meth:`RolloutEngine.generate`; trainer rank 0 calls the weight-sync methods
(vLLM's four, plus pausing) through :class:`EngineClient`, and :meth:`RolloutEngine.reload` for a
refit by checkpoint. Every completion comes back with the weight versions vLLM labelled its tokens
with. The engine times its own pause window: from the first call that stops serving (pause, start
of an update, a reload) to the last that restarts it (resume, finish, the reload's end).
"""

from __future__ import annotations

import os
import time
from typing import Any

VERSION0 = "0"  # the engine's weight version at start: the checkpoint both sides loaded


def engine_env(tp: int) -> dict[str, str]:
    """The environment a CPU vLLM engine of ``tp`` workers needs here (set before vLLM is imported):
    1 GiB of KV cache, workers bound to cores ``0..tp-1`` (modulo the cores there are), quiet logs,
    no hub, ``collective_rpc`` with functions (engine digests)."""
    cores = os.cpu_count() or 1
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "HF_HUB_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": "ERROR", "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(r % cores) for r in range(tp)),
            "TOKENIZERS_PARALLELISM": "false"}


class RolloutEngine:
    """An offline vLLM engine for rollouts and refits (see module doc)."""

    def __init__(self, path: str, tp: int, seed: int = 0, max_model_len: int = 128) -> None:
        os.environ.update(engine_env(tp))
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        from ...integrations.vllm.clients import as_client

        self.llm = LLM(model=path, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True, seed=seed,
                       max_model_len=max_model_len, enable_prefix_caching=False,
                       distributed_executor_backend="mp",  # also inside a Ray actor: its workers are our children
                       weight_transfer_config=WeightTransferConfig(backend="reshard"))
        self.client = as_client(self.llm)  # pausing and gating an offline LLM
        self.llm.update_weight_version(VERSION0)
        self._window: list[float | None] = [None, None]
        self._calls: dict[str, float] = {}

    # ------------------------------------------------------------------ rollouts

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, seeds: list[int]
                 ) -> list[list[dict[str, Any]]]:
        """``n`` completions of ``max_tokens`` tokens per prompt (token ids), prompt ``i`` sampled from
        ``seeds[i]`` (its completions from ``seeds[i] + 0 .. n - 1``): per completion its ``ids``, the
        engine's ``logprobs`` of them, and ``versions``, ``[(version, start, end)]`` spans."""
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(n=n, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                                 temperature=temperature, top_p=1.0, top_k=0, seed=seed, logprobs=0, detokenize=False)
                  for seed in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [[{"ids": list(c.token_ids),
                  "logprobs": [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)],
                  "versions": [(s.version, s.start, s.end) for s in (c.weight_versions or [])]}
                 for c in out.outputs] for out in outputs]

    def weight_version(self) -> str:
        return self.llm.get_weight_version()

    # ------------------------------------------------------------------ weight sync (trainer rank 0)

    def _stop(self) -> None:
        if self._window[0] is None:
            self._window = [time.perf_counter(), None]

    def _restart(self) -> None:
        self._window[1] = time.perf_counter()

    def _timed(self, name: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._calls[name] = self._calls.get(name, 0.0) + time.perf_counter() - start

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def pause_generation(self, mode: str) -> None:
        self._stop()
        self._timed("pause", self.client.pause_generation, mode)

    def start_weight_update(self) -> None:
        self._stop()
        self._timed("start", self.client.start_weight_update)

    def update_weights(self, update_info) -> None:
        self._timed("update", self.client.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._timed("finish", self.client.finish_weight_update, weight_version)
        self._restart()

    def resume_generation(self, clear_cache: bool = True) -> None:
        self._timed("resume", self.client.resume_generation, clear_cache=clear_cache)
        self._restart()

    def gate(self, reason: str) -> None:
        self.client.gate(reason)

    def reload(self, directory: str, version: str) -> None:
        """A refit by checkpoint: vLLM reloads every weight from the safetensors in ``directory``."""
        self._stop()
        self._timed("reload", self.llm.collective_rpc, "reload_weights", kwargs={"weights_path": directory})
        self.llm.update_weight_version(version)
        self._restart()

    def take_window(self) -> dict[str, Any] | None:
        """The last refit as the engine saw it (then forgotten): ``seconds`` it stopped serving, and the
        seconds of each call in that window (``pause``, ``start``, ``update``, ``finish``, ``resume``,
        ``reload``)."""
        (start, end), calls = self._window, self._calls
        self._window, self._calls = [None, None], {}
        return None if start is None or end is None else {"seconds": end - start, "calls": calls}

    # ------------------------------------------------------------------ inspection, shutdown

    def digests(self) -> list[str]:
        """One digest per worker of every tensor it computes with (packed weights included)."""
        from ...integrations.vllm.inspect import engine_digest

        return self.llm.collective_rpc(engine_digest)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        from ...integrations.vllm.inspect import close_engine

        if self.llm is not None:
            close_engine(self.llm)
            self.llm = None


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
