"""Pipelined vs sequential phases of a hierarchical refit, measured side by side in one run.

Run from the repository root::

    python benchmarks/bench_pipelined.py [--layers 1] [--repeat 5] [--chunks 4,8] [--buckets-mb 4,1]

FSDP over 2 training ranks into 2 data-parallel TP2 engines (6 processes, CPU, gloo), with pretend
NVLink domains: the training ranks in one, each engine in its own. Each engine needs the whole
model, so the hierarchical plan brings every byte into each engine's domain once (network phase)
and forwards it inside the domain (NVLink forward phase). For every staging cap ``B`` it runs,
interleaved (one of each per repeat, in rotating order, since the machine is noisy):

    sequential        network phase, then NVLink forward          (HierarchicalPlan, chunks=1)
    pipelined C       step s: network of chunk s beside the forward of chunk s-1 (.pipelined(C))

Same plan, same copies, same bytes: every destination byte is verified after every run. Times are
the slowest rank's wall time of one ``run``, median over the repeats (best in brackets); ratios are
sequential / pipelined (> 1: pipelined is faster). Here every "link" is gloo over loopback on the
same few cores, so the NVLink forward does not get links of its own as it does on a GPU: this
measures the executor's cost of the pipelined order, not the GPU's gain (that is modeled:
``reshard simulate``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

import reshard as rs
from reshard import verify
from reshard.apps.bench_support import print_header, print_table, spawn_for_json, timed_runs
from reshard.frameworks.parallel import InferParallel, TrainParallel, model_layouts
from reshard.models import DEMO_MODEL, get_arch
from reshard.planning.hierarchy import hierarchical_plan

MiB = 1 << 20
TRAIN, INFER = str(TrainParallel("fsdp", dp=2)), str(InferParallel("dtensor", tp=2, dp=2))
DOMAINS = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}  # training ranks, engine 0, engine 1


def _layouts(layers: int):
    return model_layouts(get_arch(DEMO_MODEL).with_overrides(layers=layers), TRAIN, INFER)


def _worker(rank: int, world: int, path: str, layers: int, buckets: list[int], chunks: list[int], repeat: int):
    lay = _layouts(layers)
    src = verify.fill_source(lay.source, rank) if rank in lay.source_ranks else {}
    dst = lay.destination.empty_buffers(rank)
    runs = {}  # (bucket, variant) -> executor
    for b in buckets:
        h = hierarchical_plan(lay.source, lay.destination, DOMAINS, max_bucket_bytes=b)
        runs[(b, "sequential")] = rs.ReshardExecutor(h)
        for c in chunks:
            runs[(b, f"pipelined {c}")] = rs.ReshardExecutor(h.pipelined(c))
    res = timed_runs(runs, lay, rank, src, dst, repeat)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"model_bytes": sum(s.nbytes for s in lay.specs), "world": world,
                       "runs": [[b, v, *res[(b, v)]] for b, v in runs]}, f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1, help="decoder layers of the demo model (default 1)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per variant, interleaved; the median is reported")
    ap.add_argument("--chunks", default="4,8", help="chunk counts of the pipelined order (default %(default)s)")
    ap.add_argument("--buckets-mb", default="4,1", help="staging caps B in MiB (default %(default)s)")
    args = ap.parse_args(argv)
    buckets = [int(float(x) * MiB) for x in args.buckets_mb.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    console = Console(width=max(Console().width, 160))
    print_header(console, "benchmarks/bench_pipelined.py", argv)
    start = time.perf_counter()
    lay = _layouts(args.layers)
    with console.status("running ..."):
        res = spawn_for_json(_worker, lay.world_size, args.layers, buckets, chunks, args.repeat)
    console.print(f"  {TRAIN} -> {INFER}, domains {DOMAINS}: {res['world']} processes, "
                  f"{res['model_bytes'] / 1e9:.2f} GB model (verified after every run)")
    variants = ["sequential"] + [f"pipelined {c}" for c in chunks]
    t = Table(title=f"pipelined vs sequential phases (hierarchical, pretend domains): Qwen3-0.6B-like, "
                    f"{args.layers} layers; median of {args.repeat} interleaved runs [best]")
    for c in ["cap B", "variant", "steps / rounds", "s", "seq / this", "staging MiB", "bytes sent"]:
        t.add_column(c, justify="left" if c == "variant" else "right", no_wrap=True)
    by = {(b, v): (ts, peak, rounds, sent) for b, v, ts, peak, rounds, sent in res["runs"]}
    for b in buckets:
        seq = statistics.median(by[(b, "sequential")][0])
        for v in variants:
            ts, peak, rounds, sent = by[(b, v)]
            med = statistics.median(ts)
            t.add_row(f"{b / MiB:g} MiB", v, str(rounds), f"{med:.3f} [{min(ts):.3f}]", f"{seq / med:.2f}x",
                      f"{peak / MiB:.2f}", f"{sent:,}")
    print_table(console, t, "s: slowest rank's wall time of one run; seq / this > 1: pipelined faster; steps / "
                "rounds: the most rounds (sub-rounds) a rank runs; staging: RunStats.peak_staging_bytes, largest "
                "rank; bytes sent: all ranks (the same in every variant)", start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
