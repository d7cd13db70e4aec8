"""The refit demo: one model, several methods, every destination byte verified.

:func:`run_demo` spawns ``M + N`` local processes (CPU, gloo). Each builds the layouts of the
model and the plans, fills its source buffers with :mod:`reshard.verify` values, then for each
method (:mod:`reshard.execution.methods`) and each repeat: zeroes its destination buffers, meets
the others at a barrier, runs the executor, meets them again, and checks its destination buffers
bit for bit. Rank 0 shows the phases as they go and writes the collected figures to a JSON file
that :func:`run_demo` returns as a dict; :func:`print_report` turns that into the table.

The default is the built-in demo: the ``qwen3-0.6b-untied`` preset, FSDP2 training on 4 ranks
(``fsdp:dp4``) and torch tensor parallelism in 2 replicas of 2 ranks (``dtensor:tp2,dp2``); a
named preset with Megatron-Core / vLLM layouts works the same way (``tiny=True`` shrinks it).
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

from .. import verify
from ..errors import OptionsError
from ..execution.methods import GATHER_BROADCAST, HIERARCHICAL, HYBRID, RESHARD, make_executor, make_plan
from ..execution.process_group import spawn
from ..frameworks.parallel import ModelLayouts, model_layouts
from ..models.arch import DEMO_MODEL, Arch, get_arch, tiny_arch
from ..options import RefitOptions
from ..planning.hierarchy import cross_domain_bytes
from ..planning.hybrid import HybridRule, as_rule
from ..planning.methods import METHODS as REGISTRY
from ..tensors import LayoutError

DEFAULT_METHODS = (RESHARD, GATHER_BROADCAST)
MiB = 1 << 20


@dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on (picklable: it travels to the spawned ranks)."""

    model: str | Arch = DEMO_MODEL  # a preset name or an Arch
    train: str = "fsdp:dp4"  # training side (frameworks.parallel.TrainParallel)
    infer: str = "dtensor:tp2,dp2"  # inference side (frameworks.parallel.InferParallel)
    tiny: bool = False  # shrink the model to a small random one of its family (models.tiny_arch)
    arch_overrides: tuple[tuple[str, object], ...] = ()  # applied after shrinking, e.g. (("layers", 3),)
    colocate: bool = False  # inference ranks 0..N-1, shared with training ranks (else M..M+N-1)
    source_dtype: torch.dtype | None = None  # training-side dtype (None: the model's)
    max_bucket_bytes: int | None = 64 * MiB
    repeat: int = 1
    seed: int = 0
    methods: tuple[str, ...] = DEFAULT_METHODS
    progress: bool = True
    # pretend NVLink domains of this many consecutive ranks for the hierarchical method (inference
    # ranks start a fresh domain); 0: all inference ranks in one domain
    domain_size: int = 0
    # the hybrid method's rule: tensors whose name matches one of these regular expressions go by
    # reshard, the others by gather-and-broadcast (None: HybridRule's default, FFN and expert weights)
    hybrid_patterns: tuple[str, ...] | None = None

    @property
    def arch(self) -> Arch:
        """The model refitted: the preset, shrunk if ``tiny``, with the overrides."""
        a = get_arch(self.model)
        if self.tiny:
            a = tiny_arch(a)
        return a.with_overrides(**dict(self.arch_overrides))

    @property
    def hybrid_rule(self) -> HybridRule | None:
        """The hybrid method's rule (None: the default); ``ValueError`` for a pattern that is no regex."""
        return as_rule(self.hybrid_patterns)

    def refit_options(self, method: str, domains: dict[int, int] | None = None) -> RefitOptions:
        """The options of ``method``'s refit in this demo, checked where they are made (an
        :class:`~reshard.errors.OptionsError` names the option): the staging cap, the rule where the
        method takes one, the pretend ``domains`` where it needs them (the hierarchical method; the
        hybrid's reshard part stays direct)."""
        options = RefitOptions(method=method, max_bucket_bytes=self.max_bucket_bytes)
        entry = REGISTRY.get(options.method)
        if entry is None:
            raise OptionsError(f"the demo runs named methods, not {method!r}; choose from {', '.join(REGISTRY)}")
        if entry.accepts("hybrid_rule") and self.hybrid_patterns is not None:
            options = options.replace(hybrid_rule=self.hybrid_patterns)
        return with_domains(options, domains)

    def method_options(self, domains: dict[int, int] | None = None) -> dict[str, RefitOptions]:
        """:meth:`refit_options` of every method of the demo, each made once."""
        return {method: self.refit_options(method, domains) for method in dict.fromkeys(self.methods)}

    @property
    def model_name(self) -> str:
        name = self.model if isinstance(self.model, str) else self.model.family
        return f"tiny {name}" if self.tiny else name

    def layouts(self) -> ModelLayouts:
        return model_layouts(self.arch, self.train, self.infer, colocate=self.colocate,
                             source_dtype=self.source_dtype)


def with_domains(options: RefitOptions, domains: dict[int, int] | None) -> RefitOptions:
    """``options`` with the pretend NVLink ``domains`` where its method needs them (unchanged otherwise)."""
    if domains is None or "domains" not in REGISTRY[options.method].needs:
        return options
    return options.replace(domains=domains)


def default_train(arch: Arch) -> str:
    """The training config a named-model run uses unless told: expert parallel for MoE, else TP."""
    return "tp1,ep2" if arch.is_moe else "tp2"


class DemoFailed(RuntimeError):
    """A rank failed (crashed, timed out, raised); wrong bytes are reported in the result instead."""


# ---------------------------------------------------------------------------------------- ranks
class _Phases:
    """Runs the phases, each ended by a barrier; rank 0 shows them as they go, the others stay quiet."""

    def __init__(self, show: bool, total: int) -> None:
        self.seconds: dict[str, float] = {}
        self.progress = None
        if show:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn)

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


def _refit(rank: int, world: int, cfg: DemoConfig, lay: ModelLayouts, ph: _Phases) -> dict:
    def planning():  # the reshard plan the report describes, whichever methods run
        started = time.perf_counter()
        reshard_plan = make_plan(cfg.refit_options(RESHARD), lay.source, lay.destination)
        return reshard_plan, time.perf_counter() - started

    plan, planner_s = ph.run("planning (every rank)", planning, "planning")

    def filling():
        src = verify.fill_source(lay.source, rank, seed=cfg.seed) if rank in lay.source_ranks else {}
        return src, lay.destination.empty_buffers(rank)

    src_bufs, dst_bufs = ph.run("filling source buffers", filling, "filling")
    methods = {}
    domains = demo_domains(lay, cfg.domain_size)
    method_options = cfg.method_options(domains)
    for method in cfg.methods:
        t = time.perf_counter()
        options = method_options[method]
        mplan = plan if method == RESHARD else make_plan(options, lay.source, lay.destination)
        ex = make_executor(options, mplan)  # collective for gather-broadcast and hybrid (subgroups)
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
        ex.close()
        seen: list = [None] * world
        dist.all_gather_object(seen, (rank, setup_s, [(w, asdict(s)) for w, s in reps], bad))
        methods[method] = _method_summary(seen, lay, cfg.repeat)
        if method in (RESHARD, HIERARCHICAL):
            methods[method]["cross_domain_bytes"] = sum(
                sum(cross_domain_bytes(p.pair_bytes, domains).values()) for p in mplan.phases)
            methods[method]["phases"] = mplan.phase_names
        elif method == HYBRID:
            methods[method].update(phases=mplan.phase_names, rule=mplan.rule.key, part_bytes=mplan.part_bytes(),
                                   reshard_tensors=len(mplan.reshard_tensors),
                                   broadcast_tensors=len(mplan.broadcast_tensors))
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


def demo_domains(lay: ModelLayouts, size: int) -> dict[int, int]:
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


def largest_piece_bytes(lay: ModelLayouts, rank: int) -> int:
    """Largest destination piece of ``rank``, in bytes (for the staging bound)."""
    return max((math.prod(p.sizes) * lay.destination.buffer_spec(rank, p.buffer)[1].itemsize
                for p in lay.destination.pieces(rank)), default=0)


def _method_summary(seen: list, lay: ModelLayouts, repeat: int) -> dict:
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


def _config_dict(cfg: DemoConfig, lay: ModelLayouts) -> dict:
    a = lay.arch
    return {
        "model": cfg.model_name, "family": a.family, "train": lay.train.describe(), "infer": lay.infer.describe(),
        "sources": len(lay.source_ranks), "destinations": len(lay.destination_ranks),
        "world": lay.world_size, "colocate": cfg.colocate,
        "arch": {k: (str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v) for k, v in asdict(a).items()},
        "dtype": str(a.dtype).removeprefix("torch."),
        "source_dtype": str(cfg.source_dtype or a.dtype).removeprefix("torch."),
        "params": sum(s.numel for s in lay.specs), "model_bytes": sum(s.nbytes for s in lay.specs),
        "repeat": cfg.repeat, "seed": cfg.seed, "max_bucket_bytes": cfg.max_bucket_bytes,
        "domain_size": cfg.domain_size, "hybrid_patterns": cfg.hybrid_patterns,
    }


# ---------------------------------------------------------------------------------------- driver
PROCESS_BYTES = 200 * MiB
"""A rank's own memory before it holds any weight (Python, torch, gloo; about 220 MiB measured)."""
PROCESSES_PER_CPU = 8
"""More local processes than this per CPU do not run the demo, they queue for the cores (gloo timeouts)."""


def machine_cpus() -> int:
    """CPUs this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes of memory available to new processes (``MemAvailable`` of ``/proc/meminfo``), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_problem(processes: int, weight_bytes: int, *, cpus: int | None = None,
                    available: int | None = None) -> str | None:
    """Why this machine cannot hold ``processes`` local ranks holding ``weight_bytes`` of buffers in all
    (None: it can). ``cpus`` and ``available`` (bytes) default to this machine's.

    >>> machine_problem(8, 3 << 30, cpus=2, available=16 << 30) is None
    True
    >>> machine_problem(40, 0, cpus=2, available=16 << 30)
    '40 processes on a machine with 2 CPUs: at most 16 (8 per CPU); use fewer ranks'
    >>> machine_problem(8, 20 << 30, cpus=2, available=16 << 30).split(";")[0]
    '8 processes need at least 23.2 GB of memory (21.5 GB of weights and staging, 1.7 GB to start the processes) \
but 17.2 GB are available'
    """
    cpus = machine_cpus() if cpus is None else cpus
    if processes > PROCESSES_PER_CPU * cpus:
        return (f"{processes} processes on a machine with {cpus} CPU{'s' if cpus > 1 else ''}: at most "
                f"{PROCESSES_PER_CPU * cpus} ({PROCESSES_PER_CPU} per CPU); use fewer ranks")
    available = available_memory() if available is None else available
    need = processes * PROCESS_BYTES + weight_bytes
    if available is not None and need > available:
        return (f"{processes} processes need at least {need / 1e9:.1f} GB of memory ({weight_bytes / 1e9:.1f} GB of "
                f"weights and staging, {processes * PROCESS_BYTES / 1e9:.1f} GB to start the processes) but "
                f"{available / 1e9:.1f} GB are available; shrink the model (--scale, --layers, --vocab) or use "
                f"fewer ranks")
    return None


def estimated_model_bytes(arch: Arch) -> int:
    """``arch.nbytes`` without listing every layer's tensors: exact up to 8 layers, then the last layer's
    bytes times the layers beyond (a model of 10**9 layers is refused, not enumerated)."""
    if arch.layers <= 8:
        return arch.nbytes
    eight, seven = arch.with_overrides(layers=8).nbytes, arch.with_overrides(layers=7).nbytes
    return eight + (arch.layers - 8) * (eight - seven)


def layout_bytes(layout) -> int:
    """Bytes of every buffer of every rank of ``layout``."""
    return sum(math.prod(shape) * dt.itemsize for r in layout.ranks for shape, dt in layout.buffers(r).values())


def preflight(cfg: DemoConfig, lay: ModelLayouts | None = None) -> ModelLayouts:
    """Check everything about ``cfg`` that can go wrong before a process is spawned, and return its layouts
    (``lay`` if given): the methods, each method's refit options (made once each by
    :meth:`DemoConfig.method_options`: :class:`~reshard.options.RefitOptions` checks them), the demo's own
    settings, that the model and ranks fit this machine (:func:`machine_problem`) and that every method
    plans under the staging cap. Raises ``ValueError`` (``LayoutError`` for a model the parallel sizes
    do not split, ``OptionsError`` for a refit option) with one line naming the culprit."""
    from ..frameworks.parallel import InferParallel, TrainParallel
    from ..tensors import checked_int

    bad = [m for m in cfg.methods if m not in REGISTRY]
    if bad or not cfg.methods:
        raise ValueError(f"unknown method(s) {bad}; choose from {', '.join(REGISTRY)}")
    if cfg.hybrid_patterns is not None and HYBRID not in cfg.methods:
        raise ValueError("hybrid_patterns is the rule of the hybrid method: add hybrid to the methods")
    options = cfg.method_options()  # the staging cap and the hybrid's rule (domains: below, once laid out)
    checked_int(cfg.repeat, "repeat", minimum=1)
    checked_int(cfg.seed, "seed")
    checked_int(cfg.domain_size, "domain_size", minimum=0)
    if cfg.source_dtype is not None and not isinstance(cfg.source_dtype, torch.dtype):
        raise ValueError(f"source_dtype must be a torch.dtype, got {cfg.source_dtype!r}")
    if lay is None:
        arch = cfg.arch
        train = TrainParallel.parse(cfg.train) if isinstance(cfg.train, str) else cfg.train
        infer = InferParallel.parse(cfg.infer) if isinstance(cfg.infer, str) else cfg.infer
        world = max(train.world, infer.world) if cfg.colocate else train.world + infer.world
        model = estimated_model_bytes(arch)
        source = model * (cfg.source_dtype or arch.dtype).itemsize // arch.dtype.itemsize
        problem = machine_problem(world, source + model)  # at least one copy on each side
        if problem:
            raise ValueError(problem)
        lay = cfg.layouts()
    staging = lay.world_size * min(cfg.max_bucket_bytes or 0, layout_bytes(lay.destination))
    problem = machine_problem(lay.world_size, layout_bytes(lay.source) + layout_bytes(lay.destination) + staging)
    if problem:
        raise ValueError(problem)
    domains = demo_domains(lay, cfg.domain_size)
    for method, method_options in options.items():
        if method == GATHER_BROADCAST:  # no rounds: nothing to fit under the cap
            continue
        try:
            make_plan(with_domains(method_options, domains), lay.source, lay.destination)
        except LayoutError:
            raise
        except ValueError as error:
            raise ValueError(f"the {method} plan: {error}") from None
    return lay


def run_demo(cfg: DemoConfig) -> dict:
    """Spawn the ranks, run the refit with every method, return rank 0's figures.

    Wrong destination bytes do not raise: they are listed in the result (see
    :func:`failures`). Raises :class:`DemoFailed` if a rank fails, ``ValueError`` (before
    spawning anything) for a configuration :func:`preflight` refuses.
    """
    lay = preflight(cfg)  # fail fast on a bad config, before spawning anything
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


PARAMS, BYTES = ("B params", "M params", "k params", "params"), ("GB", "MB", "kB", "bytes")


def human(n: int, units: tuple[str, str, str, str]) -> str:
    """``n`` with the largest of (1e9, 1e6, 1e3, 1) ``units`` it reaches: ``human(752e6, PARAMS)`` is
    ``'752.000 M params'``."""
    for scale, unit in zip((1e9, 1e6, 1e3), units):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n} {units[3]}"


def header_line(cfg: DemoConfig, lay: ModelLayouts) -> str:
    """What is about to run, in one line (printed before the ranks start)."""
    nbytes = sum(s.nbytes for s in lay.specs)
    src_dtype = f" ({str(cfg.source_dtype).removeprefix('torch.')} weights)" if cfg.source_dtype else ""
    return (f"reshard demo: {cfg.model_name} ({lay.arch.family}), {len(lay.specs)} tensors, "
            f"{human(sum(s.numel for s in lay.specs), PARAMS)} ({human(nbytes, BYTES)} "
            f"{str(lay.arch.dtype).removeprefix('torch.')}); train {lay.train.describe()} on "
            f"{len(lay.source_ranks)} ranks{src_dtype} -> infer {lay.infer.describe()} on "
            f"{len(lay.destination_ranks)} ranks{', colocated' if cfg.colocate else ''}, {lay.world_size} "
            f"processes, gloo")


def report_table(result: dict):
    """The results as a rich Table."""
    from rich.table import Table

    c = result["config"]
    rep = c["repeat"]
    coloc = ", colocated" if c["colocate"] else ""
    title = (f"refit {c['model']}: {c['train']} on {c['sources']} ranks -> {c['infer']} on {c['destinations']} "
             f"ranks{coloc}, {human(c['params'], PARAMS)}, {human(c['model_bytes'], BYTES)}")
    t = Table(title=title,
              caption=("time: wall time of the slowest rank" + (f", best of {rep} runs" if rep > 1 else "")
                       + "; wire: bytes all ranks sent to other ranks (in the destination dtype); recv/dst: most "
                         "bytes any destination rank received; staging/rank: most bytes any rank held in "
                         "transfer buffers; speedup: vs gather-broadcast"), caption_justify="left")
    t.add_column("method", no_wrap=True)
    scale, unit = (1e6, "MB") if c["model_bytes"] < 1e9 else (1e9, "GB")  # a tiny model: its bytes in MB
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


def hybrid_line(h: dict, model_bytes: int) -> str:
    """What the hybrid sent each way, in one line."""
    scale, unit = (1e6, "MB") if model_bytes < 1e9 else (1e9, "GB")
    b = h["part_bytes"]
    rule = "the default rule, FFN and expert weights" if h["rule"] == HybridRule().key else f"rule {h['rule']}"
    return (f"hybrid ({' -> '.join(h['phases'])}; {rule}): {h['reshard_tensors']} tensors by reshard "
            f"({b['reshard'] / scale:.3f} {unit} on the wire), {h['broadcast_tensors']} by gather-broadcast "
            f"({b['gather'] / scale:.3f} {unit} gathered, {b['broadcast'] / scale:.3f} {unit} broadcast)")


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
    hy = result["methods"].get(HYBRID)
    if hy is not None:
        console.print(hybrid_line(hy, result["config"]["model_bytes"]), highlight=False)
    bad = failures(result)
    if bad:
        console.print(f"[bold red]VERIFICATION FAILED[/]: {len(bad)} mismatching pieces")
        for line in bad[:40]:
            console.print(f"  [red]{line}[/]")
    else:
        console.print("[bold green]verified[/]: every destination byte matches the source, for every method")
