"""Tables and pictures of RL runs: step time per refit method and phase, and the reward curve.

* :func:`timing_table`: per method, mean ± standard deviation over its steps (warm-up steps left
  out) of each phase (generation, training, refit, other), the engine's pause window and the step;
  the refit's ratio to ``reshard``'s.
* :func:`pause_table`: the engine's pause window per method, split by the weight-sync calls in it.
* :func:`compare_table`: synchronous against asynchronous runs, per method: generation, training,
  refit, engine pause, trainer blocked, step, and how each refit ran.
* :func:`reward_table`: the mean reward per block of steps, with refit and in the control.
* :func:`plot_step_times`: stacked bars of the mean phases per method (PNG).
* :func:`plot_rewards`: reward per step, with refit and in the control, beside a random policy's (PNG).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from rich.table import Table

from .loop import PHASES, RunResult, StepRecord

COLORS = {"generation": "#4c78a8", "training": "#f58518", "refit": "#e45756", "other": "#bab0ac"}


def timed_steps(result: RunResult) -> dict[str, list[StepRecord]]:
    """The steps that count for timing (no warm-up), by method, in the run's method order."""
    out: dict[str, list[StepRecord]] = {m: [] for m in dict.fromkeys(s.method for s in result.steps)}
    for s in result.steps:
        if not s.warmup:
            out[s.method].append(s)
    return {m: v for m, v in out.items() if v}


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _cell(values: list[float | None], scale: float = 1000.0) -> str:
    vals = [v * scale for v in values if v is not None]
    if not vals:
        return "-"
    m, sd = mean_sd(vals)
    return f"{m:.0f} ± {sd:.0f}"


def timing_table(result: RunResult) -> Table:
    """Per method and phase: ms, mean ± sd over the method's timed steps."""
    by = timed_steps(result)
    table = Table(title=f"RL step time by refit method, ms: mean ± sd over steps (warm-up steps left out; "
                        f"hidden {result.config.hidden}, {result.config.layers} layers; "
                        f"{result.config.trainers} FSDP2 ranks -> vLLM TP={result.config.tp}, "
                        f"{result.config.orchestrator} actors)")
    for col in ("method", "steps", *PHASES, "refit x reshard", "engine pause", "step"):
        table.add_column(col, justify="left" if col == "method" else "right")
    base = statistics.fmean(s.refit for s in by["reshard"]) if "reshard" in by else None
    for method, steps in by.items():
        ratio = f"{statistics.fmean(s.refit for s in steps) / base:.2f}" if base else "-"
        table.add_row(method, str(len(steps)), *[_cell([getattr(s, p) for s in steps]) for p in PHASES], ratio,
                      _cell([s.pause for s in steps]), _cell([s.total for s in steps]))
    return table


CALLS = ("receive", "pause", "start", "update", "apply", "finish", "resume", "reload")
COMPARED = ("generation", "training", "refit", "pause", "blocked", "total")


def _how(result: RunResult, steps: list[StepRecord]) -> str:
    if not result.config.asynchronous:
        return "blocking"
    return "background, staged" if all(s.overlapped for s in steps) else "blocking (cannot overlap)"


def compare_table(runs: dict[str, RunResult]) -> Table:
    """Per method, one row per run (synchronous and asynchronous): ms, mean ± sd over timed steps."""
    first = next(iter(runs.values())).config
    table = Table(title=f"RL step time, synchronous vs asynchronous (one-step off-policy), ms: mean ± sd over "
                        f"steps (each method's first step and the async run's last left out; hidden {first.hidden}, "
                        f"{first.layers} layers; {first.trainers} FSDP2 ranks -> vLLM TP={first.tp}, "
                        f"{first.orchestrator} actors)")
    for col in ("method", "loop", "refit runs", "steps", "generation", "training", "refit", "engine pause",
                "trainer blocked", "step", "staleness"):
        table.add_column(col, justify="left" if col in ("method", "loop", "refit runs") else "right")
    by_run = {name: timed_steps(r) for name, r in runs.items()}
    methods = list(dict.fromkeys(m for by in by_run.values() for m in by))
    for method in methods:
        for name, result in runs.items():
            steps = by_run[name].get(method)
            if not steps:
                continue
            table.add_row(method, name, _how(result, steps), str(len(steps)),
                          *[_cell([getattr(s, c) for s in steps]) for c in COMPARED],
                          str(max(s.staleness for s in steps)))
    return table


def pause_table(result: RunResult, title: str = "") -> Table:
    """Per method: the engine's pause window split by the weight-sync calls inside it (ms, means; a staged
    receive's calls, outside the window, as ``receive``)."""
    by = timed_steps(result)
    table = Table(title=f"{title}the engine's pause window by call, ms (means; vLLM's pause and resume, the "
                        f"update's calls, a checkpoint's reload)")
    table.add_column("method")
    calls = [c for c in CALLS if any(c in s.engine_calls for steps in by.values() for s in steps)]
    for col in (*calls, "window"):
        table.add_column(col, justify="right")
    for method, steps in by.items():
        cells = [f"{statistics.fmean(s.engine_calls.get(c, 0.0) for s in steps) * 1000:.1f}" for c in calls]
        table.add_row(method, *cells, _cell([s.pause for s in steps]))
    return table


def reward_blocks(result: RunResult, size: int) -> list[tuple[int, int, float]]:
    """``(first step, last step, mean reward)`` per block of ``size`` steps."""
    steps = result.steps
    return [(steps[i].step, steps[min(i + size, len(steps)) - 1].step,
             statistics.fmean(s.reward for s in steps[i: i + size])) for i in range(0, len(steps), size)]


def reward_table(runs: dict[str, RunResult], size: int = 4) -> Table:
    """Mean reward per block of steps, one column per run (``{"refit": ..., "no refit": ...}``)."""
    table = Table(title=f"mean reward per block of {size} steps (random policy: "
                        f"{next(iter(runs.values())).random_reward:.2f})")
    table.add_column("steps")
    for name in runs:
        table.add_column(name, justify="right")
    blocks = {name: reward_blocks(r, size) for name, r in runs.items()}
    longest = max(blocks.values(), key=len)
    for i, (first, last, _) in enumerate(longest):
        table.add_row(f"{first}-{last}", *[f"{b[i][2]:.3f}" if i < len(b) else "" for b in blocks.values()])
    return table


def reward_summary(result: RunResult, k: int = 3) -> str:
    """``first k steps -> last k steps`` of the mean reward."""
    first = statistics.fmean(s.reward for s in result.steps[:k])
    last = statistics.fmean(s.reward for s in result.steps[-k:])
    return f"{first:.3f} (first {k} steps) -> {last:.3f} (last {k})"


def plot_step_times(result: RunResult, png: str | Path) -> Path:
    """Stacked bars: mean seconds of each phase per method, the step's sd as an error bar."""
    from ...modeling.plots import pyplot, save_figure

    plt = pyplot()

    by = timed_steps(result)
    methods = list(by)
    fig, ax = plt.subplots(figsize=(1.6 * len(methods) + 3, 4.2))
    bottom = [0.0] * len(methods)
    for phase in PHASES:
        heights = [statistics.fmean(getattr(s, phase) for s in by[m]) for m in methods]
        ax.bar(methods, heights, bottom=bottom, color=COLORS[phase], label=phase, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    sds = [mean_sd([s.total for s in by[m]])[1] for m in methods]
    ax.errorbar([i + 0.22 for i in range(len(methods))], bottom, yerr=sds, fmt="none", ecolor="black", capsize=3,
                linewidth=1)  # the step's sd, beside the bar's top
    for i, m in enumerate(methods):  # the refit's mean, written on its segment
        refit = statistics.fmean(s.refit for s in by[m])
        top = statistics.fmean(s.generation + s.training + s.refit for s in by[m])
        ax.annotate(f"refit {refit * 1000:.0f} ms", (i, top - refit / 2), ha="center", va="center", fontsize=8,
                    color="white" if refit > 0.08 * max(bottom) else "black")
    ax.set_ylabel("seconds per RL step (mean)")
    cfg = result.config
    ax.set_title(f"RL step time by refit method (hidden {cfg.hidden}, {cfg.layers} layers)\n{cfg.trainers} FSDP2 ranks -> vLLM TP={cfg.tp}, "
                 f"{cfg.orchestrator} actors, {cfg.prompts}x{cfg.group} rollouts of {cfg.max_tokens} tokens",
                 fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=len(PHASES), fontsize=8, frameon=False)
    return save_figure(fig, png, dpi=120)


def plot_rewards(runs: dict[str, RunResult], png: str | Path) -> Path:
    """Reward per step of each run, and the random policy's expected reward."""
    from ...modeling.plots import pyplot, save_figure

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, r in runs.items():
        ax.plot([s.step for s in r.steps], [s.reward for s in r.steps], marker="o", markersize=3, label=name)
    ax.axhline(next(iter(runs.values())).random_reward, color="grey", linestyle=":", label="random policy")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step's rollouts")
    ax.set_ylim(0, 1.05)
    ax.set_title("GRPO on a tiny Qwen3: the engine's reward, with and without refit", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, png, dpi=120)


__all__ = ["CALLS", "compare_table", "mean_sd", "pause_table", "plot_rewards", "plot_step_times", "reward_blocks", "reward_summary", "reward_table",
           "timed_steps", "timing_table"]
