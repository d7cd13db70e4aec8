"""What a chaos run cost: its faults, its steps beside a fault-free run's, goodput, and a picture.

Every figure comes from the runs' own records (``RunResult.chaos``, written by
:mod:`.chaos_loop`): nothing here is modeled. Goodput is useful trainer steps per hour of the loop
(from its first generation to the end of the last refit, engines still coming up then included),
as a share of the fault-free run's rate.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from rich.table import Table

from .loop import RunResult


def _s(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def loop_seconds(run: RunResult) -> float:
    """Seconds of the loop itself: every step, plus what ran after the last one (joiners caught up)."""
    return run.chaos.get("loop_s") or sum(s.total for s in run.steps)


def steps_per_hour(run: RunResult) -> float:
    return 3600.0 * len(run.steps) / loop_seconds(run)


def fault_table(run: RunResult) -> Table:
    """One row per fault or membership change: when it was seen, when the capacity was back."""
    table = Table(title="faults and membership changes (measured; s since the loop started)")
    for name in ("kind", "step", "target", "injected", "detected after", "recovered after", "updates lost",
                 "outcome"):
        table.add_column(name, justify="left" if name in ("kind", "target", "outcome") else "right")
    for f in run.chaos.get("faults", []):
        table.add_row(f["kind"], str(f["step"]), f["target"], _s(f["injected"]), _s(f["detection_s"]),
                      _s(f["recovery_s"]), str(f["steps_lost"]), f["outcome"])
    return table


def goodput_table(chaos_run: RunResult, clean: RunResult) -> Table:
    """Per fault kind: how many, detection and recovery, updates lost, the time of the steps it hit
    against the fault-free run's steps; then the goodput of the whole run."""
    clean_step = statistics.median(s.total for s in clean.steps[1:] or clean.steps)
    table = Table(title=f"goodput (measured): {len(chaos_run.steps)} steps with faults, {len(clean.steps)} without; "
                        f"a fault-free step takes {clean_step:.2f} s (median)")
    for name in ("fault", "count", "detection s", "recovery s", "updates lost", "its steps s",
                 "vs fault-free", "time lost s"):
        table.add_column(name, justify="left" if name == "fault" else "right")
    steps = {s.step: s for s in chaos_run.steps}
    faults = chaos_run.chaos.get("faults", [])
    for kind in dict.fromkeys(f["kind"] for f in faults):
        mine = [f for f in faults if f["kind"] == kind]
        hit = sorted({_hit_step(f, steps, chaos_run.config.asynchronous) for f in mine} - {None})
        times = [steps[k].total for k in hit]
        mean = statistics.fmean(times) if times else None
        lost = sum(t - clean_step for t in times) if times else None
        table.add_row(kind, str(len(mine)), _mean(f["detection_s"] for f in mine),
                      _mean(f["recovery_s"] for f in mine), str(sum(f["steps_lost"] for f in mine)),
                      _s(mean, 2), "-" if mean is None else f"{mean / clean_step:.2f}x", _s(lost))
    rate, clean_rate = steps_per_hour(chaos_run), steps_per_hour(clean)
    table.add_row("whole run", str(len(faults)), "", "", str(sum(f["steps_lost"] for f in faults)),
                  _s(loop_seconds(chaos_run) / len(chaos_run.steps), 2),
                  f"{(loop_seconds(chaos_run) / len(chaos_run.steps)) / (loop_seconds(clean) / len(clean.steps)):.2f}x",
                  _s(loop_seconds(chaos_run) - loop_seconds(clean) * len(chaos_run.steps) / len(clean.steps)))
    table.caption = (f"goodput: {rate:.0f} useful trainer steps per hour with faults, {clean_rate:.0f} without: "
                     f"{100 * rate / clean_rate:.0f} % of the fault-free rate")
    return table


def _hit_step(fault: dict, steps: dict, asynchronous: bool = False) -> int | None:
    """The step whose record shows a fault's cost: the one it was scheduled in (an engine fault fires as
    that step's batch starts; a trainer fault in that step's refit; a shrink's reconnect is in it). In
    the asynchronous loop batch k is generated beside step k-1's training, so an engine fault of step
    k shows in step k-1."""
    step = fault["step"] - (asynchronous and fault["kind"] in ("kill-engine", "stall-engine", "unplanned"))
    return step if step in steps else None


def _mean(values) -> str:
    values = [v for v in values if v is not None]
    return _s(statistics.fmean(values)) if values else "-"


def step_table(chaos_run: RunResult, clean: RunResult) -> Table:
    """Every step of the chaos run: engines generating, what happened, its phases, beside the fault-free
    run's step of the same number."""
    table = Table(title="step time with faults (measured, s), beside the fault-free run's step")
    for name in ("step", "engines", "events", "gen", "tok/s", "train", "refit", "reconnect", "attempts", "total",
                 "fault-free"):
        table.add_column(name, justify="left" if name in ("engines", "events") else "right")
    clean_total = {s.step: s.total for s in clean.steps}
    tokens = chaos_run.config.prompts * chaos_run.config.group * chaos_run.config.max_tokens
    for s, f in zip(chaos_run.steps, chaos_run.chaos.get("fleet", [])):
        events = "; ".join(e if len(e) < 70 else e[:67] + "..." for e in f["events"])
        # async: the batch is generated beside the training; gen is only the wait for it, not a rate
        rate = f"{tokens / s.generation:.0f}" if s.generation > 0.01 and not chaos_run.config.asynchronous else "-"
        table.add_row(str(s.step), ",".join(f["engines"]), events, f"{s.generation:.2f}", rate, f"{s.training:.2f}",
                      f"{s.refit:.2f}", f"{f['reconnect_s']:.2f}", str(f["refit_attempts"]), f"{s.total:.2f}",
                      _s(clean_total.get(s.step), 2))
    after = chaos_run.chaos.get("after_last_step") or []
    if after:
        table.caption = "after the last step: " + "; ".join(after)
    return table


def throughput_by_engines(run: RunResult) -> dict[int, float]:
    """Generation tokens per second (median over steps) by the number of engines that generated the
    step's batch (steps with a fault in their generation left out: their time includes the fault)."""
    tokens = run.config.prompts * run.config.group * run.config.max_tokens
    by: dict[int, list[float]] = {}
    for s, f in zip(run.steps, run.chaos.get("fleet", [])):
        if s.generation > 0.01 and not any(("fenced" in e or "caught" in e) for e in f["events"]):
            by.setdefault(len(f["engines"]), []).append(tokens / s.generation)
    return {n: statistics.median(v) for n, v in sorted(by.items())}


def checks_line(run: RunResult) -> str:
    """The checks of the run, in one line (each held, or the run would have raised)."""
    c = run.chaos
    final = c.get("final") or {}
    return (f"checks: {c.get('rollouts_checked', 0)} rollouts, each labelled with its engine's committed version "
            f"and that engine serving; one version per batch (staleness {sorted({s.staleness for s in run.steps})}); "
            f"every step under its bound of {c.get('step_bound_s', 0):.0f} s (longest "
            f"{max(s.total for s in run.steps):.1f} s); at the end engines {', '.join(final.get('engines', []))} "
            f"bit-equal to the trainer's version {final.get('version')} ({final.get('reference')}); processes "
            f"left after cleanup: {len(run.reaped)}")


def plot(runs: dict[str, RunResult], png: str | Path) -> Path:
    """Reward and step time against wall time (the loop's seconds), faults of the chaos run marked."""
    from ...modeling.plots import pyplot, save_figure

    plt = pyplot()

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.4), sharex=True)
    for name, run in runs.items():
        ends, t = [], 0.0
        for s in run.steps:
            t += s.total
            ends.append(t)
        top.plot(ends, [s.reward for s in run.steps], marker="o", markersize=3, label=name)
        bottom.plot(ends, [s.total for s in run.steps], marker="o", markersize=3, label=name)
    chaos_run = next((r for r in runs.values() if r.chaos.get("faults")), None)
    if chaos_run is not None:
        starts, t = {}, 0.0
        for s in chaos_run.steps:
            starts[s.step] = t
            t += s.total
        for f in chaos_run.chaos["faults"]:
            x = starts.get(_hit_step(f, starts, chaos_run.config.asynchronous) or 0, 0.0)
            for ax in (top, bottom):
                ax.axvline(x, color="red", alpha=0.3, linewidth=1)
            top.annotate(f["kind"], (x, 1.0), rotation=90, fontsize=6, va="top", color="red")
    top.axhline(next(iter(runs.values())).random_reward, color="grey", linestyle=":", label="random policy")
    top.set_ylabel("mean reward")
    top.set_ylim(0, 1.05)
    bottom.set_ylabel("step time, s")
    bottom.set_yscale("log")
    bottom.set_xlabel("wall time of the loop, s (measured on this machine)")
    top.set_title("GRPO on a tiny Qwen3 over several vLLM engines, with and without faults", fontsize=10)
    top.legend(fontsize=7)
    return save_figure(fig, png, dpi=120)


__all__ = ["checks_line", "fault_table", "goodput_table", "loop_seconds", "plot", "step_table", "steps_per_hour",
           "throughput_by_engines"]
