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
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist

from .. import verify
from ..execution.direct import HierarchicalExecutor, ReshardExecutor, RunStats
from ..execution.gather_broadcast import GatherBroadcastExecutor
from ..execution.process_group import spawn
from ..models.arch import Arch, get_arch
from ..models.demo_model import QWEN3_0_6B, DemoLayouts, ModelConfig, demo_layouts
from ..planning.hierarchy import cross_domain_bytes, hierarchical_plan
from ..planning.plan import plan as make_plan

RESHARD, GATHER_BROADCAST, HIERARCHICAL = "reshard", "gather-broadcast", "hierarchical"
METHODS = (RESHARD, GATHER_BROADCAST, HIERARCHICAL)
DEFAULT_METHODS = (RESHARD, GATHER_BROADCAST)
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
    methods: tuple[str, ...] = DEFAULT_METHODS
    progress: bool = True
    # a named model with real framework layouts (reshard.apps.report.build_refit) instead of the
    # Qwen3-like model above: preset name (or an Arch), training and inference configs
    preset: str | Arch | None = None
    train: str | None = None
    infer: str | None = None
    tiny: bool = True  # shrink the preset to a small random model of the same family (see tiny_arch)
    # pretend NVLink domains of this many consecutive ranks for the hierarchical method (inference
    # ranks start a fresh domain); 0: all inference ranks in one domain
    domain_size: int = 0
    arch_overrides: tuple[tuple[str, object], ...] = ()  # applied after shrinking, e.g. (("layers", 3),)

    @property
    def arch(self) -> Arch | None:
        """The model of a ``preset`` run (shrunk if ``tiny``, with the overrides), else ``None``."""
        if self.preset is None:
            return None
        a = get_arch(self.preset) if isinstance(self.preset, str) else self.preset
        if self.tiny:
            a = tiny_arch(a)
        return a.with_overrides(**dict(self.arch_overrides))

    @property
    def model_name(self) -> str | None:
        if self.preset is None:
            return None
        name = self.preset if isinstance(self.preset, str) else self.preset.family
        return f"tiny {name}" if self.tiny else name

    @property
    def train_spec(self) -> str:
        return self.train or default_train(self.arch)

    @property
    def infer_spec(self) -> str:
        return self.infer or "tp2"

    def layouts(self) -> DemoLayouts:
        if self.preset is None:
            return demo_layouts(self.model, self.sources, self.tp, self.dp, colocate=self.colocate,
                                src_dtype=self.source_dtype)
        from ..models.arch import model_specs
        from .report import build_refit

        refit = build_refit(self.arch, self.train_spec, self.infer_spec, source_dtype=self.source_dtype,
                            colocate=self.colocate)
        src, dst = refit.source, refit.destination
        return DemoLayouts(model_specs(refit.arch), src, dst, list(src.ranks), list(dst.ranks))


def default_train(arch: Arch | None) -> str:
    """The training config a ``preset`` run uses unless told: expert parallel for MoE, else TP."""
    return "tp1,ep2" if arch is not None and arch.is_moe else "tp2"


def tiny_arch(a: Arch) -> Arch:
    """A small random model of ``a``'s family that refits in seconds on a laptop.

    Keeps what decides the layouts' structure: the family (GQA with q/k norms, MoE with a
    router and experts, DeepSeek's MLA with low-rank q/kv, dense first layers, shared
    experts, MTP layers), tied or untied embeddings, the dtype. Sizes are chosen so that
    TP, EP and ETP up to 4 divide what they split (8 heads, 4 KV heads, 8 experts) and the
    vocabulary (1000) is padded by both Megatron and vLLM.
    """
    kw: dict = dict(hidden=64, layers=2, vocab=1000, heads=8, kv_heads=4, head_dim=16, intermediate=128)
    if a.is_moe:
        kw.update(experts=8, moe_intermediate=32, shared_experts=min(a.shared_experts, 1),
                  first_dense_layers=min(a.first_dense_layers, 1))
        kw["layers"] = 2 + kw["first_dense_layers"]
    if a.is_mla:
        kw.update(kv_heads=8, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=24, v_head_dim=16,
                  kv_lora_rank=32, q_lora_rank=None if a.q_lora_rank is None else 32)
    return replace(a, **kw)


class DemoFailed(RuntimeError):
    """A rank failed (crashed, timed out, raised); wrong bytes are reported in the result instead."""


# ---------------------------------------------------------------------------------------- ranks
class _Phases:
    """Runs the phases, each ended by a barrier; rank 0 shows them as they go, the others stay quiet."""

    def __init__(self, show: bool, total: int) -> None:
        self.seconds: dict[str, float] = {}
        self.progress = None
        if show:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

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
    domains = demo_domains(lay, cfg.domain_size)
    for method in cfg.methods:
        t = time.perf_counter()
        if method == HIERARCHICAL:
            hplan = hierarchical_plan(lay.source, lay.destination, domains, max_bucket_bytes=cfg.max_bucket_bytes)
            ex = HierarchicalExecutor(hplan)
        else:
            ex = ReshardExecutor(plan) if method == RESHARD else GatherBroadcastExecutor(plan)
        setup_s = time.perf_counter() - t

        def one_run():
            for b in dst_bufs.values():
                b.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            stats = ex.run(src_bufs, dst_bufs)
            if isinstance(stats, list):
                stats = _merged(stats)
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
        if method == HIERARCHICAL:
            methods[method]["cross_domain_bytes"] = sum(hplan.cross_domain_bytes.values())
            methods[method]["phases"] = hplan.phase_names
        elif method == RESHARD:
            methods[method]["cross_domain_bytes"] = sum(cross_domain_bytes(plan.pair_bytes, domains).values())
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


def demo_domains(lay: DemoLayouts, size: int) -> dict[int, int]:
    """Pretend NVLink domains: ``size`` consecutive ranks each, the inference ranks from a fresh
    domain (0: all inference ranks in one). Colocated ranks keep one domain for both roles."""
    dst = lay.destination_ranks
    size = size or len(dst)
    out = {r: r // size for r in lay.source_ranks}
    if set(dst) & set(lay.source_ranks):  # colocated
        return {r: r // size for r in sorted(set(dst) | set(lay.source_ranks))}
    first = -(-len(lay.source_ranks) // size)
    out.update({r: first + i // size for i, r in enumerate(dst)})
    return out


def _merged(stats: list[RunStats]) -> RunStats:
    """One run's figures over the phases of a hierarchical refit."""
    return RunStats(stats[0].rank, sum(s.seconds for s in stats), sum(s.sent_bytes for s in stats),
                    sum(s.recv_bytes for s in stats), sum(s.local_bytes for s in stats),
                    max(s.peak_staging_bytes for s in stats), sum(s.rounds for s in stats),
                    sum(s.messages for s in stats))


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
    if cfg.preset is not None:
        return _model_config_dict(cfg, lay)
    m = cfg.model
    return {
        "sources": cfg.sources, "tp": cfg.tp, "dp": cfg.dp, "destinations": cfg.tp * cfg.dp,
        "colocate": cfg.colocate, "world": lay.world_size, "layers": m.layers, "hidden": m.hidden,
        "intermediate": m.intermediate, "heads": m.heads, "kv_heads": m.kv_heads, "head_dim": m.head_dim,
        "vocab": m.vocab, "dtype": str(m.dtype).removeprefix("torch."),
        "source_dtype": str(cfg.source_dtype or m.dtype).removeprefix("torch."),
        "params": sum(s.numel for s in lay.specs), "model_bytes": sum(s.nbytes for s in lay.specs),
        "repeat": cfg.repeat, "seed": cfg.seed, "max_bucket_bytes": cfg.max_bucket_bytes,
        "domain_size": cfg.domain_size,
    }


def _model_config_dict(cfg: DemoConfig, lay: DemoLayouts) -> dict:
    a = cfg.arch
    return {
        "model": cfg.model_name, "family": a.family, "train": cfg.train_spec, "infer": cfg.infer_spec,
        "sources": len(lay.source_ranks), "destinations": len(lay.destination_ranks),
        "world": lay.world_size, "colocate": cfg.colocate, "arch": {k: (str(v).removeprefix("torch.")
                                                                if isinstance(v, torch.dtype) else v)
                                                            for k, v in asdict(a).items()},
        "dtype": str(a.dtype).removeprefix("torch."),
        "params": sum(s.numel for s in lay.specs), "model_bytes": sum(s.nbytes for s in lay.specs),
        "repeat": cfg.repeat, "seed": cfg.seed, "max_bucket_bytes": cfg.max_bucket_bytes,
        "domain_size": cfg.domain_size,
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


def _mib(n: int | None) -> str:
    return "none" if n is None else f"{n / MiB:.1f} MiB"


def _framework(spec: str, default: str) -> str:
    """``"tp1,ep2"`` -> ``"megatron tp1,ep2"``; ``"fsdp:dp2"`` -> ``"fsdp dp2"``."""
    fw, _, rest = spec.rpartition(":")
    return f"{fw or default} {rest}"


_PARAMS, _BYTES = ("B params", "M params", "k params", "params"), ("GB", "MB", "kB", "bytes")


def _size(n: int, units: tuple[str, str, str, str]) -> str:
    """``n`` with the largest of (1e9, 1e6, 1e3, 1) ``units`` it reaches."""
    for scale, unit in zip((1e9, 1e6, 1e3), units):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n} {units[3]}"


def report_table(result: dict):
    """The results as a rich Table."""
    from rich.table import Table

    c = result["config"]
    rep = c["repeat"]
    coloc = ", colocated" if c["colocate"] else ""
    if "model" in c:
        title = (f"refit {c['model']}: {_framework(c['train'], 'megatron')} on {c['sources']} ranks -> "
                 f"{_framework(c['infer'], 'vllm')} on {c['destinations']} ranks, {_size(c['params'], _PARAMS)}, "
                 f"{_size(c['model_bytes'], _BYTES)}")
    else:
        title = (f"refit {c['sources']} -> {c['destinations']} ranks (tp={c['tp']} x dp={c['dp']}{coloc}), "
                 f"{c['params'] / 1e9:.3f} B params, {c['model_bytes'] / 1e9:.2f} GB")
    t = Table(title=title,
              caption=("time: wall time of the slowest rank" + (f", best of {rep} runs" if rep > 1 else "")
                       + "; wire: bytes all ranks sent to other ranks (in the destination dtype); recv/dst: most "
                         "bytes any destination rank received; staging/rank: most bytes any rank held in "
                         "transfer buffers; speedup: vs gather-broadcast"), caption_justify="left")
    t.add_column("method", no_wrap=True)
    small = "model" in c and c["model_bytes"] < 1e9  # a tiny named model: its bytes in MB
    scale, unit = (1e6, "MB") if small else (1e9, "GB")
    for col in ["time s", f"wire {unit}", f"recv/dst {unit}", "staging/rank", "speedup"]:
        t.add_column(col, justify="right", no_wrap=True)
    base = result["methods"].get(GATHER_BROADCAST, {}).get("best_s")
    for name, r in result["methods"].items():
        speed = f"{base / r['best_s']:.2f}x" if base and r["best_s"] > 0 else "-"
        t.add_row(name, f"{r['best_s']:.2f}", f"{r['wire_bytes'] / scale:.3f}",
                  f"{r['max_recv_bytes'] / scale:.3f}",
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
    h = result["methods"].get(HIERARCHICAL)
    if h is not None:
        size = result["config"].get("domain_size") or "all inference"
        scale, unit = (1e6, "MB") if result["config"]["model_bytes"] < 1e9 else (1e9, "GB")
        line = (f"hierarchical ({' -> '.join(h['phases'])}; pretend NVLink domains of {size} ranks): "
                f"{h['cross_domain_bytes'] / scale:.3f} {unit} crossed between domains, "
                f"{(h['wire_bytes'] - h['cross_domain_bytes']) / scale:.3f} {unit} stayed inside one")
        direct = result["methods"].get(RESHARD)
        if direct is not None:
            line += (f"; reshard without domains sends {direct['cross_domain_bytes'] / scale:.3f} {unit} "
                     f"between them")
        console.print(line, highlight=False)
    bad = failures(result)
    if bad:
        console.print(f"[bold red]VERIFICATION FAILED[/]: {len(bad)} mismatching pieces")
        for line in bad[:40]:
            console.print(f"  [red]{line}[/]")
    else:
        console.print("[bold green]verified[/]: every destination byte matches the source, for every method")
