"""What end-to-end checksums cost: the same refit with and without an xxh3-64 digest per message.

Run from the repository root::

    python benchmarks/bench_checksum.py [--repeat 7] [--layers 2] [--configs 2-2:2x1,4-4:4x1]

One process group per configuration (CPU, gloo), the demo model (Qwen3-0.6B-shaped, ``--layers``
decoder layers); per repeat, one run without and one with ``ReshardExecutor(checksum=True)``, in
alternating order (the machine is noisy). The sender hashes each packed message and sends the
8-byte digest after it; the receiver hashes what arrived before unpacking it. Times are the
slowest rank's wall time of one ``run``, median over repeats; the ratio is with / without, per
repeat, then median. Every destination byte is verified after every run. All figures measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import reshard as rs
from reshard import verify
from reshard.apps.bench_support import parse_configs, print_header, spawn_for_json
from reshard.frameworks.parallel import model_layouts
from reshard.models import DEMO_MODEL, get_arch

MiB = 1 << 20


def _worker(rank: int, world: int, path: str, config: str, layers: int, repeat: int) -> None:
    import json

    (train, infer), = parse_configs(config)
    lay = model_layouts(get_arch(DEMO_MODEL).with_overrides(layers=layers), train, infer)
    src = verify.fill_source(lay.source, rank) if rank in lay.source_ranks else {}
    dst = lay.destination.empty_buffers(rank)
    plan = rs.plan(lay.source, lay.destination, max_bucket_bytes=32 * MiB)
    executors = {False: rs.ReshardExecutor(plan), True: rs.ReshardExecutor(plan, checksum=True)}
    times = {False: [], True: []}
    bad = []
    for i in range(repeat + 1):
        for checksum in ((False, True) if i % 2 else (True, False)):
            for t in dst.values():
                t.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            executors[checksum].run(src, dst)
            if i:  # the first round warms up
                times[checksum].append(time.perf_counter() - t0)
            if rank in lay.destination_ranks:
                bad += verify.check_destination(lay.destination, rank, dst)[:1]
    everyone = [None] * world
    dist.all_gather_object(everyone, {"times": times, "bad": bad, "bytes": plan.wire_bytes})
    if rank == 0:
        with open(path, "w") as f:
            json.dump(everyone, f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--configs", default="2-2:2x1,4-4:4x1")
    args = ap.parse_args(argv)
    console = Console()
    print_header(console, "benchmarks/bench_checksum.py", argv)
    table = Table(title=f"checksum cost, {args.layers}-layer {DEMO_MODEL}, gloo on this CPU (measured; median of "
                        f"{args.repeat})")
    for col in ("config", "wire MiB", "without s", "with s", "with / without"):
        table.add_column(col, justify="right")
    ok = True
    for config in args.configs.split(","):
        (train, infer), = parse_configs(config)
        world = train.world + infer.world
        ranks = spawn_for_json(_worker, world, config, args.layers, args.repeat)
        slowest = {c: [max(r["times"][str(c).lower()][i] for r in ranks) for i in range(args.repeat)]
                   for c in (False, True)}
        ratios = [w / o for w, o in zip(slowest[True], slowest[False])]
        ok &= not any(r["bad"] for r in ranks)
        table.add_row(config, f"{ranks[0]['bytes'] / MiB:.0f}", f"{statistics.median(slowest[False]):.3f}",
                      f"{statistics.median(slowest[True]):.3f}", f"{statistics.median(ratios):.2f}x")
    console.print(table)
    console.print("every destination byte verified after every run" if ok else "[red]WRONG BYTES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
