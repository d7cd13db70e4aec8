"""What the benchmarks in ``benchmarks/`` share: their header lines, their ``--configs`` syntax,
running a function in a gloo process group for the JSON its rank 0 writes, and timing executors
side by side in it."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import tempfile
import time

import torch

from ..execution.process_group import spawn
from ..frameworks.parallel import InferParallel, TrainParallel


def spawn_for_json(fn, world_size: int, *args, backend: str | None = "gloo"):
    """Run ``fn(rank, world_size, path, *args)`` in ``world_size`` processes; return what rank 0
    wrote to ``path`` as JSON (the file is removed)."""
    fd, path = tempfile.mkstemp(prefix="reshard-bench-", suffix=".json")
    os.close(fd)
    try:
        spawn(fn, world_size, path, *args, backend=backend)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def timed_runs(runs: dict, layout, rank: int, src: dict, dst: dict, repeat: int) -> dict:
    """Run every executor of ``runs`` (key -> executor) ``repeat`` times, interleaved (one of each per
    repeat, the order rotated each repeat), every destination byte verified after each run (collective:
    every rank calls it). Returns key -> (times, peak staging bytes, rounds, bytes sent): each time the
    slowest rank's wall time of one ``run``; peak and rounds the largest over ranks, bytes sent summed."""
    import torch.distributed as dist

    from ..verify import check_destination

    times: dict = {k: [] for k in runs}
    stats: dict = {}
    keys = list(runs)
    for i in range(repeat):
        for k in keys[i % len(keys):] + keys[: i % len(keys)]:
            for t in dst.values():
                t.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            st = runs[k].run(src, dst)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            bad = check_destination(layout.destination, rank, dst) if rank in layout.destination_ranks else []
            if bad:
                raise AssertionError(f"rank {rank}, {k}: {bad[:3]}")
            peak = torch.tensor([st.peak_staging_bytes, st.rounds], dtype=torch.int64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            sent = torch.tensor([st.sent_bytes], dtype=torch.int64)
            dist.all_reduce(sent)
            times[k].append(float(dt))
            stats[k] = (int(peak[0]), int(peak[1]), int(sent))
    return {k: (times[k], *stats[k]) for k in keys}


def print_header(console, script: str, argv: list[str] | None) -> None:
    """The command line and the machine, first lines of every benchmark's output."""
    cmd = " ".join(["python", script] + [shlex.quote(a) for a in (argv or sys.argv[1:])])
    console.print(f"$ {cmd}")
    console.print(f"machine: {os.cpu_count()} CPUs, {platform.machine()}, python {platform.python_version()}, "
                  f"torch {torch.__version__}, gloo over loopback")


def print_table(console, table, caption: str, start: float) -> None:
    """A benchmark's table with its caption (left-justified), then its total time since ``start``
    (``time.perf_counter()``)."""
    table.caption, table.caption_justify = caption, "left"
    console.print(table)
    console.print(f"total {time.perf_counter() - start:.0f} s")


def parse_configs(text: str) -> list[tuple[TrainParallel, InferParallel]]:
    """``"4-4:2x2"`` = FSDP2 over 4 sources -> 4 destinations as 2 torch tensor-parallel replicas of tp=2."""
    out = []
    for item in text.split(","):
        pair, grid = item.split(":")
        sources, destinations = (int(x) for x in pair.split("-"))
        tp, dp = (int(x) for x in grid.split("x"))
        if tp * dp != destinations:
            raise SystemExit(f"config {item!r}: tp x dp = {tp * dp} != N = {destinations}")
        out.append((TrainParallel("fsdp", dp=sources), InferParallel("dtensor", tp=tp, dp=dp)))
    return out


__all__ = ["parse_configs", "print_header", "print_table", "spawn_for_json", "timed_runs"]
