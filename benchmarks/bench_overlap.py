"""Overlapped vs sequential rounds in the reshard executor, measured side by side in one run.

Run from the repository root::

    python benchmarks/bench_overlap.py [--layers 1] [--repeat 5] [--configs 2c-2:1x2,2-2:2x1,2-2:1x2]
                                       [--buckets-mb 16,1,0.25]

One process group per configuration (CPU, gloo, as ``reshard demo`` does; ``2c-2`` = the
inference ranks are the training ranks). For every staging cap ``B`` it runs three variants,
interleaved (one of each per repeat, in rotating order, since the machine is noisy):

    sequential B    pack, wait, unpack each round in turn        staging <= B (+ one copy)
    overlap B       pack j+1 / unpack j-1 while j is on the wire  staging <= 2 B
    overlap B/2     the same, planned with half the cap          staging <= B: equal memory

Times are the slowest rank's wall time of one ``run``, median over the repeats (best in
brackets); ratios are sequential / overlapped (> 1: overlap is faster). Every destination byte
is verified after every run. Staging is ``RunStats.peak_staging_bytes``, largest over ranks.
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

MiB = 1 << 20
VARIANTS = ("sequential B", "overlap B", "overlap B/2")


def parse_config(item: str) -> tuple[str, str, bool]:
    """``"2c-2:2x1"`` -> (train, infer, colocated)."""
    pair, grid = item.split(":")
    m, n = pair.split("-")
    colocate = m.endswith("c")
    m, n = int(m.rstrip("c")), int(n)
    tp, dp = (int(x) for x in grid.split("x"))
    if tp * dp != n:
        raise SystemExit(f"config {item!r}: tp x dp = {tp * dp} != N = {n}")
    return str(TrainParallel("fsdp", dp=m)), str(InferParallel("dtensor", tp=tp, dp=dp)), colocate


def _worker(rank: int, world: int, path: str, item: str, layers: int, buckets: list[int], repeat: int) -> None:
    train, infer, colocate = parse_config(item)
    lay = model_layouts(get_arch(DEMO_MODEL).with_overrides(layers=layers), train, infer, colocate=colocate)
    src = verify.fill_source(lay.source, rank) if rank in lay.source_ranks else {}
    dst = lay.destination.empty_buffers(rank)
    runs = {}  # (bucket, variant) -> executor
    for b in buckets:
        for v in VARIANTS:
            cap = b // 2 if v.endswith("B/2") else b
            plan = rs.plan(lay.source, lay.destination, max_bucket_bytes=cap)
            runs[(b, v)] = rs.ReshardExecutor(plan, overlap=v.startswith("overlap"))
    res = timed_runs(runs, lay, rank, src, dst, repeat)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"model_bytes": sum(s.nbytes for s in lay.specs), "world": world,
                       "runs": [[b, v, *res[(b, v)]] for b, v in runs]}, f)


def run_config(item: str, args, buckets: list[int]) -> dict:
    train, infer, colocate = parse_config(item)
    lay = model_layouts(get_arch(DEMO_MODEL).with_overrides(layers=args.layers), train, infer, colocate=colocate)
    return spawn_for_json(_worker, lay.world_size, item, args.layers, buckets, args.repeat)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1, help="decoder layers of the demo model (default 1)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per variant, interleaved; the median is reported")
    ap.add_argument("--configs", default="2c-2:1x2,2-2:2x1,2-2:1x2",
                    help="comma-separated M-N:TPxDP (Mc: colocated) configurations (default %(default)s)")
    ap.add_argument("--buckets-mb", default="16,1,0.25", help="staging caps B in MiB (default %(default)s)")
    args = ap.parse_args(argv)
    buckets = [int(float(x) * MiB) for x in args.buckets_mb.split(",")]
    console = Console(width=max(Console().width, 160))
    print_header(console, "benchmarks/bench_overlap.py", argv)
    start = time.perf_counter()
    t = Table(title=f"overlapped vs sequential rounds: Qwen3-0.6B-like, {args.layers} layers; median of "
                    f"{args.repeat} interleaved runs [best]")
    cols = ["config", "cap B", "rounds B / B/2", "sequential B s", "overlap B s", "seq / ovl", "overlap B/2 s",
            "seq / ovl B/2", "staging seq / ovl / ovl B/2"]
    for c in cols:
        t.add_column(c, justify="left" if c == "config" else "right", no_wrap=True)
    for item in args.configs.split(","):
        with console.status(f"{item} ..."):
            t0 = time.perf_counter()
            res = run_config(item, args, buckets)
        console.print(f"  {item}: {res['world']} processes, {res['model_bytes'] / 1e9:.2f} GB model, "
                      f"done in {time.perf_counter() - t0:.0f} s (verified)")
        by = {(b, v): (ts, peak, rounds) for b, v, ts, peak, rounds, _sent in res["runs"]}
        for b in buckets:
            med = {v: statistics.median(by[(b, v)][0]) for v in VARIANTS}
            best = {v: min(by[(b, v)][0]) for v in VARIANTS}
            s = {v: f"{med[v]:.3f} [{best[v]:.3f}]" for v in VARIANTS}
            t.add_row(item, f"{b / MiB:g} MiB", f"{by[(b, VARIANTS[1])][2]} / {by[(b, VARIANTS[2])][2]}",
                      s[VARIANTS[0]], s[VARIANTS[1]], f"{med[VARIANTS[0]] / med[VARIANTS[1]]:.2f}x",
                      s[VARIANTS[2]], f"{med[VARIANTS[0]] / med[VARIANTS[2]]:.2f}x",
                      " / ".join(f"{by[(b, v)][1] / MiB:.2f}" for v in VARIANTS) + " MiB")
    print_table(console, t, "s: slowest rank's wall time of one run; seq / ovl > 1: overlap faster; staging: "
                "RunStats.peak_staging_bytes, largest rank (overlap B/2 has the sequential run's memory)", start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
