"""The asynchronous RL loop: one-step off-policy GRPO, the refit off the critical path.

Step ``k`` trains on batch ``k`` while the engine generates batch ``k + 1``, and the refit of the
weights after step ``k`` overlaps both the next training and the engine's serving::

    step k    driver                       trainers                        engine
    1         collect batch k              (refit k in flight)             batch k ends; apply k; resume
    2         submit batch k+1 (version k)                                 starts once it serves version k
    3         rewards, advantages
    4         train batch k                forward, backward; the          generates batch k+1
                                           optimizer step waits until
                                           refit k sent their shards
                                           (reshard's guard)
    5         end refit k (refit_wait)     (stats, or its error)
    6         start refit k+1              send_weights(wait=False)        receives into staging while
                                                                           it generates batch k+1

Refit ``k`` carries the weights after ``k`` updates (version ``k``). The engine's rule
(:class:`~.batch_gate.BatchGate`): the apply step of refit ``k + 1`` comes after batch ``k + 1``
returned and before batch ``k + 2`` starts, and batch ``k + 2`` starts once the engine serves
version ``k + 1``. So batch ``k`` is sampled by version ``k - 1`` (batch 0 by version 0), every
batch by one version, and the trainer, at version ``k`` when it trains batch ``k``, is at most
one version ahead: **staleness 1** (0 for step 0). Each batch's version is read from vLLM's
per-token labels and checked: one version, the one the batch asked for, at most one behind
(:class:`StalenessError` otherwise); the order of every batch and apply window is checked from
the engine's timestamps at the end (:func:`check_order`).

The reshard backend's methods (``reshard``, ``hybrid``) run staged (``receive="staged"``) and in the
background (``send_weights(wait=False)``); the baselines cannot overlap (``gather-broadcast``
writes vLLM's weights through ``load_weights`` as the bytes arrive, the checkpoint reloads them):
they run blocking at step 6 (once batch ``k + 1`` ended: the engine's rule), and the table says
so. ``verify=True`` checks every refit: a background refit against a reload of what it sent
(saved when it started: a refit that read weights an optimizer step had changed would differ),
a blocking one as the synchronous loop does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .loop import RLConfig, Rig, RunResult, StepRecord, VersionError, batch_version, run as run_loop, scored, \
    shards, step_prompts, verify_refit
from .policy import SESSION_METHODS
from .rollout import VERSION0

POLL_S = 0.02  # how long one collect call waits on the engine (the weight-sync calls get in between)


class StalenessError(VersionError):
    """A batch was sampled by weights more than one update behind the trainer's."""


class OrderError(AssertionError):
    """A refit's apply window overlapped a generation batch, or a batch started before its refit."""


@dataclass
class _Refit:
    """A refit in flight: the record of the step it follows, and what its start call returned per rank."""

    record: StepRecord
    started: list[dict[str, Any]]
    snapshot: str | None


def run(cfg: RLConfig, **options) -> RunResult:
    """:func:`reshard.apps.rl.loop.run` with the asynchronous steps (``cfg.asynchronous`` must be set)."""
    if not cfg.asynchronous:
        raise ValueError("the asynchronous loop needs RLConfig(asynchronous=True)")
    return run_loop(cfg, steps=run_steps, **options)


def _collect(rig: Rig) -> dict[str, Any]:
    deadline = time.monotonic() + rig.cfg.timeout_s
    while (batch := rig.engine.call("collect", POLL_S).result(rig.cfg.timeout_s)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no batch from the engine within {rig.cfg.timeout_s:g} s")
    return batch


def _submit(rig: Rig, step: int, version: str) -> None:
    cfg = rig.cfg
    prompts, seeds = step_prompts(cfg, step, rig.task, rig.tokenizer)
    rig.engine.call("submit", prompts, cfg.group, cfg.max_tokens, cfg.temperature, seeds,
                    version).result(cfg.timeout_s)


def checked_version(groups: list[list[dict]], asked: str, trainer_version: int) -> tuple[str, int]:
    """The batch's one version (it must be the one it ``asked`` for) and its staleness against the
    trainer's ``trainer_version``; :class:`StalenessError` past one."""
    version = batch_version(groups, asked)
    staleness = trainer_version - int(version)
    if not 0 <= staleness <= 1:
        raise StalenessError(f"a batch of version {version!r} trained at version {trainer_version}: staleness "
                             f"{staleness}, the loop's bound is 1")
    return version, staleness


def run_steps(rig: Rig, on_step: Callable[[StepRecord], None]) -> list[StepRecord]:
    """The steps (see module doc); every record once its refit has ended."""
    cfg, records = rig.cfg, []
    _submit(rig, 0, VERSION0)
    in_flight: _Refit | None = None
    for step in range(cfg.steps):
        start = time.perf_counter()
        batch = _collect(rig)
        waited = time.perf_counter() - start
        version, staleness = checked_version(batch["groups"], batch["asked"], step)
        prompts, _ = step_prompts(cfg, step, rig.task, rig.tokenizer)
        if step + 1 < cfg.steps:
            _submit(rig, step + 1, str(step))  # version `step`: what the refit started after step - 1 carries
        rewards, samples, num_tokens = scored(rig.task, prompts, batch["groups"])
        t = time.perf_counter()
        metrics = rig.trainers.each("train", [(shard, num_tokens) for shard in shards(samples, cfg.trainers)])
        training = time.perf_counter() - t
        if in_flight is not None:
            records.append(_end_refit(rig, in_flight, metrics))
            on_step(records[-1])
        method = cfg.methods[step % len(cfg.methods)]
        snapshot = os.path.join(rig.ckpt, f"sent-{step + 1}") if cfg.verify and method in SESSION_METHODS else None
        if step == 1 and cfg.stall_refit_s:  # tests: hold this refit back so that the guard has to act
            rig.trainers.each("stall_next_refit", [(0.0,)] * (cfg.trainers - 1) + [(cfg.stall_refit_s,)])
        started = rig.trainers.all("refit_start", method, str(step + 1), rig.ckpt, snapshot)
        record = StepRecord(step=step, method=method, version=version, reward=float(rewards.mean()),
                            generation=batch["ended"] - batch["started"], training=training, refit=0.0, other=0.0,
                            total=time.perf_counter() - start, loss=sum(m["loss"] for m in metrics),
                            grad_norm=metrics[0]["grad_norm"], staleness=staleness,
                            logprob_gap=sum(m["logprob_gap"] for m in metrics) / len(metrics),
                            overlapped=started[0]["overlapped"],
                            warmup=step < len(cfg.methods) or step == cfg.steps - 1,
                            timeline={"batch_started": batch["started"], "batch_ended": batch["ended"]})
        record.other = record.total - waited - training - started[0]["seconds"]  # rewards, advantages, calls
        in_flight = _Refit(record, started, snapshot)
        if not record.overlapped:  # a blocking refit has ended: its record now (a verify needs these weights)
            records.append(_end_refit(rig, in_flight, None))
            on_step(records[-1])
            in_flight = None
    if in_flight is not None:
        records.append(_end_refit(rig, in_flight, None))
        on_step(records[-1])
    check_order(records)
    return records


def _end_refit(rig: Rig, refit: _Refit, metrics: list[dict] | None) -> StepRecord:
    """End the refit after ``refit.record``'s step and fill in its figures: ``refit`` (rank 0's start to
    the engine serving it), the engine's pause window, the trainers' blocked time (the start call,
    the optimizer step waiting for it in ``metrics``' training, the final wait; the slowest rank)."""
    record, cfg = refit.record, rig.cfg
    waits = rig.trainers.all("refit_wait")
    window = rig.engine.call("take_window").result(cfg.timeout_s) or {}
    record.pause, record.engine_calls = window.get("seconds"), window.get("calls", {})
    record.refit = window["end"] - refit.started[0]["started"] if window else 0.0
    record.blocked = max(s["seconds"] + w["seconds"] + (metrics[r]["guard_s"] if metrics else 0.0)
                         for r, (s, w) in enumerate(zip(refit.started, waits)))
    record.timeline.update({"refit_started": refit.started[0]["started"], "window_start": window.get("start", 0.0),
                            "window_end": window.get("end", 0.0),
                            "guard_waits": float(sum(w["guard_waits"] for w in waits))})
    if cfg.verify:
        version = str(record.step + 1)
        record.verified = (verify_sent(rig, version, refit.snapshot) if record.overlapped
                           else verify_refit(rig.engine, rig.trainers, record.method, version, rig.ckpt))
    return record


def verify_sent(rig: Rig, version: str, snapshot: str) -> bool:
    """After a background refit to ``version``: the engine serves it, and its workers hold what a reload
    of the weights saved when the refit started leaves (so no optimizer step changed what it sent).
    Raises ``AssertionError`` naming the difference."""
    engine, timeout = rig.engine, rig.cfg.timeout_s
    served = engine.call("weight_version").result(timeout)
    if served != version:
        raise AssertionError(f"after a background refit to version {version!r} the engine serves {served!r}")
    after = engine.call("digests").result(timeout)
    engine.call("reload", snapshot, version).result(timeout)  # after the batch in flight (the engine's rule)
    engine.call("take_window").result(timeout)
    expected = engine.call("digests").result(timeout)
    if after != expected:
        raise AssertionError(f"version {version!r}: after the background refit the engine's workers hold {after}, "
                             f"a reload of the weights it sent leaves {expected}")
    return True


def check_order(records: list[StepRecord]) -> None:
    """The engine's rule, from its timestamps: refit ``k + 1`` (after step ``k``) was put in place after
    batch ``k + 1`` ended and before batch ``k + 2`` started; :class:`OrderError` otherwise."""
    by_step = {r.step: r for r in records}
    for r in records:
        window = (r.timeline.get("window_start"), r.timeline.get("window_end"))
        after, before = by_step.get(r.step + 1), by_step.get(r.step + 2)
        if after is not None and window[0] < after.timeline["batch_ended"]:
            raise OrderError(f"the refit after step {r.step} paused the engine before batch {r.step + 1} ended")
        if before is not None and before.timeline["batch_started"] < window[1]:
            raise OrderError(f"batch {r.step + 2} started before the refit after step {r.step} was in place")


__all__ = ["OrderError", "StalenessError", "check_order", "checked_version", "run", "run_steps", "verify_sent"]
