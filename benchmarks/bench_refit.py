"""Reshard vs gather-and-broadcast on the demo model, for several (M, N) pairs; planner throughput.

Run from the repository root (``make bench`` does)::

    python benchmarks/bench_refit.py [--layers 14] [--repeat 3] [--configs 2-2:2x1,4-4:4x1]

Section 1 spawns one process group per configuration (CPU, gloo, as ``reshard demo``
does) and runs both executors ``--repeat`` times on the same data, verifying every
destination byte after each method. Times are the slowest rank's, best of the repeats.
The minimum wire bytes are computed here, independently of the planner: for every
destination rank and tensor, the elements it needs that it does not already hold as
a source, times the destination itemsize.

Section 2 runs no processes: it builds bigger layouts of the same model (64 -> 64,
128 -> 128 ranks, more layers) and times ``rs.plan`` and one rank's ``plan.for_rank``.

Targets (issue 2): wire bytes exactly the minimum; reshard >= 2x faster than
gather-and-broadcast at 4 -> 4 (TP=4); peak staging per rank <= max_bucket_bytes
plus one copy per round in flight (the executor overlaps two rounds, each scheduled under half
the cap); planner >= 1 M pieces per second.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import reshard as rs
from reshard.apps.bench_support import parse_configs, print_header, spawn_for_json  # noqa: F401 (bench_cost: from here)
from reshard.apps.demo import DemoConfig, failures, run_demo
from reshard.execution.methods import GATHER_BROADCAST, RESHARD
from reshard.frameworks.parallel import model_layouts
from reshard.models import DEMO_MODEL, get_arch

MiB = 1 << 20
# name: (sources M, tp, dp)
DEFAULT_CONFIGS = "2-2:2x1,4-4:4x1,4-4:2x2,2-4:4x1,4-2:2x1"
PLANNER_CASES = [  # (M, tp, dp, layers)
    (4, 2, 2, 28), (64, 8, 8, 28), (128, 8, 16, 28), (128, 8, 16, 280),
]


# ------------------------------------------------------------------ minimum wire bytes
def _union_volume(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], minus: list) -> int:
    """Elements in the union of ``boxes`` and not in the union of ``minus`` (grid of all edges)."""
    boxes = sorted(set(boxes))
    if not boxes:
        return 0
    minus = sorted(set(minus))
    if len(boxes) == 1 and not minus:
        return int(np.prod(boxes[0][1]))
    nd = len(boxes[0][0])
    edges = [sorted({o[d] for o, _ in boxes + minus} | {o[d] + s[d] for o, s in boxes + minus}) for d in range(nd)]
    total = 0
    for cell in itertools.product(*(range(len(e) - 1) for e in edges)):
        lo = [edges[d][c] for d, c in enumerate(cell)]
        hi = [edges[d][c + 1] for d, c in enumerate(cell)]

        def covers(b):
            return all(b[0][d] <= lo[d] and hi[d] <= b[0][d] + b[1][d] for d in range(nd))

        if any(covers(b) for b in boxes) and not any(covers(b) for b in minus):
            total += int(np.prod([h - l for l, h in zip(lo, hi)]))
    return total


def minimum_wire_bytes(source: rs.Layout, destination: rs.Layout) -> int:
    """Bytes that must cross between ranks: per destination rank and tensor, the elements it
    needs and does not hold as a source, times the destination buffer's itemsize."""
    total = 0
    for r in destination.ranks:
        need: dict[str, list] = {}
        size: dict[str, int] = {}
        for p in destination.pieces(r):
            need.setdefault(p.tensor, []).append((p.offsets, p.sizes))
            size[p.tensor] = torch.empty((), dtype=destination.buffer_spec(r, p.buffer)[1]).element_size()
        have: dict[str, list] = {}
        for p in source.pieces(r) if r in source.ranks else []:
            have.setdefault(p.tensor, []).append((p.offsets, p.sizes))
        for name, boxes in need.items():
            total += _union_volume(boxes, have.get(name, [])) * size[name]
    return total


# ------------------------------------------------------------------ section 1
def run_configs(args, console: Console) -> Table:
    model = get_arch(DEMO_MODEL).with_overrides(layers=args.layers)
    bucket = int(args.max_bucket_mb * MiB) or None
    t = Table(title=f"reshard vs gather-and-broadcast: Qwen3-0.6B-like, {args.layers} layers, "
                    f"{model.num_params / 1e9:.3f} B params, {model.nbytes / 1e9:.2f} GB bf16; "
                    f"best of {args.repeat}; staging cap {args.max_bucket_mb:g} MiB")
    cols = ["config", "reshard s", "g&b s", "speedup", "wire GB reshard / g&b", "wire ratio", "min wire GB",
            "reshard = min", "staging/rank (bound)", "planner"]
    for c in cols:
        t.add_column(c, justify="left" if c == "config" else "right", no_wrap=True)
    for train, infer in parse_configs(args.configs):
        label = f"{train.world}->{infer.world} tp{infer.tp}" + (f"xdp{infer.dp}" if infer.dp > 1 else "")
        cfg = DemoConfig(model=DEMO_MODEL, arch_overrides=(("layers", args.layers),), train=str(train),
                         infer=str(infer), max_bucket_bytes=bucket, repeat=args.repeat, progress=False)
        lay = model_layouts(model, train, infer)
        minimum = minimum_wire_bytes(lay.source, lay.destination)
        start = time.perf_counter()
        with console.status(f"{label}: {lay.world_size} processes ..."):
            res = run_demo(cfg)
        bad = failures(res)
        if bad:
            console.print(f"[bold red]{label}: VERIFICATION FAILED[/]")
            for line in bad[:20]:
                console.print(f"  {line}")
            raise SystemExit(1)
        r, g, p = res["methods"][RESHARD], res["methods"][GATHER_BROADCAST], res["plan"]
        bound = (bucket or 0) + 2 * p["largest_copy_bytes"]  # two rounds in flight, each under half the cap
        console.print(f"  {label}: done in {time.perf_counter() - start:.1f} s (verified)")
        equal = "yes" if r["wire_bytes"] == minimum else f"NO ({r['wire_bytes'] - minimum:+,d} B)"
        staging = f"{r['peak_staging_bytes'] / MiB:.1f} MiB"
        if bucket:
            staging += f" {'<=' if r['peak_staging_bytes'] <= bound else '>'} {bound / MiB:.1f}"
        t.add_row(
            label, f"{r['best_s']:.2f}", f"{g['best_s']:.2f}", f"{g['best_s'] / r['best_s']:.2f}x",
            f"{r['wire_bytes'] / 1e9:.3f} / {g['wire_bytes'] / 1e9:.3f}", f"{g['wire_bytes'] / r['wire_bytes']:.2f}x",
            f"{minimum / 1e9:.3f}", equal, staging,
            f"{p['planner_s'] * 1e3:.0f} ms, {p['pieces'] / p['planner_s'] / 1e3:.0f} k pieces/s",
        )
    t.caption = ("s: wall time of the slowest rank, best of the repeats; wire: bytes sent between ranks; "
                 "bound: max_bucket_bytes + the largest single copy of each of the two rounds in flight; planner: rs.plan on each rank, slowest, "
                 "while all ranks plan at once on the shared cores")
    t.caption_justify = "left"
    return t


# ------------------------------------------------------------------ section 2
def run_planner(console: Console, bucket: int | None) -> Table:
    t = Table(title="planner throughput (no processes; rs.plan on fresh layouts, cold)")
    for c in ["layout", "tensors", "pieces", "build layouts s", "rs.plan s", "pieces/s", "warm rs.plan s",
              "for_rank(src) s", "for_rank(dst) s", "wire GB"]:
        t.add_column(c, justify="left" if c == "layout" else "right", no_wrap=True)
    for m, tp, dp, layers in PLANNER_CASES:
        model = get_arch(DEMO_MODEL).with_overrides(layers=layers)
        label = f"{m}->{tp * dp} tp{tp}xdp{dp}, {layers} layers"
        with console.status(f"planning {label} ..."):
            t0 = time.perf_counter()
            lay = model_layouts(model, f"fsdp:dp{m}", f"dtensor:tp{tp},dp{dp}")
            t1 = time.perf_counter()
            plan = rs.plan(lay.source, lay.destination, max_bucket_bytes=bucket)
            t2 = time.perf_counter()
            rs.plan(lay.source, lay.destination, max_bucket_bytes=bucket)
            t3 = time.perf_counter()
            plan.for_rank(lay.source_ranks[0])
            t4 = time.perf_counter()
            plan.for_rank(lay.destination_ranks[0])
            t5 = time.perf_counter()
        t.add_row(label, str(len(plan.tensors)), f"{plan.num_pieces:,}", f"{t1 - t0:.2f}", f"{t2 - t1:.3f}",
                  f"{plan.num_pieces / (t2 - t1) / 1e6:.2f} M", f"{t3 - t2:.3f}", f"{t4 - t3:.3f}", f"{t5 - t4:.3f}",
                  f"{plan.wire_bytes / 1e9:.1f}")
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=14,
                    help="decoder layers of the demo model (default 14: 0.53 B params, 1.06 GB bf16)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per method and config; the best is reported")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="comma-separated M-N:TPxDP configurations (default %(default)s)")
    ap.add_argument("--max-bucket-mb", type=float, default=64.0, help="staging cap per rank in MiB (0: none)")
    ap.add_argument("--skip-processes", action="store_true", help="only the planner section")
    ap.add_argument("--skip-planner", action="store_true", help="only the multi-process section")
    args = ap.parse_args(argv)
    console = Console(width=max(Console().width, 160))
    print_header(console, "benchmarks/bench_refit.py", argv)
    start = time.perf_counter()
    if not args.skip_processes:
        console.print(run_configs(args, console))
    if not args.skip_planner:
        console.print(run_planner(console, int(args.max_bucket_mb * MiB) or None))
    console.print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
