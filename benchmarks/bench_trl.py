"""TRL GRPO on a live vLLM server, its refit by reshard and by gather-and-broadcast, side by side in one run.

Run from the repository root (``make bench-trl`` does)::

    python benchmarks/bench_trl.py [--steps 5] [--trainer fsdp2|zero3] [--hidden 768] [--layers 6]

One ``vllm serve`` (TP=2, bf16, ``--weight-transfer-config '{"backend": "reshard"}'``) serves a
random Qwen3-shaped model of tens of millions of parameters. The same GRPO run (2 trainer
processes, FSDP2 or DeepSpeed ZeRO-3 through accelerate, fp32, ``ReshardGRPOTrainer`` in server mode, generation
through TRL's VLLMClient) is made twice into that server, from the same checkpoint and seed:

* ``reshard``: TRL's sync is reshard's refit: every trainer rank sends its own shards (FSDP2
  DTensor shards, or ZeRO-3 ``ds_tensor`` chunks), each
  vLLM worker receives only its TP shards (in place, or through vLLM's layerwise reload);
* ``gather-broadcast``: the path TRL takes (vLLM's ``nccl`` backend: every trainer rank gathers each
  full tensor, rank 0 broadcasts buckets of 1 GiB in bf16 to every worker, which loads them with
  ``load_weights``), with gloo standing in for NCCL (:mod:`reshard.integrations.vllm.broadcast`),
  into the same server.

TRL's own sync (``GRPOTrainer`` in server mode) is tried first: on a CPU it cannot start (its NCCL
communicator needs CUDA); its error is printed.

Per GRPO step, all measured on trainer rank 0 (the sync of step k+1 sends step k's weights): sync s
(TRL's ``sync_weights`` call), step s (the whole step: sync, generation, scoring, forward, backward,
optimizer), MiB/worker (bytes each vLLM worker received in that sync, read from the workers), peak
MiB (the largest trainer rank's resident-memory peak in the step, VmHWM reset at its start). The
first step includes the connect (layout exchange, plan) and is reported apart from the medians. The
machine is shared and noisy: ratios of medians are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUN_TIMEOUT = 900
METHODS = ("reshard", "gather-broadcast")


class BenchProbe:
    """Worker extension of the benchmark's server: what the worker received in its last refit."""

    def bench_recv_bytes(self) -> int:
        stats = getattr(self.weight_transfer_engine, "last_stats", None)
        if isinstance(stats, dict):
            return int(stats.get("recv_bytes", 0))
        return int(getattr(stats, "recv_bytes", 0) or 0)


def _env(**extra) -> dict:
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1",
                VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=os.pathsep.join([HERE, os.path.join(ROOT, "src")] + sys.path), **extra)


def _config(out: str, url: str, port: int, steps: int, **extra):
    from trl import GRPOConfig

    extra = {"use_cpu": True, **extra}
    return GRPOConfig(output_dir=out, bf16=False, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=16, max_steps=steps, learning_rate=1e-3, logging_steps=1, report_to=[],
                      save_strategy="no", dataloader_num_workers=0, seed=0, use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=url, vllm_group_port=port, vllm_max_model_length=256, **extra)


def _prompts():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["hello world", "the quick brown fox", "jumps over", "the lazy dog"] * 16})


def _reward(completions, **kwargs):
    return [len(c) / 10.0 for c in completions]


def _fsdp2_on_cpu(trainer) -> None:
    """accelerate 1.15 turns FSDP on only for accelerator devices; on a CPU switch its state to FSDP2 after
    the trainer is built (accelerate's own fsdp2_prepare_model then shards the model)."""
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
    """GRPOConfig arguments of a ZeRO-3 run on a CPU: transformers starts accelerate's DeepSpeed state without a
    backend when there is no GPU (it then counts one process while DeepSpeed runs two), so make it with gloo."""
    from accelerate.state import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return {"use_cpu": False, "deepspeed": ZERO3, "ddp_backend": "gloo",
            "accelerator_config": {"use_configured_state": True}}


def trl_own_sync(url: str, ckpt: str, port: int) -> None:
    """TRL's own GRPOTrainer in server mode, one process: print how its sync fails on this machine."""
    from trl import GRPOTrainer

    try:
        GRPOTrainer(model=ckpt, reward_funcs=_reward, args=_config(tempfile.mkdtemp(), url, port, 1),
                    train_dataset=_prompts())
        print("TRL-OWN ok: TRL's own sync started", flush=True)
    except Exception as error:  # noqa: BLE001 - the point: print it
        print(f"TRL-OWN {type(error).__name__}: {error}", flush=True)


def rank_run(spec: dict) -> None:
    """One trainer rank of one GRPO run (under torchrun)."""
    import torch.distributed as dist
    from transformers import TrainerCallback
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from reshard.integrations.trl import ReshardGRPOTrainer
    from reshard.integrations.vllm import BroadcastTrainerInitInfo
    from reshard.integrations.vllm.inspect import memory
    from reshard.options import RefitOptions

    rank = int(os.environ["RANK"])
    zero3 = spec["trainer"] == "zero3"
    trainer = ReshardGRPOTrainer(model=spec["ckpt"], reward_funcs=_reward, train_dataset=_prompts(),
                                 args=_config(spec["out"], spec["url"], spec["port"], spec["steps"],
                                              **(_zero3_on_cpu() if zero3 else {})),
                                 refit_options=RefitOptions(timeout=300), master_address="127.0.0.1")
    if not zero3:
        _fsdp2_on_cpu(trainer)
    gen = trainer.vllm_generation
    if spec["method"] == "gather-broadcast":
        def connect_broadcast() -> None:  # the same server, through its gather-and-broadcast path
            address, port, world = gen._store()
            info = BroadcastTrainerInitInfo(rank=rank, master_address=address, master_port=port,
                                            engine_world_sizes=[world], wire_dtype="bfloat16", timeout_s=300)
            client = HTTPVLLMWeightSyncClient(gen.vllm_client.base_url) if rank == 0 else None
            gen._engine = WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                                    source=gen._trainer_model())
        gen._connect_server = connect_broadcast
    received: list = []
    refit = gen.sync_weights

    def sync_and_read() -> None:
        refit()
        if rank == 0:
            received.append(gen.vllm_client._post(f"{spec['url']}/collective_rpc",
                                                  json={"method": "bench_recv_bytes"})["results"])

    gen.sync_weights = sync_and_read
    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            memory(reset_peak=True)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            steps.append({"step_s": time.perf_counter() - self.t0, "peak_mb": memory()["peak_mb"]})

    trainer.add_callback(Timer())
    trainer.train()
    trainer.close_refit()
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, [s["peak_mb"] for s in steps])
    if rank == 0:
        rows = [{"step": i + 1, "sync_s": sync.seconds, "step_s": s["step_s"],
                 "recv_mib": [float(b) / 2**20 for b in recv],
                 "peak_mb": max(p[i] for p in peaks), "sent_bytes": sync.sent_bytes}
                for i, (s, sync, recv) in enumerate(zip(steps, trainer.syncs, received))]
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        with open(spec["result"], "w") as f:
            json.dump({"rows": rows, "losses": losses}, f)


def _start_server(ckpt: str, port: int) -> subprocess.Popen:
    import requests

    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt,
                             "--port", str(port), "--tensor-parallel-size", "2", "--dtype", "bfloat16",
                             "--enforce-eager", "--max-model-len", "256", "--logprobs-mode", "processed_logprobs",
                             "--worker-extension-cls", "bench_trl.BenchProbe",
                             "--weight-transfer-config", json.dumps({"backend": "reshard"})],
                            env=_env(VLLM_CPU_OMP_THREADS_BIND="0|1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited: {proc.stderr.read()[-8000:]}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("vllm serve was not healthy within 600 s")
        time.sleep(1)


def _run(args: list[str], timeout: float) -> str:
    proc = subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise RuntimeError(f"{args[3:5]} did not end within {timeout} s:\n{out[-3000:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"{args[3:5]} failed:\n{out[-6000:]}")
    return out


def main(argv: list[str] | None = None) -> None:
    from reshard.apps.toy_models import save_checkpoint
    from reshard.execution.process_group import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--trainer", choices=("fsdp2", "zero3"), default="fsdp2",
                        help="how accelerate shards the trainer: FSDP2, or DeepSpeed ZeRO-3")
    parser.add_argument("--kv-heads", type=int, default=4, help="a multiple of 2 (the engine is TP=2)")
    opts = parser.parse_args(argv)
    print("$ python benchmarks/bench_trl.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    import platform

    import trl
    import vllm

    print(f"machine: {os.cpu_count()} CPUs, {platform.machine()}, torch {torch.__version__}, trl {trl.__version__}, "
          f"vllm {vllm.__version__}, gloo over loopback")
    work = tempfile.mkdtemp(prefix="bench-trl-")
    ckpt = os.path.join(work, "ckpt")
    save_checkpoint(ckpt, "dense", dtype=torch.float32, hidden_size=opts.hidden, num_hidden_layers=opts.layers,
                    intermediate_size=opts.intermediate, num_attention_heads=opts.hidden // 64,
                    num_key_value_heads=opts.kv_heads, head_dim=64)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt)).parameters())
    print(f"model: Qwen3-shaped, hidden {opts.hidden}, {opts.layers} layers, intermediate {opts.intermediate}: "
          f"{params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MiB fp32 on the trainer, "
          f"{params * 2 / 2**20:.0f} MiB bf16 in the engine); 2 {opts.trainer.upper()} trainer ranks -> "
          "vllm serve TP=2")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _start_server(ckpt, port)
    results = {}
    try:
        own = _run([sys.executable, __file__, "--trl-own", json.dumps({"url": url, "ckpt": ckpt,
                                                                        "port": free_port()})], 300)
        line = next((line for line in own.splitlines() if line.startswith("TRL-OWN ")), "TRL-OWN (no answer)")
        print(f"TRL's own sync (GRPOTrainer, server mode): {line.removeprefix('TRL-OWN ')}")
        for method in METHODS:
            result = os.path.join(work, f"{method}.json")
            spec = {"method": method, "trainer": opts.trainer, "ckpt": ckpt, "url": url, "port": free_port(), "steps": opts.steps,
                    "out": os.path.join(work, method), "result": result}
            _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                  __file__, "--rank-run", json.dumps(spec)], RUN_TIMEOUT)
            with open(result) as f:
                results[method] = json.load(f)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    _report(results)


def _report(results: dict) -> None:
    print("\nper GRPO step (measured; trainer rank 0; step 1 includes the connect):")
    print(f"{'method':<18}{'step':>5}{'sync s':>9}{'step s':>9}{'MiB/worker':>18}{'peak MiB':>10}")
    for method, result in results.items():
        for row in result["rows"]:
            recv = "/".join(f"{m:.1f}" for m in row["recv_mib"])
            print(f"{method:<18}{row['step']:>5}{row['sync_s']:>9.3f}{row['step_s']:>9.3f}{recv:>18}"
                  f"{row['peak_mb']:>10.0f}")
    print("\nmedians over steps 2.. (measured):")
    med = {}
    for method, result in results.items():
        rows = result["rows"][1:] or result["rows"]
        med[method] = {key: statistics.median(r[key] for r in rows) for key in ("sync_s", "step_s", "peak_mb")}
        med[method]["recv"] = statistics.median(sum(r["recv_mib"]) / len(r["recv_mib"]) for r in rows)
        print(f"{method:<18} sync {med[method]['sync_s']:.3f} s  step {med[method]['step_s']:.3f} s  "
              f"{med[method]['recv']:.1f} MiB/worker  peak {med[method]['peak_mb']:.0f} MiB  "
              f"losses {['%.3g' % v for v in result['losses']]}")
    a, b = med["gather-broadcast"], med["reshard"]
    print(f"\nratios gather-broadcast / reshard (measured): sync {a['sync_s'] / b['sync_s']:.2f}x, "
          f"step {a['step_s'] / b['step_s']:.2f}x, bytes per worker {a['recv'] / b['recv']:.2f}x, "
          f"trainer peak memory {a['peak_mb'] / b['peak_mb']:.2f}x")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-run":
        rank_run(json.loads(sys.argv[2]))
    elif len(sys.argv) > 2 and sys.argv[1] == "--trl-own":
        spec = json.loads(sys.argv[2])
        trl_own_sync(spec["url"], spec["ckpt"], spec["port"])
    else:
        main()
