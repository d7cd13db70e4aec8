"""The ``reshard`` vLLM backend end to end, with real vLLM (``vllm-cpu``) engines and a real trainer.

The trainer is 2 gloo processes holding a Hugging Face model under FSDP2, trained with AdamW; its
rank 0 also owns the vLLM engine(s) (``LLM(..., weight_transfer_config=WeightTransferConfig(
backend="reshard"))``, found through the installed ``vllm.general_plugins`` entry point) and is the
weight-sync client. After real optimizer steps and one refit per step:

* every tensor each engine computes with (parameters and the weights vLLM's CPU backend packed)
  is bit-equal to a fresh engine loaded from a checkpoint saved from the trainer's weights, and
  greedy generations are equal;
* ``get_weight_version()`` is the version pushed; over five refits the plan is made once and
  replayed and memory does not grow;
* a trainer whose model does not match (another config, a missing tensor) fails at connect with an
  error naming the tensor, and the engine keeps serving its old weights at its old version;
* the baseline path (``gloo_broadcast``: full tensors from trainer rank 0 into ``load_weights``) into
  the same engines leaves every byte as the refits did.
* the ``hybrid`` method (FFN and experts by reshard, the rest by gather-and-broadcast, one session)
  writes every byte too (after a refit of zeros) and leaves the engines as the refits did.

Dense Qwen3 into one TP=2 engine; Qwen3-MoE into two TP=1 engines (``EngineGroup``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from launch import launch
from reshard.execution.process_group import free_port
from reshard.options import RefitOptions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HERE = os.path.dirname(os.path.abspath(__file__))


def _engine(path, tp):
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    return LLM(model=path, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True, max_model_len=128,
               enable_prefix_caching=False, weight_transfer_config=WeightTransferConfig(backend="reshard"))


def _generate(llm):
    from vllm import SamplingParams

    from vllm_helpers import PROMPTS

    return [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0),
                                                    use_tqdm=False)]


def _trainer(job, job_rank, rank, world, store_addr, ckpt, kind, engine_tps, out_dir):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from vllm_helpers import close_engine

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    engines: list = []
    try:
        _refits(job_rank, model, opt, engines, ckpt, kind, engine_tps, out_dir)
    finally:
        for e in engines:
            close_engine(e)


def _refits(job_rank, model, opt, engines, ckpt, kind, engine_tps, out_dir):
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard.integrations.vllm import BroadcastTrainerInitInfo, EngineGroup, ReshardSource, ReshardTrainerInitInfo
    from reshard.integrations.vllm.inspect import engine_digest
    from reshard.models import from_module
    from reshard.refit import RefitError, Side
    from vllm_helpers import refit_stats

    trainers, workers = 2, sum(engine_tps)
    ports, client = [0] * 5, None
    if job_rank == 0:
        for tp in engine_tps:
            engines.append(_engine(ckpt, tp))
        client = engines[0] if len(engines) == 1 else EngineGroup(engines)
        before = [_generate(e) for e in engines]
        old_versions = [e.get_weight_version() for e in engines]
        ports = [free_port() for _ in range(5)]
    dist.broadcast_object_list(ports, src=0)

    def info(port):
        return ReshardTrainerInitInfo(rank=job_rank, master_address="127.0.0.1", master_port=port,
                                      num_trainer_ranks=trainers, world_size=trainers + workers,
                                      engine_world_sizes=engine_tps,
                                      options=RefitOptions(timeout=120, max_bucket_bytes=1 << 20))

    # sides that do not match fail at connect, on every rank; the engines keep their weights and version
    wrong = AutoModelForCausalLM.from_pretrained(f"{out_dir}/wrong", dtype=torch.float32)
    without_norms = Side.from_module(model, job_rank, names=[s.name for s in from_module(model) if "norm" not in s.name])
    for source, message in ((ReshardSource(wrong), r"tensor 'model\.layers\.\d\.\S+': source shape \(\d+(, \d+)*\) "
                                                   r"!= destination shape"),
                            (ReshardSource(without_norms), r"unknown tensor 'model\.\S*norm\.weight': destination rank "
                                                           r"\d needs it but the source layout has no tensor")):
        with pytest.raises(RefitError, match=message):
            WeightTransferTrainerFactory.trainer_init(info(ports.pop()), client=client, source=source)
        if job_rank == 0:
            assert [_generate(e) for e in engines] == before
            assert [e.get_weight_version() for e in engines] == old_versions

    engine = WeightTransferTrainerFactory.trainer_init(info(ports.pop()), client=client, source=ReshardSource(model))
    stats = []
    for step in range(5):
        torch.manual_seed(100 + step)
        ids = torch.randint(0, 300, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        s = engine.send_weights(weight_version=f"step-{step}")
        assert s.sent_bytes > 0 and s.recv_bytes == 0
        if job_rank == 0:
            assert [e.get_weight_version() for e in engines] == [f"step-{step}"] * len(engines)
            stats.append([e.collective_rpc(refit_stats) for e in engines])
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    # the baseline path into the same engines (gather, broadcast, load_weights) ends in the same state
    if job_rank == 0:
        digests = [e.collective_rpc(engine_digest) for e in engines]
    baseline = WeightTransferTrainerFactory.trainer_init(
        BroadcastTrainerInitInfo(rank=job_rank, master_address="127.0.0.1", master_port=ports.pop(),
                                 engine_world_sizes=engine_tps, wire_dtype="bfloat16", timeout_s=120),
        client=client, source=model)
    assert baseline.send_weights(weight_version="broadcast")["recv_bytes"] > 0 or job_rank != 0
    baseline.shutdown()
    if job_rank == 0:
        assert [e.collective_rpc(engine_digest) for e in engines] == digests
        assert [e.get_weight_version() for e in engines] == ["broadcast"] * len(engines)
    # the hybrid method (FFN and experts by reshard, the rest by gather-and-broadcast) leaves the same bytes
    hybrid = info(ports.pop())
    engine.reconnect(replace(hybrid, options=hybrid.options.replace(method="hybrid")))
    assert engine.session.plan.reshard_tensors and engine.session.plan.broadcast_tensors
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    engine.send_weights(weight_version="zeros")  # so that the next refit must write every byte
    if job_rank == 0:
        assert [e.collective_rpc(engine_digest) for e in engines] != digests
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
    engine.send_weights(weight_version="hybrid")
    if job_rank == 0:
        assert [e.collective_rpc(engine_digest) for e in engines] == digests
        assert [e.get_weight_version() for e in engines] == ["hybrid"] * len(engines)
    engine.shutdown()
    if job_rank == 0:
        _compare_with_fresh_engine(engines, before, stats, full, kind, engine_tps, out_dir)


def _compare_with_fresh_engine(engines, before, stats, full, kind, engine_tps, out_dir):
    from vllm_helpers import close_engine, differences, engine_tensors, save_checkpoint

    # planned once, replayed; every byte through the refit, the CPU-repacked layers through vLLM's reload
    for per_engine in zip(*stats):
        for per_worker in zip(*per_engine):
            assert len({w["plan_id"] for w in per_worker}) == 1 and len({w["fingerprint"] for w in per_worker}) == 1
            assert per_worker[-1]["rss_mb"] - per_worker[0]["rss_mb"] < 32, per_worker
            assert per_worker[0]["reprocessed"] > 0 and per_worker[0]["in_place"] > 0
            assert per_worker[0]["in_place"] + per_worker[0]["reprocessed"] == per_worker[0]["recv"]
    got = [e.collective_rpc(engine_tensors) for e in engines]
    generated = [_generate(e) for e in engines]
    assert generated != before  # the refits changed what the engines compute
    for e in engines:
        close_engine(e)
    save_checkpoint(f"{out_dir}/fresh", kind, state=full)
    fresh = _engine(f"{out_dir}/fresh", engine_tps[0])
    try:
        want, want_text = fresh.collective_rpc(engine_tensors), _generate(fresh)
    finally:
        close_engine(fresh)
    for i, per_worker in enumerate(got):
        assert len(per_worker) == len(want)
        for w, (a, b) in enumerate(zip(per_worker, want)):
            bad = differences(a, b)
            assert not bad, (i, w, bad[:8])
        assert generated[i] == want_text


@pytest.mark.parametrize("kind, engine_tps", [("dense", [2]), ("moe", [1, 1])], ids=["dense-tp2", "moe-2xtp1"])
def test_refit_live_vllm_engines_from_fsdp2_trainer(tmp_path, kind, engine_tps):
    pytest.importorskip("vllm")
    from vllm_helpers import reap_engine_processes, save_checkpoint

    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", HF_HUB_OFFLINE="1",
                      VLLM_LOGGING_LEVEL="WARNING", VLLM_CPU_OMP_THREADS_BIND="0|1" if 2 in engine_tps else "0",
                      PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(ckpt, kind, dtype=torch.float32)
    save_checkpoint(str(tmp_path / "wrong"), kind, dtype=torch.float32,
                    **({"moe_intermediate_size": 16} if kind == "moe" else {"intermediate_size": 96}))
    with reap_engine_processes():
        launch(_trainer, [2], ckpt, kind, engine_tps, str(tmp_path))


def _http_trainer(job, job_rank, rank, world, store_addr, ckpt, url, out_dir):
    import requests
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from reshard.integrations.vllm import ReshardSource, ReshardTrainerInitInfo
    from vllm_helpers import PROMPTS

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    port = [free_port() if job_rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    info = ReshardTrainerInitInfo(rank=job_rank, master_address="127.0.0.1", master_port=port[0], num_trainer_ranks=2,
                                  world_size=4, options=RefitOptions(timeout=120))
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(url),
                                                       source=ReshardSource(model))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(7))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    engine.send_weights(weight_version="http-1")
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    engine.shutdown()
    if job_rank == 0:
        assert requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"] == "http-1"
        checksums = requests.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=60).json()["checksums"]
        texts = [requests.post(f"{url}/v1/completions", json={"model": ckpt, "prompt": p, "max_tokens": 12,
                                                               "temperature": 0}, timeout=60).json()["choices"][0]["text"]
                 for p in PROMPTS]
        torch.save({"full": full, "checksums": checksums, "texts": texts}, f"{out_dir}/http.pt")


def test_refit_through_vllm_http_server(tmp_path):
    """``vllm serve --weight-transfer-config '{"backend": "reshard"}'`` driven by vLLM's own HTTP client: the
    refitted server's weight checksums and greedy completions equal a fresh engine's on the same weights."""
    pytest.importorskip("vllm")
    import json
    import subprocess
    import time

    import requests

    from vllm_helpers import close_engine, reap_engine_processes, save_checkpoint

    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1",
               VLLM_LOGGING_LEVEL="WARNING", VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
               PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    os.environ.update({k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ALLOW_INSECURE_SERIALIZATION",
                                           "HF_HUB_OFFLINE", "VLLM_CPU_OMP_THREADS_BIND", "PYTHONPATH")})
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(ckpt, "dense", dtype=torch.float32)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with reap_engine_processes():
        # `vllm serve` itself asks for the version of a package named vllm (this one is vllm-cpu): run its module
        server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt,
                                   "--port", str(port), "--tensor-parallel-size", "2",
                                   "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "128",
                                   "--no-enable-prefix-caching",
                                   "--weight-transfer-config", json.dumps({"backend": "reshard"})],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 240
            while True:
                assert server.poll() is None, f"vllm serve exited: {server.stderr.read()[-3000:]}"
                try:
                    if requests.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except requests.ConnectionError:
                    pass
                assert time.monotonic() < deadline, "vllm serve did not become healthy within 240 s"
                time.sleep(1)
            launch(_http_trainer, [2], ckpt, url, str(tmp_path))
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
        got = torch.load(str(tmp_path / "http.pt"))
        save_checkpoint(str(tmp_path / "fresh"), "dense", state=got["full"])
        fresh = _engine(str(tmp_path / "fresh"), 2)
        try:
            want = {}
            for per_worker in fresh.collective_rpc("compute_weight_checksums"):
                want.update(per_worker)
            texts = _generate(fresh)
        finally:
            close_engine(fresh)
    assert got["checksums"] == want and got["texts"] == texts
