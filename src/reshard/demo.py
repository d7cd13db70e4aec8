"""The refit demo: one model, both executors, every destination byte verified.

:func:`run_demo` spawns ``M + N`` local processes (CPU, gloo). Each builds the demo
layouts and the plan, fills its source buffers with :mod:`reshard.verify` values,
then for each method (reshard, gather-and-broadcast) and each repeat: zeroes its
destination buffers, meets the others at a barrier, runs the executor, meets them
again, and checks its destination buffers bit for bit. Rank 0 shows the phases as
they go and writes the collected figures to a JSON file that :func:`run_demo`
returns as a dict; :func:`print_report` turns that into the table.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

from . import verify
from .demo_model import QWEN3_0_6B, DemoLayouts, ModelConfig, demo_layouts
from .executor import ReshardExecutor
from .gather_broadcast import GatherBroadcastExecutor
from .plan import plan as make_plan
from .process_group import spawn

RESHARD, GATHER_BROADCAST = "reshard", "gather-broadcast"
METHODS = (RESHARD, GATHER_BROADCAST)
MiB = 1 << 20


@dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on (picklable: it travels to the spawned ranks)."""

    model: ModelConfig = QWEN3_0_6B
    sources: int = 4
    tp: int = 2
    dp: int = 2
    colocate: bool = False
    source_dtype: torch.dtype | None = None  # training-side dtype (None: the model's)
    max_bucket_bytes: int | None = 64 * MiB
    repeat: int = 1
    seed: int = 0
    methods: tuple[str, ...] = METHODS
    progress: bool = True

    def layouts(self) -> DemoLayouts:
        return demo_layouts(self.model, self.sources, self.tp, self.dp, colocate=self.colocate,
                            src_dtype=self.source_dtype)


class DemoFailed(RuntimeError):
    """A rank failed (crashed, timed out, raised); wrong bytes are reported in the result instead."""


# ---------------------------------------------------------------------------------------- ranks
class _Phases:
    """Runs the phases, each ended by a barrier; rank 0 shows them as they go, the others stay quiet."""

    def __init__(self, show: bool, total: int) -> None:
        self.seconds: dict[str, float] = {}
        self.progress = None
        if show:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, \
                TimeElapsedColumn

            self.progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(), transient=True)
            self.progress.start()
            self.task = self.progress.add_task("starting", total=total)

    def run(self, name: str, fn: Callable, key: str | None = None):
        """``fn()``, then a barrier; the time (rank 0's, barrier included) adds up under ``key``."""
        if self.progress is not None:
            self.progress.update(self.task, description=name)
        t = time.perf_counter()
        out = fn()
        dist.barrier()
        dt = time.perf_counter() - t
        key = key or name
        self.seconds[key] = self.seconds.get(key, 0.0) + dt
        if self.progress is not None:
            self.progress.console.print(f"  [green]done[/]  {name:<36} {dt:7.2f} s")
            self.progress.advance(self.task)
        return out

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _worker(rank: int, world: int, cfg: DemoConfig, result_path: str) -> None:
    lay = cfg.layouts()
    ph = _Phases(cfg.progress and rank == 0, 2 + 2 * len(cfg.methods) * cfg.repeat)
    try:
        result = _refit(rank, world, cfg, lay, ph)
    finally:
        ph.close()
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(result, f)


def _refit(rank: int, world: int, cfg: DemoConfig, lay: DemoLayouts, ph: _Phases) -> dict:
    def planning():
        t = time.perf_counter()
        p = make_plan(lay.source, lay.destination, max_bucket_bytes=cfg.max_bucket_bytes)
        return p, time.perf_counter() - t

    plan, planner_s = ph.run("planning (every rank)", planning, "planning")

    def filling():
        src = verify.fill_source(lay.source, rank, seed=cfg.seed) if rank in lay.source_ranks else {}
        return src, lay.destination.empty_buffers(rank)

    src_bufs, dst_bufs = ph.run("filling source buffers", filling, "filling")
    methods = {}
    for method in cfg.methods:
        t = time.perf_counter()
        ex = ReshardExecutor(plan) if method == RESHARD else GatherBroadcastExecutor(plan)
        setup_s = time.perf_counter() - t

        def one_run():
            for b in dst_bufs.values():
                b.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            stats = ex.run(src_bufs, dst_bufs)
            return time.perf_counter() - t0, stats

        reps, bad = [], []
        for i in range(cfg.repeat):
            n = f" {i + 1}/{cfg.repeat}" if cfg.repeat > 1 else ""
            reps.append(ph.run(f"{method} run{n}", one_run, f"{method} run"))
            bad += ph.run(f"verify after {method}{n}",
                          lambda: verify.check_destination(lay.destination, rank, dst_bufs, seed=cfg.seed),
                          f"verify after {method}")
        seen: list = [None] * world
        dist.all_gather_object(seen, (rank, setup_s, [(w, asdict(s)) for w, s in reps], bad))
        methods[method] = _method_summary(seen, lay, cfg.repeat)
    peak_dst = max((largest_piece_bytes(lay, r) for r in lay.destination_ranks), default=0)
    part = plan.for_rank(rank)
    largest_copy = max((c.nbytes for m in part.sends + part.recvs for c in m.copies), default=0)
    facts: list = [None] * world
    dist.all_gather_object(facts, (planner_s, len(part.sends), largest_copy))
    return {
        "config": _config_dict(cfg, lay),
        "plan": {
            "tensors": len(plan.tensors), "pieces": plan.num_pieces, "wire_bytes": plan.wire_bytes,
            "max_recv_bytes": max(plan.recv_bytes.values(), default=0), "send_balance": plan.send_balance,
            "fingerprint": plan.fingerprint(), "planner_s": max(f[0] for f in facts),
            "messages": sum(f[1] for f in facts), "rounds": methods.get(RESHARD, {}).get("rounds"),
            "max_bucket_bytes": cfg.max_bucket_bytes, "largest_piece_bytes": peak_dst,
            "largest_copy_bytes": max(f[2] for f in facts),
        },
        "methods": methods,
        "phases": ph.seconds,
    }


def largest_piece_bytes(lay: DemoLayouts, rank: int) -> int:
    """Largest destination piece of ``rank``, in bytes (for the staging bound)."""
    return max((math.prod(p.sizes) * lay.destination.buffer_spec(rank, p.buffer)[1].itemsize
                for p in lay.destination.pieces(rank)), default=0)


def _method_summary(seen: list, lay: DemoLayouts, repeat: int) -> dict:
    walls = [max(s[2][i][0] for s in seen) for i in range(repeat)]  # slowest rank, per repeat
    last = {r: reps[-1][1] for r, _, reps, _ in seen}
    peak = max(st["peak_staging_bytes"] for _, _, reps, _ in seen for _, st in reps)
    return {
        "wall_s": walls,
        "best_s": min(walls),
        "median_s": statistics.median(walls),
        "setup_s": max(s[1] for s in seen),
        "wire_bytes": sum(st["sent_bytes"] for st in last.values()),
        "max_recv_bytes": max((last[r]["recv_bytes"] for r in lay.destination_ranks), default=0),
        "peak_staging_bytes": peak,
        "rounds": max(st["rounds"] for st in last.values()),
        "mismatches": [m for _, _, _, bad in seen for m in bad],
    }


def _config_dict(cfg: DemoConfig, lay: DemoLayouts) -> dict:
    m = cfg.model
    return {
        "sources": cfg.sources, "tp": cfg.tp, "dp": cfg.dp, "destinations": cfg.tp * cfg.dp,
        "colocate": cfg.colocate, "world": lay.world_size, "layers": m.layers, "hidden": m.hidden,
        "intermediate": m.intermediate, "heads": m.heads, "kv_heads": m.kv_heads, "head_dim": m.head_dim,
        "vocab": m.vocab, "dtype": str(m.dtype).removeprefix("torch."),
        "source_dtype": str(cfg.source_dtype or m.dtype).removeprefix("torch."),
        "params": sum(s.numel for s in lay.specs), "model_bytes": sum(s.nbytes for s in lay.specs),
        "repeat": cfg.repeat, "seed": cfg.seed, "max_bucket_bytes": cfg.max_bucket_bytes,
    }


# ---------------------------------------------------------------------------------------- driver
def run_demo(cfg: DemoConfig) -> dict:
    """Spawn the ranks, run the refit with every method, return rank 0's figures.

    Wrong destination bytes do not raise: they are listed in the result (see
    :func:`failures`). Raises :class:`DemoFailed` if a rank fails.
    """
    lay = cfg.layouts()  # fail fast on a bad config, before spawning anything
    fd, path = tempfile.mkstemp(prefix="reshard-demo-", suffix=".json")
    os.close(fd)
    try:
        try:
            spawn(_worker, lay.world_size, cfg, path, backend="gloo")
        except Exception as e:  # torch.multiprocessing wraps the failing rank's error
            raise DemoFailed(f"a rank failed: {e}") from e
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def failures(result: dict) -> list[str]:
    return [f"{m}: {x}" for m, r in result["methods"].items() for x in r["mismatches"]]


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f}"


def _mib(n: int | None) -> str:
    return "none" if n is None else f"{n / MiB:.1f} MiB"


def report_table(result: dict):
    """The results as a rich Table."""
    from rich.table import Table

    c = result["config"]
    rep = c["repeat"]
    coloc = ", colocated" if c["colocate"] else ""
    t = Table(title=f"refit {c['sources']} -> {c['destinations']} ranks (tp={c['tp']} x dp={c['dp']}{coloc}), "
                    f"{c['params'] / 1e9:.3f} B params, {c['model_bytes'] / 1e9:.2f} GB",
              caption=("time: wall time of the slowest rank" + (f", best of {rep} runs" if rep > 1 else "")
                       + "; wire: bytes all ranks sent to other ranks (in the destination dtype); recv/dst: most "
                         "bytes any destination rank received; staging/rank: most bytes any rank held in "
                         "transfer buffers; speedup: vs gather-broadcast"), caption_justify="left")
    t.add_column("method", no_wrap=True)
    for col in ["time s", "wire GB", "recv/dst GB", "staging/rank", "speedup"]:
        t.add_column(col, justify="right", no_wrap=True)
    base = result["methods"].get(GATHER_BROADCAST, {}).get("best_s")
    for name, r in result["methods"].items():
        speed = f"{base / r['best_s']:.2f}x" if base and r["best_s"] > 0 else "-"
        t.add_row(name, f"{r['best_s']:.2f}", _gb(r["wire_bytes"]), _gb(r["max_recv_bytes"]),
                  _mib(r["peak_staging_bytes"]), speed)
    return t


def plan_line(result: dict) -> str:
    p = result["plan"]
    return (f"plan: {p['tensors']} tensors, {p['pieces']} pieces, {p['messages']} messages, {p['rounds']} rounds, "
            f"send balance max/mean {p['send_balance']:.3f}, fingerprint {p['fingerprint']}, "
            f"planner {p['planner_s'] * 1e3:.1f} ms, staging cap {_mib(p['max_bucket_bytes'])}")


def print_report(result: dict, console=None) -> None:
    from rich.console import Console

    console = console or Console()
    if not console.is_terminal and console.width < 100:  # logs and pipes: room for the table
        console.width = 100
    console.print(report_table(result))
    console.print(plan_line(result))
    bad = failures(result)
    if bad:
        console.print(f"[bold red]VERIFICATION FAILED[/]: {len(bad)} mismatching pieces")
        for line in bad[:40]:
            console.print(f"  [red]{line}[/]")
    else:
        console.print("[bold green]verified[/]: every destination byte matches the source, for every method")
