"""Command line: ``reshard demo``, ``reshard plan`` and ``reshard simulate`` (also ``python -m reshard ...``).

Pictures go to an output folder, ``reshard-out/`` under the current directory unless told
(``reshard plan --plot [DIR]``, ``reshard simulate --out DIR``); the paths are printed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from ..models.arch import DEMO_MODEL, PRESETS, Arch, get_arch

DEFAULT_OUT = "reshard-out"
SIZES = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab")  # model size options

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MiB = 1 << 20


def _integer(s: str, minimum: int) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {s!r}") from None
    if v < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
    return v


def _positive(s: str) -> int:
    return _integer(s, 1)


def _nonnegative(s: str) -> int:
    return _integer(s, 0)


def _number(s: str, *, zero: bool, what: str) -> float:
    """A finite float > 0 (>= 0 with ``zero``), for an argparse option."""
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>= 0' if zero else '> 0'}{what}, got {s!r}")
    return v


def _positive_number(s: str) -> float:
    return _number(s, zero=False, what="")


def _cap_mb(s: str) -> float:
    return _number(s, zero=True, what=" (0: no cap)")


def cap_bytes(mb: float, option: str, *, none: bool = True) -> int | None:
    """``--max-bucket-mb``-style MiB as whole bytes (None for 0: no cap, where ``none``), or ``ValueError``
    when a positive figure rounds below :data:`~reshard.planning.schedule.ALIGN` bytes."""
    from ..planning.schedule import ALIGN

    n = int(mb * MiB)
    if mb and n < ALIGN:
        raise ValueError(f"{option} {mb:g} is {n} bytes; a staging cap needs at least {ALIGN} bytes "
                         f"({ALIGN / MiB:.2g} MiB)" + (", or 0 for none" if none else ""))
    return n or None


def output_problem(path: str, option: str, *, folder: bool = False) -> str | None:
    """Why ``path`` cannot be written (None: it can): a folder where a file is wanted or the other way
    round, a file on the way to it, or no write permission. Missing folders are fine: they are created."""
    if not path:
        return f"{option}: empty path"
    p = Path(path)
    if not folder and path.endswith(("/", os.sep)):
        return f"{option} {path!r} names a folder; give a file path"
    if p.exists():
        if folder and not p.is_dir():
            return f"{option} {path!r} is a file, not a folder"
        if not folder and p.is_dir():
            return f"{option} {path!r} is a folder; give a file path"
        if not os.access(p, os.W_OK):
            return f"{option} {path!r} is not writable"
        return None
    above = p.absolute().parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        return f"{option} {path!r}: {str(above)!r} is a file, not a folder"
    if not os.access(above, os.W_OK | os.X_OK):
        return f"{option} {path!r}: cannot create anything in {str(above)!r} (not writable)"
    return None


def _check_outputs(*outputs: tuple[str | None, str, bool]) -> None:
    for path, option, folder in outputs:
        problem = None if path is None else output_problem(path, option, folder=folder)
        if problem:
            raise ValueError(problem)


def _check_demo(args) -> None:
    """Option checks before anything is planned or spawned (``ValueError``: a usage error)."""
    cap_bytes(args.max_bucket_mb, "--max-bucket-mb")
    _check_outputs((args.json, "--json", False))


def _check_plan(args) -> None:
    cap_bytes(args.max_bucket_mb, "--max-bucket-mb")
    _check_outputs((args.plot, "--plot", True))


def _check_simulate(args) -> None:
    cap_bytes(args.bucket_mb, "--bucket-mb", none=False)
    _check_outputs((args.out if args.png is None else None, "--out", True), (args.png or None, "--png", False),
                   (args.json, "--json", False))


def _write_json(path: str, data) -> None:
    import json

    Path(path).absolute().parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def _demo_parser(sub) -> argparse.ArgumentParser:
    d = get_arch(DEMO_MODEL)
    p = sub.add_parser(
        "demo",
        help="refit a transformer from M training ranks to N inference ranks with both executors, verify, compare",
        description=(
            "Spawn M source (training) and N = tp x dp destination (inference) processes on this machine "
            "(CPU, gloo), and move the weights of a Qwen3-0.6B-like transformer (untied LM head, "
            f"{d.num_params / 1e9:.2f} B parameters, {d.nbytes / 1e9:.2f} GB in bf16 by default) from an FSDP-style "
            "Shard(0) layout over the M sources to a tensor-parallel layout (column-parallel q/k/v/gate/up, "
            "row-parallel o/down, vocab-parallel embedding and LM head, replicated norms) over dp replicas of "
            "tp ranks. It runs the reshard executor and then the gather-and-broadcast baseline, verifies every "
            "destination byte after each, and prints wall time, wire bytes, bytes received per destination, "
            "peak staging memory and the speedup. Exits with status 1 if any byte is wrong. "
            "The defaults (the full 0.75 B-parameter model, 4 -> 4 ranks) take 30-60 s on a 2-core machine "
            "and about 8 GB of memory in all (8 processes); use --layers, --vocab or "
            "--scale to shrink the model."),
    )
    g = p.add_argument_group("ranks")
    g.add_argument("--sources", "-M", type=_positive, default=None, metavar="M",
                   help="number of source (training) ranks, 0..M-1; every tensor is Shard(0) over them with "
                        "the torch.chunk split rule, as FSDP2 shards (default 4; not with --model)")
    g.add_argument("--tp", type=_positive, default=None,
                   help="tensor-parallel size of each inference replica; must divide the heads, kv heads, "
                        "intermediate size and vocab (1, 2, 4 or 8 for the default model) (default 2; not with "
                        "--model)")
    g.add_argument("--dp", type=_positive, default=None,
                   help="number of inference replicas (data parallel); destination ranks N = tp x dp, each "
                        "replica a group of tp consecutive ranks (default 2; not with --model)")
    g.add_argument("--colocate", action="store_true",
                   help="put destination ranks on ranks 0..N-1 (shared with the sources) instead of M..M+N-1; "
                        "bytes a rank already holds are then copied locally, not sent (default: separate ranks)")

    n = p.add_argument_group(
        "named model with real framework layouts (instead of the Qwen3-style model and ranks)",
        "With --model, the training side is laid out as Megatron-Core (or FSDP2) lays it out and the inference "
        "side as vLLM does, with the same rules as `reshard plan`; training ranks are 0..M-1 and inference ranks "
        "M..M+N-1, M and N following from --train and --infer. Example: reshard demo --model qwen3-30b-a3b "
        "--train tp1,ep2 --infer tp2")
    n.add_argument("--model", default=None, choices=sorted(PRESETS), metavar="NAME",
                   help=f"model preset, one of: {', '.join(sorted(PRESETS))}")
    n.add_argument("--train", default=None, metavar="SPEC",
                   help="training parallelism as in `reshard plan`: Megatron sizes like tp1,ep2 or tp2,pp2, or "
                        "fsdp:dp2[,tp2] (default: tp1,ep2 for MoE models, else tp2)")
    n.add_argument("--infer", default=None, metavar="SPEC",
                   help="inference parallelism (vLLM): tp2,dp2 = 2 engines of 2 ranks; add ep for expert "
                        "parallel (default tp2)")
    n.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=True,
                   help="shrink the preset to a small random model of the same family that runs in seconds: "
                        "64 hidden, 2 layers (3 for DeepSeek: 1 dense + 2 MoE), 8 heads, 4 KV heads, 8 experts, "
                        "vocab 1000, MLA and shared experts kept; --layers, --hidden, ... override single sizes. "
                        "--no-tiny runs the full preset (needs its full size in memory, several times over) "
                        "(default: on)")
    m = p.add_argument_group(f"model (defaults: {DEMO_MODEL}, Qwen3-0.6B with an untied LM head)")
    m.add_argument("--layers", type=_positive, default=None, help=f"decoder layers (default {d.layers})")
    m.add_argument("--hidden", type=_positive, default=None, help=f"hidden size (default {d.hidden})")
    m.add_argument("--intermediate", type=_positive, default=None,
                   help=f"MLP intermediate size (default {d.intermediate})")
    m.add_argument("--heads", type=_positive, default=None, help=f"attention heads (default {d.heads})")
    m.add_argument("--kv-heads", type=_positive, default=None, help=f"key/value heads (default {d.kv_heads})")
    m.add_argument("--head-dim", type=_positive, default=None, help=f"size of one head (default {d.head_dim})")
    m.add_argument("--vocab", type=_positive, default=None, help=f"vocabulary size (default {d.vocab})")
    m.add_argument("--scale", type=_positive_number, default=None,
                   help="shrink (or grow) the model: multiplies the number of layers and the vocabulary by this "
                        "factor (vocab rounded to a multiple of 64 x tp); explicit --layers/--vocab win")
    m.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of the weights, and of the inference-side buffers (default %(default)s)")
    m.add_argument("--source-dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of the training-side buffers if different (e.g. fp32 master weights); the "
                        "executors cast to --dtype on the sender (default: same as --dtype)")
    r = p.add_argument_group("run")
    r.add_argument("--max-bucket-mb", type=_cap_mb, default=64.0,
                   help="staging cap per rank in MiB (max_bucket_bytes): the most a rank stages at once; the "
                        "transfer runs in rounds, two in flight, each under half of it; 0 means no cap "
                        "(default %(default)s)")
    r.add_argument("--repeat", type=_positive, default=1,
                   help="runs per method; the table reports the best (each run's time is its slowest rank's); "
                        "destination buffers are zeroed before, and verified after, every run (default %(default)s)")
    r.add_argument("--seed", type=int, default=0,
                   help="seed of the test values written into the source buffers (default %(default)s)")
    r.add_argument("--methods", default="reshard,gather-broadcast",
                   help="comma-separated methods to run, in order, of: reshard, gather-broadcast, hierarchical "
                        "(reshard in phases over pretend NVLink domains, see --domain-size), hybrid (the tensors "
                        "--hybrid-patterns picks by reshard, the others by gather-broadcast) (default %(default)s)")
    r.add_argument("--hybrid-patterns", default=None, metavar="REGEX,...",
                   help="for the hybrid method: comma-separated regular expressions; a tensor whose name matches "
                        "one (re.search) goes by reshard, the others by gather-broadcast; an empty string sends "
                        "everything by gather-broadcast (default: FFN and expert weights, "
                        "reshard.planning.hybrid.FFN_PATTERNS)")
    r.add_argument("--domain-size", type=_nonnegative, default=0, metavar="K",
                   help="for the hierarchical method: pretend NVLink domains of K consecutive ranks, inference "
                        "ranks starting a fresh domain; 0 puts all inference ranks in one (default %(default)s)")
    r.add_argument("--json", metavar="PATH", default=None,
                   help="also write the collected figures (per-run times, bytes, plan facts) to PATH as JSON")
    r.add_argument("--quiet", action="store_true",
                   help="no progress display while running; print only the header and the final table")
    p.set_defaults(func=_demo, check=_check_demo, parser=p)
    return p


def model_from_args(args) -> Arch:
    """The built-in demo's model: the demo preset with the size options applied."""
    cfg = get_arch(DEMO_MODEL).with_overrides(dtype=DTYPES[args.dtype])
    if args.scale is not None:
        if args.scale <= 0:
            raise SystemExit("reshard demo: --scale must be > 0")
        quantum = 64 * (args.tp or 2)
        try:
            vocab = max(quantum, round(cfg.vocab * args.scale / quantum) * quantum)
            layers = max(1, round(cfg.layers * args.scale))
        except OverflowError:
            raise SystemExit(f"reshard demo: --scale {args.scale:g} makes the model too big to count") from None
        cfg = cfg.with_overrides(layers=layers, vocab=vocab)
    return cfg.with_overrides(**{k: getattr(args, k) for k in SIZES})


def demo_config(args):
    """The :class:`~reshard.apps.demo.DemoConfig` of parsed ``reshard demo`` options (``SystemExit`` on a clash)."""
    from ..execution.methods import METHODS
    from .demo import DemoConfig, default_train

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SystemExit(f"reshard demo: unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    patterns = getattr(args, "hybrid_patterns", None)
    if patterns is not None:
        if "hybrid" not in methods:
            raise SystemExit("reshard demo: --hybrid-patterns is the rule of the hybrid method; add hybrid to --methods")
        patterns = tuple(p.strip() for p in patterns.split(",") if p.strip())
    cap = cap_bytes(args.max_bucket_mb, "--max-bucket-mb")
    common = dict(colocate=args.colocate, source_dtype=DTYPES[args.source_dtype] if args.source_dtype else None,
                  max_bucket_bytes=cap, repeat=args.repeat, seed=args.seed,
                  methods=methods, progress=not args.quiet, domain_size=args.domain_size, hybrid_patterns=patterns)
    if args.model is None:  # the built-in demo: FSDP2 training, torch tensor parallel inference replicas
        given = [f"--{o}" for o in ("train", "infer") if getattr(args, o) is not None]
        if given:
            raise SystemExit(f"reshard demo: {', '.join(given)} needs --model")
        sources, tp, dp = args.sources or 4, args.tp or 2, args.dp or 2
        model = model_from_args(args)
        return DemoConfig(model=DEMO_MODEL, train=f"fsdp:dp{sources}", infer=f"dtensor:tp{tp},dp{dp}",
                          arch_overrides=tuple((f, getattr(model, f)) for f in SIZES + ("dtype",)), **common)
    clash = [f"--{o}" for o in ("sources", "tp", "dp", "scale") if getattr(args, o) is not None]
    if clash:
        raise SystemExit(f"reshard demo: {', '.join(clash)} cannot be used with --model; set the ranks with "
                         f"--train and --infer")
    overrides = tuple((k, getattr(args, k)) for k in SIZES if getattr(args, k) is not None)
    cfg = DemoConfig(model=args.model, tiny=args.tiny, arch_overrides=overrides + (("dtype", DTYPES[args.dtype]),),
                     **common)
    return replace(cfg, train=args.train or default_train(cfg.arch), infer=args.infer or "tp2")


def _demo(args) -> int:
    from rich.console import Console

    from ..tensors import LayoutError
    from .demo import header_line, preflight

    console = Console()
    try:
        cfg = demo_config(args)
        lay = preflight(cfg)  # the model fits this machine, every method plans under the cap
    except SystemExit as e:
        console.print(str(e), style="red", highlight=False, soft_wrap=True)
        return 2
    except (LayoutError, ValueError) as e:
        console.print(f"reshard demo: {e}", style="red", highlight=False, soft_wrap=True)
        return 2
    console.print(header_line(cfg, lay), highlight=False)
    return _run_and_report(cfg, args, console)


def _run_and_report(cfg, args, console) -> int:
    from .demo import DemoFailed, failures, print_report, run_demo

    try:
        result = run_demo(cfg)
    except DemoFailed as e:
        console.print(f"[bold red]reshard demo failed[/]: {e}")
        return 1
    print_report(result, console)
    if args.json:
        _write_json(args.json, result)
    return 1 if failures(result) else 0


def _plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help="plan a whole model's refit between two parallel configurations and summarize it",
        description=(
            "Build the training-side layout (Megatron-Core or FSDP2) and the inference-side layout (vLLM) of a "
            "named model, plan the refit, and print what moves: tensors, pieces, bytes by category, per-rank "
            "maximum send and receive with the balance, and the bytes gather-and-broadcast would move. "
            "Nothing is run and no process group is formed. Example: reshard plan --model deepseek-v3 "
            "--train tp1,ep16,pp4,dp2 --infer tp8,dp16"),
    )
    p.add_argument("--model", required=True, choices=sorted(PRESETS), metavar="MODEL",
                   help=f"model preset, one of: {', '.join(sorted(PRESETS))}")
    p.add_argument("--train", required=True, metavar="SPEC",
                   help="training parallelism: Megatron sizes like tp1,ep16,pp4,dp2 (with ep > 1, dp counts "
                        "replicas of the expert grid: world = etp x ep x pp x dp; else world = tp x cp x pp x dp), "
                        "or fsdp:dp64[,tp8][,hsdp2] for FSDP2; training ranks are 0..M-1")
    p.add_argument("--infer", required=True, metavar="SPEC",
                   help="inference parallelism (vLLM): tp8,dp16 = ONE vLLM deployment of 16 x 8 ranks with "
                        "data_parallel_size=16 (its MoE layers split over all 128 ranks); with "
                        "--independent-engines (or ',independent' in SPEC) 16 separate TP8 engines, each "
                        "holding the whole model; add ep for expert parallel; dtensor:tp2,dp2 for torch tensor "
                        "parallel replicas; inference ranks are M..M+N-1")
    p.add_argument("--independent-engines", action="store_true",
                   help="read the vLLM spec's dp as that many independent engines (as most RL stacks run "
                        "them), not one deployment with data_parallel_size=dp")
    p.add_argument("--max-bucket-mb", type=_cap_mb, default=0,
                   help="staging cap per rank in MiB: the most a rank stages at once; the plan's rounds get half "
                        "of it each (two are in flight), so the plan stages what a refit session given the same "
                        "cap stages (default: none)")
    p.add_argument("--no-baseline", action="store_true", help="skip the gather-and-broadcast byte count")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                   help="destination precision: bf16 (default: the inference layout's dtype, as vLLM loads it) or "
                        "fp8 (e4m3 with one float32 scale per 128x128 block for the linear weights; routers, norms, "
                        "embeddings and the head kept): plans the refit straight into FP8 engines, each block "
                        "quantized where it is whole (a source rank, else the destination); the tables and --json "
                        "report its wire bytes, by precision (fp8, scales, raw, other), and where blocks are "
                        "quantized; a destination split through a block is an error naming the tensor")
    p.add_argument("--plot", metavar="DIR", nargs="?", const=DEFAULT_OUT, default=None,
                   help="also write two PNGs to DIR (default when DIR is left out: ./" + DEFAULT_OUT + "): bytes "
                        "per (source, destination) rank pair as a heat map, and each GPU's load on NIC out/in and "
                        "NVLink out/in (seconds at link bandwidth) with the bottleneck marked, for the refit "
                        "reshard runs on --topology (over NVLink domains: network once per domain, then NVLink); "
                        "prints their paths and the modeled time")
    p.add_argument("--topology", metavar="NAME_OR_FILE", default=None,
                   help="model the refit on this machine: a preset (dgx-h100, gb200-nvl72, cpu) or a .json/.yaml "
                        "file of Topology fields (see docs/cost_model.md); training ranks on GPUs 0..M-1, "
                        "inference ranks from the next NVLink domain; prints the modeled times (reshard "
                        "hierarchical and direct, the hybrid, gather-and-broadcast fair and naive), the lower "
                        "bound and its binding term (default for --plot: dgx-h100)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout instead of tables: model, train, infer, engines, "
                        "tensors, wire_bytes (reshard's direct plan), max_send_bytes / max_recv_bytes (per "
                        "rank), gather_broadcast_bytes ({gather, broadcast}), fingerprint; with --topology also "
                        "topology, fits, does_not_fit, modeled_s ({hierarchical, direct, hybrid, "
                        "gather_broadcast (best implementation), gather_broadcast_naive}, seconds, null where "
                        "not modeled), lower_bound_s (domain ingress over all of a domain's NICs), "
                        "lower_bound_term, lower_bound_job_s (over the job's NICs only), ours_over_bound, speedup (ours vs "
                        "hybrid, gather_broadcast, gather_broadcast_naive), bottleneck, cross_domain_bytes; "
                        "rounds use a 2 GiB staging cap (1 GiB rounds) unless --max-bucket-mb is set, broadcasts 1 GiB buckets; "
                        "always precision, wire_bytes_by_precision ({fp8, scales, raw, other}), wire_bytes_by_dtype, "
                        "blocks ({at_source, at_destination}) and bf16_wire_bytes (the BF16 plan's, to compare)")
    p.set_defaults(func=_plan, check=_check_plan, parser=p)
    return p


def _plan(args) -> int:
    """``reshard plan``: build the report (:mod:`reshard.apps.plan_report`), then print it or its JSON."""
    import json

    from rich.console import Console

    from ..tensors import LayoutError
    from .plan_report import (build_model_report, build_plan_report, plan_record, render_does_not_fit,
                              render_model_report, render_plan_report, render_plots)

    console = Console(stderr=args.json)
    topo = None
    try:
        if args.topology is not None or args.plot is not None:
            from ..modeling.topology import Topology

            try:
                topo = Topology.resolve(args.topology or "dgx-h100")
            except ValueError as e:
                raise ValueError(f"--topology: {e}") from None
        cap = cap_bytes(args.max_bucket_mb, "--max-bucket-mb")
        report = build_plan_report(args.model, args.train, args.infer, independent_engines=args.independent_engines,
                                   precision=args.precision, max_bucket_bytes=cap, baseline=not args.no_baseline)
    except (LayoutError, ValueError) as e:
        console.print(f"reshard plan: {e}", style="red", highlight=False, soft_wrap=True)
        return 2
    if not args.json:
        render_plan_report(report, console)
    modeled = None
    if topo is not None:
        modeled = build_model_report(report, topo, figures=args.topology is not None, plots=args.plot is not None)
        if modeled.does_not_fit is not None:
            render_does_not_fit(modeled, console)
        else:
            if modeled.figures is not None and not args.json:
                render_model_report(modeled, console)
            if args.plot is not None:
                paths = modeled.refit_model.write_plots(args.plot, report.plot_stem, args.model)
                render_plots(modeled, paths, console)
    if args.json:
        print(json.dumps(plan_record(report, modeled), indent=1))
    return 0


def _simulate_parser(sub) -> argparse.ArgumentParser:
    from .simulate import CASES

    p = sub.add_parser(
        "simulate", help="model refit times at cluster scale beside the published figures (table + PNG)",
        description=(
            "For each case, build the real training (Megatron-Core or FSDP2) and inference (vLLM) layouts of the model, "
            "plan the refit directly and in phases over NVLink domains, and model the time of both on the "
            "case's machine, beside the hybrid NeMo RL ships (FFN and experts by reshard, the rest broadcast), "
            "gather-and-broadcast as its best implementations run it and its naive single-root form, the "
            "physical lower bound, and the published figure. Rows follow the published engine arrangement "
            "where the source states it (independent engines: each holds the whole model) and say where our "
            "model differs from the published setup; a layout whose weights exceed a GPU's memory is reported "
            "as not fitting. The Kimi-K2 rows refit FSDP2 BF16 training into FP8 engines, as published "
            "(--precision sets every row's destination precision). Pure computation: no process group, no GPU. The biggest case (a 2.4 T-parameter "
            "MoE on 1024 + 1024 GPUs) takes about a minute here."),
    )
    p.add_argument("--cases", default=",".join(c.key for c in CASES),
                   help="comma-separated, from: " + ", ".join(c.key for c in CASES) + " (default: all)")
    p.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                   help="folder for the chart (default ./%(default)s)")
    p.add_argument("--png", metavar="PATH", default=None,
                   help="chart path (default: OUT/simulate.png; '' for no chart)")
    p.add_argument("--bucket-mb", type=_positive_number, default=2048,
                   help="staging cap per GPU in MiB: the most a GPU stages at once, two rounds in flight sharing it, "
                        "as a refit session given the same cap (default %(default)s: rounds of 1 GiB)")
    p.add_argument("--json", default=None,
                   help="also write the results as JSON here: per case the fields of `reshard plan --json`")
    p.add_argument("--precision", choices=("bf16", "fp8"), default=None,
                   help="destination precision of every row: bf16 or fp8 (e4m3, 128x128 block scales, as "
                        "`reshard plan --precision`); default: each case's own (the Kimi-K2 rows fp8, as "
                        "published; the others bf16). A layout FP8 cannot take is reported "
                        "in its row")
    p.set_defaults(func=_simulate, check=_check_simulate, parser=p)
    return p


def _simulate(args) -> int:
    from rich.console import Console

    from .simulate import CASES, plot, render, simulate_case, to_json

    console = Console(width=max(Console().width, 160))
    keys = [k.strip() for k in args.cases.split(",") if k.strip()]
    known = {c.key: c for c in CASES}
    unknown = [k for k in keys if k not in known]
    if unknown:
        console.print(f"reshard simulate: unknown case {unknown[0]!r}; known: {', '.join(known)}", style="red",
                      soft_wrap=True)
        return 2
    results = []
    cap = cap_bytes(args.bucket_mb, "--bucket-mb", none=False)
    for k in keys:
        with console.status(f"planning and modeling {k} ..."):
            results.append(simulate_case(known[k], max_bucket_bytes=cap, precision=args.precision))
    what = f"{args.precision.upper()} destination" if args.precision else "destination precision per case"
    render(results, console, f"modeled refit time (staging cap {args.bucket_mb:g} MiB per GPU; {what})")
    png = f"{args.out}/simulate.png" if args.png is None else args.png
    if png:
        console.print(f"wrote {plot(results, png)}", highlight=False)
    if args.json:
        _write_json(args.json, [to_json(r) for r in results])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reshard",
        description="M-to-N weight resharding (refit) between training and inference ranks on torch.distributed.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _demo_parser(sub)
    _plan_parser(sub)
    _simulate_parser(sub)
    from .rl.cli import add_parser as _rl_demo_parser  # issue 12: `reshard rl-demo` (src/reshard/apps/rl/)

    _rl_demo_parser(sub)
    return parser


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split("\n")) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user's mistake ends in one line on stderr and status 2, not a traceback.

    Options are checked (ranges, output paths) before anything is planned, spawned or written; a
    ``ValueError`` (``LayoutError`` included) that the command's own reporting lets through is
    printed as ``reshard COMMAND: error: ...``, the way argparse prints a bad option.
    """
    args = build_parser().parse_args(argv)
    try:
        args.check(args)
    except ValueError as e:
        args.parser.error(_one_line(e))
    try:
        return args.func(args)
    except ValueError as e:
        print(f"{args.parser.prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
