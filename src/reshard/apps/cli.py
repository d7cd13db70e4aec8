"""Command line: ``reshard demo``, ``reshard plan`` and ``reshard simulate`` (also ``python -m reshard ...``).

This module runs the commands; their flags (parsers, argparse types, the checks before a command
starts, the :class:`~reshard.options.RefitOptions` a command makes of them) are in
:mod:`reshard.apps.cli_args`. Pictures go to an output folder, ``reshard-out/`` under the current
directory unless told (``reshard plan --plot [DIR]``, ``reshard simulate --out DIR``); the paths are
printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from ..models.arch import DEMO_MODEL, Arch, get_arch
from ..planning.methods import AUTO, HYBRID, RESHARD
from .small_pages import small_pages
from .cli_args import (DTYPES, SIZES, cap_bytes, demo_parser, output_problem, plan_parser, refit_options,
                       simulate_parser, staging_cap)


def _write_json(path: str, data) -> None:
    import json

    Path(path).absolute().parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


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
    """The :class:`~reshard.apps.demo.DemoConfig` of parsed ``reshard demo`` options: ``SystemExit`` on a clash
    of flags, an :class:`~reshard.errors.OptionsError` naming the flag for a value a refit option refuses.
    Which methods exist, and everything else about the config, :func:`~reshard.apps.demo.preflight` checks."""
    from .demo import DemoConfig, default_train

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    patterns = args.hybrid_patterns
    if patterns is not None:
        if HYBRID not in methods:
            raise SystemExit("reshard demo: --hybrid-patterns is the rule of the hybrid method; add hybrid to "
                             "--methods")
        patterns = tuple(p.strip() for p in patterns.split(",") if p.strip())
    # the refit flags as one RefitOptions (the hybrid method's where its rule is given); the demo makes
    # each method's options (DemoConfig.method_options) from the values it holds
    options = refit_options(HYBRID if patterns is not None else AUTO,
                            max_bucket_bytes=staging_cap(args.max_bucket_mb, "--max-bucket-mb"),
                            hybrid_rule=("--hybrid-patterns", patterns))
    common = dict(colocate=args.colocate, source_dtype=DTYPES[args.source_dtype] if args.source_dtype else None,
                  max_bucket_bytes=options.max_bucket_bytes, repeat=args.repeat, seed=args.seed,
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
    except SystemExit as error:
        console.print(str(error), style="red", highlight=False, soft_wrap=True)
        return 2
    except (LayoutError, ValueError) as error:  # OptionsError included: it names the flag
        console.print(f"reshard demo: {error}", style="red", highlight=False, soft_wrap=True)
        return 2
    console.print(header_line(cfg, lay), highlight=False)
    return _run_and_report(cfg, args, console)


def _run_and_report(cfg, args, console) -> int:
    from .demo import DemoFailed, failures, print_report, run_demo

    try:
        result = run_demo(cfg)
    except DemoFailed as error:
        console.print(f"[bold red]reshard demo failed[/]: {error}")
        return 1
    print_report(result, console)
    if args.json:
        _write_json(args.json, result)
    return 1 if failures(result) else 0


@small_pages()  # planning commands: numpy's arrays in small pages (the workers they start too)
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
            except ValueError as error:
                raise ValueError(f"--topology: {error}") from None
        # the refit the report plans: reshard's direct plan, under the staging cap and the dtype policy
        # (--precision bf16 is the inference layout's own dtype: no policy)
        options = refit_options(RESHARD, max_bucket_bytes=staging_cap(args.max_bucket_mb, "--max-bucket-mb"),
                                precision=("--precision", None if args.precision == "bf16" else args.precision))
        report = build_plan_report(args.model, args.train, args.infer, independent_engines=args.independent_engines,
                                   options=options, baseline=not args.no_baseline,
                                   assemble_domain=(topo.gpus_per_domain if topo is not None else 8),
                                   second_core=True)
    except (LayoutError, ValueError) as error:  # OptionsError included: it names the flag
        console.print(f"reshard plan: {error}", style="red", highlight=False, soft_wrap=True)
        return 2
    if not args.json:
        render_plan_report(report, console)
    modeled = None
    if topo is not None:
        modeled = build_model_report(report, topo, figures=args.topology is not None, plots=args.plot is not None,
                                     second_core=True)
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


@small_pages()
def _simulate(args) -> int:
    from rich.console import Console

    from .simulate import CASES, default_jobs, plot, progress_line, render, simulate_cases, to_json

    console = Console(width=max(Console().width, 160))
    keys = [k.strip() for k in args.cases.split(",") if k.strip()]
    known = {c.key: c for c in CASES}
    unknown = [k for k in keys if k not in known]
    if unknown:
        console.print(f"reshard simulate: unknown case {unknown[0]!r}; known: {', '.join(known)}", style="red",
                      soft_wrap=True)
        return 2
    # the modeled refits' options: the staging cap per GPU (an OptionsError naming --bucket-mb reaches main);
    # --precision is not among them: it overrides each case's own destination precision (None: the case's)
    options = refit_options(AUTO, max_bucket_bytes=staging_cap(args.bucket_mb, "--bucket-mb", none=False))
    jobs = default_jobs(len(keys)) if args.jobs is None else min(args.jobs, len(keys))
    start, done = time.perf_counter(), []

    def finished(result) -> None:  # each row as it is done: the small ones show in seconds
        done.append(result)
        console.print(progress_line(result, len(done), len(keys), time.perf_counter() - start), highlight=False,
                      soft_wrap=True)

    waiting = f"planning and modeling {len(keys)} case(s), {jobs} at a time ..."
    if len(keys) == 1:  # one row runs here: no spinner thread, so two of its baselines can go to a forked child
        console.print(waiting, highlight=False)
    with console.status(waiting) if len(keys) > 1 else nullcontext():
        results = simulate_cases([known[key] for key in keys], jobs=jobs, max_bucket_bytes=options.max_bucket_bytes,
                                 precision=args.precision, on_result=finished)
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
    demo_parser(sub).set_defaults(func=_demo)
    plan_parser(sub).set_defaults(func=_plan)
    simulate_parser(sub).set_defaults(func=_simulate)
    from .rl.cli import add_parser as _rl_demo_parser  # issue 12: `reshard rl-demo` (src/reshard/apps/rl/)

    _rl_demo_parser(sub)
    return parser


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split("\n")) or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user's mistake ends in one line on stderr and status 2, not a traceback.

    Options are checked (ranges, output paths) before anything is planned, spawned or written; a
    ``ValueError`` (``LayoutError`` included) that the command's own reporting lets through is
    printed as ``reshard COMMAND: error: ...``, the way argparse prints a bad option.
    """
    args = build_parser().parse_args(argv)
    try:
        args.check(args)
    except ValueError as error:
        args.parser.error(_one_line(error))
    try:
        return args.func(args)
    except ValueError as error:
        print(f"{args.parser.prog}: error: {_one_line(error)}", file=sys.stderr)
        return 2


PLANNING_COMMANDS = ("plan", "simulate")  # they hold millions of objects when done, and start no service


def run() -> None:
    """The ``reshard`` command: :func:`main`, then exit. A planning command then leaves without freeing
    its layouts and plans one object at a time (0.8-0.9 s of teardown measured after planning DeepSeek-V3);
    its output is flushed first, and it has no exit handlers of its own to run. Other commands exit as usual.
    """
    argv = sys.argv[1:]
    status = main(argv)
    if argv[:1] and argv[0] in PLANNING_COMMANDS:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:  # a closed pipe: the usual exit reports it
            sys.exit(status)
        os._exit(status)
    sys.exit(status)


__all__ = ["PLANNING_COMMANDS", "build_parser", "cap_bytes", "demo_config", "main", "model_from_args",
           "output_problem", "run"]


if __name__ == "__main__":  # pragma: no cover
    run()
