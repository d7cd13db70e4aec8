"""``reshard rl-demo``: GRPO on a tiny Qwen3, FSDP2 trainers -> vLLM rollouts, a refit after every update.

Prints each step as it goes, then the step-time table (per refit method and phase) and the reward
curve (with ``--control``: beside a run with the refit switched off; with ``--async``: the
synchronous run, then the asynchronous one, one-step off-policy, and one table of both); writes ``rl_step_time.png``,
``rl_reward.png``, ``rl_run.json`` (every step) and ``rl_actors.log`` (the actors' output) to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from .orchestrate import LOCAL, ORCHESTRATORS
from .policy import REFIT_METHODS

DEFAULT_OUT = "reshard-out"


def _methods(s: str) -> tuple[str, ...]:
    methods = tuple(m.strip() for m in s.split(",") if m.strip())
    bad = [m for m in methods if m not in REFIT_METHODS]
    if bad or not methods:
        raise argparse.ArgumentTypeError(f"refit methods from {', '.join(REFIT_METHODS)}, got {s!r}")
    return methods


def _default_methods() -> str:
    return ",".join(REFIT_METHODS)


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``rl-demo`` subcommand on ``sub`` (the ``reshard`` command's subparsers)."""
    from .loop import RLConfig

    d = RLConfig()
    p = sub.add_parser(
        "rl-demo", help="a real RL loop (GRPO, FSDP2 trainers, vLLM rollouts) refitted by reshard and its baselines",
        description=(
            "GRPO on a tiny random Qwen3 (2 layers, hidden 64; its tokenizer made here, nothing downloaded): the "
            "policy trains under FSDP2 on gloo trainer ranks with AdamW; a vLLM engine (TP=2, backend 'reshard') "
            "generates the rollouts; after every update the weights are refitted into the engine, the methods "
            "taking turns step by step: reshard, hybrid (FFN by reshard, the rest gathered and broadcast), "
            "gather-and-broadcast into vLLM's load_weights, and a checkpoint the engine reloads. The task: use "
            "the tokenizer's word pieces (reward = their share of the completion). Every rollout carries the "
            "weight version it was sampled with; a batch never mixes versions. Prints the step time per method "
            "and phase, and the reward curve; with --control, beside a run whose engine never gets new weights."),
    )
    p.add_argument("--steps", type=int, default=d.steps, help="RL steps (default %(default)s)")
    p.add_argument("--methods", type=_methods, default=None,
                   help="refit methods, in turn, comma-separated, from " + ", ".join(REFIT_METHODS) +
                        " (default: all that this reshard has)")
    p.add_argument("--orchestrator", choices=ORCHESTRATORS, default=LOCAL,
                   help="local processes, or Ray actors in placement groups (default %(default)s)")
    p.add_argument("--no-refit", action="store_true", help="the control only: the engine never gets new weights")
    p.add_argument("--control", action="store_true", help="after the run, the same run with the refit switched off")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="after the synchronous run, the asynchronous one (one-step off-policy: generation of step "
                        "k+1 overlaps training of step k, the refit overlaps both; staleness at most 1) and a table "
                        "of both per method")
    p.add_argument("--engines", type=int, default=d.engines,
                   help="vLLM engines (local processes), each step's prompts split over those serving; with more "
                        "than one, or with --chaos, the loop of reshard.apps.rl.chaos_loop runs (refit: reshard) "
                        "(default %(default)s)")
    p.add_argument("--chaos", metavar="SPEC", default=None,
                   help="faults and membership changes from a seeded schedule, e.g. 'kill-engine@3:1,stall-engine@6,"
                        "trainer-raise@8,corrupt@10,trainer-stall@12,grow@4,shrink@14,seed=1' or 'kill-engine=0.1' "
                        "(KIND@STEP[:TARGET], KIND=RATE, seed=N, stall=SECONDS; docs/rl_chaos.md); after the run, "
                        "the same run without faults, for goodput")
    p.add_argument("--gen-timeout", type=float, default=d.gen_timeout_s,
                   help="with several engines: one engine's share of a batch; past it the engine is fenced and "
                        "replaced, s (default %(default)s)")
    p.add_argument("--refit-timeout", type=float, default=d.refit_timeout_s,
                   help="with several engines: the refit session's timeout, s (default %(default)s)")
    p.add_argument("--verify", action="store_true",
                   help="after every refit, check the engine's bytes against a reference refit (slower)")
    p.add_argument("--trainers", type=int, default=d.trainers, help="FSDP2 trainer ranks (default %(default)s)")
    p.add_argument("--tp", type=int, default=d.tp, help="the vLLM engine's tensor parallel size (default %(default)s)")
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts per step (default %(default)s)")
    p.add_argument("--group", type=int, default=d.group, help="completions per prompt (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per completion (default %(default)s)")
    p.add_argument("--hidden", type=int, default=d.hidden,
                   help="the policy's hidden size (MLP 2x; attention 4 heads of 32) (default %(default)s)")
    p.add_argument("--layers", type=int, default=d.layers, help="the policy's decoder layers (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="bound on every call, s (default %(default)s)")
    p.add_argument("--out", metavar="DIR", default=DEFAULT_OUT, help="output folder (default ./%(default)s)")
    p.set_defaults(func=run_command, check=check, parser=p)
    return p


def fleet(args) -> bool:
    """Whether the run is the chaos loop's (several engines, or faults)."""
    return args.engines > 1 or args.chaos is not None


def config(args, *, refit: bool | None = None, asynchronous: bool = False, chaos: str | None = None,
           engines: int | None = None):
    from .loop import RLConfig

    default = _methods("reshard" if fleet(args) else _default_methods())
    return RLConfig(steps=args.steps, methods=args.methods or default,
                    refit=(not args.no_refit) if refit is None else refit, orchestrator=args.orchestrator,
                    asynchronous=asynchronous, engines=args.engines if engines is None else engines, chaos=chaos,
                    gen_timeout_s=args.gen_timeout, refit_timeout_s=args.refit_timeout,
                    trainers=args.trainers, tp=args.tp, prompts=args.prompts, group=args.group,
                    max_tokens=args.max_tokens, hidden=args.hidden, layers=args.layers, lr=args.lr, seed=args.seed, verify=args.verify,
                    timeout_s=args.timeout)


def check(args) -> None:
    """Options checked before anything starts (a ``ValueError`` names the bad one)."""
    config(args, chaos=args.chaos, asynchronous=args.asynchronous and fleet(args))
    if args.control and args.no_refit:
        raise ValueError("--control adds a run without refit; --no-refit runs only that one")
    if args.asynchronous and args.no_refit:
        raise ValueError("--async refits after every step; --no-refit runs only the control")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out}: not a folder")


def _one_run(console, cfg, name: str, log: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .async_loop import run as run_async
    from .chaos_loop import run as run_fleet
    from .loop import run

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[last]}"), console=console, transient=False) as progress:
        task = progress.add_task(f"{name}: starting", total=cfg.steps, last="")

        def on_step(s) -> None:
            pause = f", pause {s.pause * 1000:.0f} ms" if s.pause is not None else ""
            progress.console.print(
                f"  step {s.step:>3}  v{s.version:<3} reward {s.reward:.3f}  gen {s.generation * 1000:5.0f} ms  "
                f"train {s.training * 1000:5.0f} ms  refit {s.method:<16} {s.refit * 1000:5.0f} ms{pause}"
                f"{f', blocked {s.blocked * 1000:.0f} ms' if cfg.asynchronous else ''}"
                f"{'  (warm-up)' if s.warmup else ''}", highlight=False)
            progress.update(task, advance=1, description=f"{name}: training", last=f"reward {s.reward:.3f}")

        result = (run_fleet if cfg.fleet else run_async if cfg.asynchronous else run)(cfg, on_step=on_step, log=log,
                     on_status=lambda m: progress.update(task, description=f"{name}: {m}"))
        progress.update(task, description=f"{name}: done")
    return result


def run_command(args) -> int:
    from rich.console import Console

    from . import report

    # vLLM's engine processes register shared memory with this process's multiprocessing resource tracker
    # (the local actors are its children); when vLLM force-kills its EngineCore at shutdown, the tracker
    # unlinks what is left and warns. Nothing leaks: keep that warning off the demo's output.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning:multiprocessing.resource_tracker")
    console = Console(width=max(Console().width, 150))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = str(out / "rl_actors.log")
    Path(log).write_text("")
    console.print(f"machine: {os.cpu_count()} CPUs, {platform.machine()}, python {platform.python_version()}; "
                  f"actors' output in {log}", highlight=False)
    start = time.perf_counter()
    if fleet(args):
        return _fleet_command(console, args, out, log, start)
    runs = {}
    main = config(args)
    name = ("sync" if args.asynchronous else "refit") if main.refit else "no refit"
    runs[name] = _one_run(console, main, name, log)
    if args.asynchronous:
        runs["async"] = _one_run(console, config(args, asynchronous=True), "async", log)
    if args.control:
        runs["no refit"] = _one_run(console, config(args, refit=False), "no refit (control)", log)
    for name, r in runs.items():
        console.print(f"reward, {name}: {report.reward_summary(r)}; startup {r.startup_s:.0f} s", highlight=False)
    console.print(report.reward_table(runs))
    with_refit = runs.get("refit") or runs.get("sync")
    files = [report.plot_rewards(runs, out / "rl_reward.png")]
    if args.asynchronous:
        _print_comparison(console, runs)
    elif with_refit is not None:
        console.print(report.timing_table(with_refit))
        console.print("generation: the engine's rollouts; training: one FSDP2 GRPO step; refit: the trainers' call "
                      "until the engine serves the new version; other: rewards, advantages, calls; engine pause: "
                      "the engine's own window, from pausing to resuming. Connections: "
                      + ", ".join(f"{m} {s:.2f} s" for m, s in with_refit.connect_s.items()), highlight=False)
        console.print(report.pause_table(with_refit))
    if with_refit is not None:
        files.append(report.plot_step_times(with_refit, out / "rl_step_time.png"))
    return _write_json(console, runs, files, out, start)


def _write_json(console, runs: dict, files: list, out: Path, start: float) -> int:
    """Every run's records in ``rl_run.json``; the files written and the total time, printed."""
    (out / "rl_run.json").write_text(json.dumps({k: r.to_json() for k, r in runs.items()}, indent=1))
    files.append(out / "rl_run.json")
    for f in files:
        console.print(f"wrote {f}", highlight=False)
    console.print(f"total {time.perf_counter() - start:.0f} s", highlight=False)
    return 0


def _fleet_command(console, args, out: Path, log: str, start: float) -> int:
    """Several engines, with faults (``--chaos``): the chaos run, the same run without faults, and with
    ``--control`` the one-engine run without refit; their tables, the picture, the JSON."""
    from . import chaos_report, report

    runs, label = {}, " (async)" if args.asynchronous else ""
    if args.chaos is not None:
        runs["chaos"] = _one_run(console, config(args, chaos=args.chaos, asynchronous=args.asynchronous),
                                 f"chaos{label}", log)
    runs["fault-free"] = _one_run(console, config(args, asynchronous=args.asynchronous), f"fault-free{label}", log)
    if args.control:
        runs["no refit"] = _one_run(console, config(args, refit=False, engines=1), "no refit (control, 1 engine)",
                                    log)
    for name, r in runs.items():
        console.print(f"reward, {name}: {report.reward_summary(r)}; startup {r.startup_s:.0f} s", highlight=False)
    console.print(report.reward_table(runs))
    clean = runs["fault-free"]
    files = []
    if "chaos" in runs:
        chaotic = runs["chaos"]
        console.print(chaos_report.fault_table(chaotic))
        console.print(chaos_report.step_table(chaotic, clean))
        console.print(chaos_report.goodput_table(chaotic, clean))
        rates = chaos_report.throughput_by_engines(chaotic)
        if not args.asynchronous:  # async: a batch's generation is hidden behind the training, not timed alone
            console.print("generation throughput by engines serving (median tokens/s of the steps without a fault in "
                          "their generation): " + ", ".join(f"{n} engine{'s' if n > 1 else ''}: {r:.0f}"
                                                            for n, r in rates.items()), highlight=False)
        console.print(chaos_report.checks_line(chaotic), highlight=False)
        files.append(chaos_report.plot(runs, out / "rl_chaos.png"))
    console.print(chaos_report.checks_line(clean).replace("checks:", "checks (fault-free):", 1), highlight=False)
    files.append(report.plot_rewards(runs, out / "rl_reward.png"))
    return _write_json(console, runs, files, out, start)


def _print_comparison(console, runs: dict) -> None:
    from . import report

    console.print(report.compare_table({k: runs[k] for k in ("sync", "async")}))
    steps = runs["async"].steps
    stale = {n: sum(s.staleness == n for s in steps) for n in sorted({s.staleness for s in steps})}
    waits = sum(int(s.timeline.get("guard_waits", 0)) for s in steps)
    console.print(
        "generation: the engine generating the batch the step trains (async: in the background, beside the training "
        "before it); training: the trainers' GRPO step (async: its optimizer step waits for a refit in flight); "
        "refit: from its start to the engine serving the new version; engine pause: the engine's own window, pausing "
        "to resuming (staged: the apply step); trainer blocked: the trainers inside the refit's calls or waiting for "
        "it (the slowest rank); step: the driver's step; staleness: updates between the weights that sampled the "
        "batch and the trainer's. async: every batch one version, the one it asked for; staleness per step "
        + ", ".join(f"{n}: {c} steps" for n, c in stale.items())
        + f"; optimizer steps that waited for a refit (reshard's guard): {waits}", highlight=False)
    for name in ("sync", "async"):
        console.print(report.pause_table(runs[name], title=f"{name}: "))


__all__ = ["add_parser", "check", "config", "run_command"]
