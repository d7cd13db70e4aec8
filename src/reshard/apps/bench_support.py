"""What the benchmarks in ``benchmarks/`` share: their header lines, their ``--configs`` syntax, and
running a function in a gloo process group for the JSON its rank 0 writes."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import tempfile

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


def print_header(console, script: str, argv: list[str] | None) -> None:
    """The command line and the machine, first lines of every benchmark's output."""
    cmd = " ".join(["python", script] + [shlex.quote(a) for a in (argv or sys.argv[1:])])
    console.print(f"$ {cmd}")
    console.print(f"machine: {os.cpu_count()} CPUs, {platform.machine()}, python {platform.python_version()}, "
                  f"torch {torch.__version__}, gloo over loopback")


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


__all__ = ["parse_configs", "print_header", "spawn_for_json"]
