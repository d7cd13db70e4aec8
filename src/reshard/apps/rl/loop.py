"""The RL loop: generate -> reward -> train -> refit, timed phase by phase, versions checked on every rollout.

The driver (this process) holds no weights. Each step::

    generate   the engine samples G completions for each of P prompts (vLLM, temperature 1); every
               completion names the weight version of each of its tokens: all of them must be the
               version the engine was last refitted to (one version per batch, never a mix)
    reward     the task scores each completion; advantages are relative to the prompt's group
    train      the trainer ranks take one GRPO step, each on its share of the batch (FSDP2)
    refit      the trainers push the new weights into the engine by the step's method; the engine
               then serves version ``step + 1``

Methods rotate step by step (step k refits by ``methods[k % len(methods)]``) so that a noisy
machine hits them alike; each method's first step is a warm-up, left out of the timing table.
With ``refit=False`` (the control) the engine keeps sampling from the initial weights: its
reward must stay flat while the trainer's weights move.

``verify=True`` (tests) checks every refit: the engine's weight version, and the digests of every
tensor its workers compute with against a reference refit of the same weights (vLLM reloading a
checkpoint of them; a ``reshard`` refit for the checkpoint method itself).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .grpo import Sample, group_advantages
from .orchestrate import LOCAL, cluster, wait_all
from .policy import CHECKPOINT, REFIT_METHODS, RESHARD, save_policy_checkpoint
from .rollout import VERSION0
from .task import PROMPTS, WordPieceTask

PHASES = ("generation", "training", "refit", "other")


@dataclass
class RLConfig:
    """One run of the loop."""

    steps: int = 24
    methods: tuple[str, ...] = REFIT_METHODS
    refit: bool = True  # False: the control (the engine never gets new weights)
    orchestrator: str = LOCAL  # "local" processes or "ray" actors
    trainers: int = 2  # FSDP2 ranks
    tp: int = 2  # the engine's tensor parallel size
    prompts: int = 4  # per step
    group: int = 8  # completions per prompt
    max_tokens: int = 12
    hidden: int = 64  # the policy's hidden size (its MLP is twice as wide)
    layers: int = 2  # the policy's decoder layers
    temperature: float = 1.0
    lr: float = 1e-2
    seed: int = 0
    verify: bool = False
    timeout_s: float = 300.0  # bounds every call to an actor
    asynchronous: bool = False  # one-step off-policy (reshard.apps.rl.async_loop); False: this module's loop
    # tests of the async loop: the refit after step 1 stalls this long on the last trainer rank before any byte
    # moves (reshard's fault injection, stall@agreement), so the next optimizer step must wait for it (the guard)
    stall_refit_s: float = 0.0
    # several engines, faults and membership changes (reshard.apps.rl.chaos_loop): the refit is reshard's
    engines: int = 1
    chaos: str | None = None  # a chaos spec (reshard.apps.rl.chaos), None: no fault
    gen_timeout_s: float = 30.0  # one engine's share of a batch; past it the engine is fenced and replaced
    refit_timeout_s: float = 30.0  # the chaos loop's refit session timeout (bounds each wait inside a refit)
    max_refit_attempts: int = 3  # a failed refit is retried on a new session up to this many times in all

    @property
    def fleet(self) -> bool:
        """Whether the chaos loop runs (several engines, or a chaos spec)."""
        return self.engines > 1 or self.chaos is not None

    def __post_init__(self) -> None:
        if self.asynchronous and not self.refit:
            raise ValueError("the asynchronous loop refits after every step; its control is the synchronous run "
                             "without refit")
        unknown = [m for m in self.methods if m not in REFIT_METHODS]
        if unknown or not self.methods:
            raise ValueError(f"refit methods {list(self.methods)}: choose from {', '.join(REFIT_METHODS)}")
        if not 1 <= self.prompts <= len(PROMPTS):
            raise ValueError(f"prompts per step must be 1..{len(PROMPTS)}, got {self.prompts}")
        if self.steps < 1 or self.group < 2 or self.max_tokens < 1 or self.trainers < 1 or self.tp < 1:
            raise ValueError("steps, max_tokens, trainers and tp must be >= 1, group >= 2")
        if self.hidden < 8 or self.hidden % 8 or self.layers < 1:
            raise ValueError(f"hidden {self.hidden} must be a multiple of 8 (>= 8), layers {self.layers} >= 1")
        if (self.prompts * self.group) % self.trainers:
            raise ValueError(f"{self.prompts} x {self.group} completions do not split over {self.trainers} trainers")
        if self.engines < 1:
            raise ValueError(f"engines must be >= 1, got {self.engines}")
        if self.fleet:
            from .chaos import parse

            if self.chaos is not None:
                parse(self.chaos)  # a ChaosSpecError names a bad token now, before anything starts
            if tuple(self.methods) != (RESHARD,) or not self.refit or self.verify or self.orchestrator != LOCAL:
                raise ValueError("several engines or --chaos: the refit is reshard's (--methods reshard), local "
                                 "actors, no --no-refit or --verify (the run checks every engine at its end)")
            for name in ("gen_timeout_s", "refit_timeout_s"):
                if not getattr(self, name) > 0:
                    raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
            if self.max_refit_attempts < 1:
                raise ValueError(f"max_refit_attempts must be >= 1, got {self.max_refit_attempts}")


@dataclass
class StepRecord:
    """What one step did and how long each phase took (seconds, measured by the driver; ``pause``: the
    engine's own window)."""

    step: int
    method: str  # the refit after this step's update ("none" in the control)
    version: str  # the weight version every rollout of this step was generated with
    reward: float  # mean over the batch
    generation: float
    training: float
    refit: float
    other: float
    total: float
    pause: float | None = None
    engine_calls: dict[str, float] = field(default_factory=dict)  # seconds of each weight-sync call in the pause
    loss: float = 0.0
    grad_norm: float = 0.0
    logprob_gap: float = 0.0  # mean |engine - trainer| log-prob of the sampled tokens
    warmup: bool = False  # left out of the timing tables (a method's first step; async: also the last)
    verified: bool | None = None
    blocked: float = 0.0  # the trainers stopped for the refit: its calls, and optimizer steps waiting for it
    staleness: int = 0  # updates the trainer had taken since the weights that sampled this step's batch
    overlapped: bool = False  # the refit ran while the trainers trained and the engine generated (async)
    timeline: dict[str, float] = field(default_factory=dict)  # async: monotonic times of the batch and the window


@dataclass
class RunResult:
    config: RLConfig
    steps: list[StepRecord] = field(default_factory=list)
    startup_s: float = 0.0  # actors up and the trainer group formed
    connect_s: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    random_reward: float = 0.0
    run_id: str = ""  # in the environment of every process the run started (RESHARD_RL_RUN)
    reaped: list[int] = field(default_factory=list)  # processes the cleanup had to kill (none if all closed)
    chaos: dict = field(default_factory=dict)  # the chaos loop's log: faults, engines, checks (chaos_loop)

    @classmethod
    def from_json(cls, data: dict) -> RunResult:
        """The inverse of :meth:`to_json` (reports from a saved run)."""
        config = RLConfig(**{**data["config"], "methods": tuple(data["config"]["methods"])})
        return cls(config, [StepRecord(**s) for s in data["steps"]], data["startup_s"], data["connect_s"],
                   data["total_s"], data["random_reward"], data.get("run_id", ""), data.get("reaped", []),
                   data.get("chaos", {}))

    def to_json(self) -> dict:
        return {"config": asdict(self.config), "steps": [asdict(s) for s in self.steps], "startup_s": self.startup_s,
                "connect_s": self.connect_s, "total_s": self.total_s, "random_reward": self.random_reward,
                "run_id": self.run_id, "reaped": self.reaped, "chaos": self.chaos}


class VersionError(AssertionError):
    """Rollouts of one batch carried another version than the engine's, or a mix."""


def batch_version(groups: list[list[dict]], expected: str) -> str:
    """The one weight version of a batch of completions; raises :class:`VersionError` if any token was
    sampled with another version than ``expected`` (or a completion's spans do not cover it)."""
    seen = set()
    for group in groups:
        for c in group:
            spans = c["versions"]
            covered = sum(end - start for _, start, end in spans)
            if covered != len(c["ids"]):
                raise VersionError(f"a completion of {len(c['ids'])} tokens has version spans {spans}")
            seen.update(v for v, _, _ in spans)
    if seen != {expected}:
        raise VersionError(f"rollouts carry versions {sorted(seen)}; the engine was refitted to {expected!r}")
    return expected


@contextmanager
def output_to(path: str | None):
    """This process's stdout and stderr (file descriptors: C libraries' too) go to ``path`` (appended)
    inside the block; nothing changes for ``None``."""
    if path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


class Trainers:
    """The trainer ranks' handles: one call on every rank at once, bounded by one deadline."""

    def __init__(self, handles: list, timeout_s: float) -> None:
        self.handles, self.timeout_s = handles, timeout_s

    def all(self, method: str, *args) -> list:
        return wait_all([h.call(method, *args) for h in self.handles], self.timeout_s)

    def each(self, method: str, per_rank: list[tuple]) -> list:
        return wait_all([h.call(method, *a) for h, a in zip(self.handles, per_rank)], self.timeout_s)


@dataclass
class Rig:
    """What a run's steps use: its config, task and tokenizer, the actors, a folder for checkpoints."""

    cfg: RLConfig
    task: WordPieceTask
    tokenizer: Any
    engine: Any  # the rollout engine's actor handle
    trainers: Trainers
    ckpt: str
    cluster: Any = None  # the orchestrator's Cluster (the chaos loop starts and fences engines through it)
    extras: dict = field(default_factory=dict)  # what a steps function logs besides its records


def run(cfg: RLConfig, *, on_step: Callable[[StepRecord], None] | None = None,
        on_status: Callable[[str], None] | None = None, workdir: str | None = None,
        log: str | None = None, steps: Callable[[Rig, Callable[[StepRecord], None]], list[StepRecord]] | None = None
        ) -> RunResult:
    """Run the loop (see module doc) and return every step's record; every actor is gone when it returns.
    ``log``: a file for the actors' output (local actors); ``steps``: what runs the steps once the
    actors are up and connected (default: this module's synchronous loop; the asynchronous one is
    :func:`reshard.apps.rl.async_loop.run`)."""
    from transformers import AutoTokenizer

    from ..toy_models import config as toy_config

    status = on_status or (lambda _: None)
    result = RunResult(cfg)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=workdir) as work:
        path, ckpt = os.path.join(work, "policy"), os.path.join(work, "refit-checkpoint")
        with output_to(log):  # transformers' and tokenizers' progress bars
            save_policy_checkpoint(path, seed=cfg.seed, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                                   intermediate_size=2 * cfg.hidden)
            tokenizer = AutoTokenizer.from_pretrained(path)
        task = WordPieceTask.from_tokenizer(tokenizer, toy_config("dense").vocab_size)
        result.random_reward = task.random_reward
        engines = f"{cfg.engines} TP={cfg.tp} vLLM engines" if cfg.engines > 1 else f"a TP={cfg.tp} vLLM engine"
        status(f"starting {cfg.trainers} trainer ranks and {engines} ({cfg.orchestrator})")
        with cluster(cfg.orchestrator, path, trainers=cfg.trainers, tp=cfg.tp, lr=cfg.lr, seed=cfg.seed,
                     timeout_s=cfg.timeout_s, log=log, engines=cfg.engines) as actors:
            result.startup_s = time.perf_counter() - started
            result.run_id = actors.run_id
            trainers, engine = Trainers(actors.trainers, cfg.timeout_s + 60), actors.engine
            methods = list(dict.fromkeys(cfg.methods))
            if cfg.verify:
                methods += [m for m in (RESHARD, CHECKPOINT) if m not in methods]
            to_connect = list(dict.fromkeys(methods)) if cfg.refit and not cfg.fleet else []
            if to_connect:
                status(f"connecting the engine for {', '.join(to_connect)}")
                result.connect_s = trainers.all("connect", to_connect, engine, actors.host, cfg.tp,
                                                cfg.asynchronous)[0]
            rig = Rig(cfg, task, tokenizer, engine, trainers, ckpt, actors)
            if steps is None and cfg.fleet:
                raise ValueError("several engines or a chaos spec: run reshard.apps.rl.chaos_loop.run")
            try:
                result.steps = (steps or _steps)(rig, on_step or (lambda _: None))
            finally:
                result.chaos = rig.extras
                status("shutting down")
        result.reaped = actors.reaped
    result.total_s = time.perf_counter() - started
    return result


def _steps(rig: Rig, on_step: Callable[[StepRecord], None]) -> list[StepRecord]:
    """The synchronous loop: generate, reward, train, refit, one after the other."""
    cfg, records, version = rig.cfg, [], VERSION0
    for step in range(cfg.steps):
        method = cfg.methods[step % len(cfg.methods)] if cfg.refit else "none"
        record = _step(cfg, step, method, version, rig.task, rig.tokenizer, rig.engine, rig.trainers, rig.ckpt)
        if cfg.refit:
            version = str(step + 1)
            if cfg.verify:
                record.verified = verify_refit(rig.engine, rig.trainers, method, version, rig.ckpt)
        record.warmup = cfg.refit and step < len(cfg.methods)
        records.append(record)
        on_step(record)
    return records


def step_prompts(cfg: RLConfig, step: int, task: WordPieceTask, tokenizer) -> tuple[list[list[int]], list[int]]:
    """The prompts of ``step`` (token ids) and the seed of each one's group."""
    prompts = [tokenizer(p).input_ids for p in task.prompts(step, cfg.prompts, cfg.seed)]
    # a seed per completion, never reused in the run (overlapping seeds would correlate steps' rollouts)
    seeds = [((cfg.seed * 100_000 + step) * cfg.prompts + i) * cfg.group for i in range(len(prompts))]
    return prompts, seeds


def scored(task: WordPieceTask, prompts: list[list[int]], groups: list[list[dict]]
           ) -> tuple[torch.Tensor, list[Sample], int]:
    """Rewards (prompt x completion), the trainer's samples with their group-relative advantages, and
    the batch's completion tokens."""
    rewards = torch.tensor([[task.reward(c["ids"]) for c in group] for group in groups])
    advantages = group_advantages(rewards)
    samples = [Sample(p, c["ids"], float(a), c["logprobs"])
               for p, group, adv in zip(prompts, groups, advantages) for c, a in zip(group, adv)]
    return rewards, samples, sum(len(s.completion_ids) for s in samples)


def shards(samples: list[Sample], n: int) -> list[list[Sample]]:
    """``samples`` split evenly over ``n`` trainer ranks, in order."""
    size = len(samples) // n
    return [samples[i * size: (i + 1) * size] for i in range(n)]


def _step(cfg: RLConfig, step: int, method: str, version: str, task: WordPieceTask, tokenizer, engine,
          trainers: Trainers, ckpt: str) -> StepRecord:
    start = time.perf_counter()
    prompts, seeds = step_prompts(cfg, step, task, tokenizer)
    t = time.perf_counter()
    groups = engine.call("generate", prompts, cfg.group, cfg.max_tokens, cfg.temperature,
                         seeds).result(cfg.timeout_s)
    generation = time.perf_counter() - t
    batch_version(groups, version)
    rewards, samples, num_tokens = scored(task, prompts, groups)
    t = time.perf_counter()
    metrics = trainers.each("train", [(shard, num_tokens) for shard in shards(samples, cfg.trainers)])
    training = time.perf_counter() - t
    refit = 0.0
    pause, calls = None, {}
    if method != "none":
        t = time.perf_counter()
        trainers.all("refit", method, str(step + 1), ckpt)
        refit = time.perf_counter() - t
        window = engine.call("take_window").result(cfg.timeout_s) or {}
        pause, calls = window.get("seconds"), window.get("calls", {})
    total = time.perf_counter() - start
    return StepRecord(step=step, method=method, version=version, reward=float(rewards.mean()), generation=generation,
                      training=training, refit=refit, other=total - generation - training - refit, total=total,
                      pause=pause, engine_calls=calls, loss=sum(m["loss"] for m in metrics), blocked=refit,
                      grad_norm=metrics[0]["grad_norm"],
                      logprob_gap=sum(m["logprob_gap"] for m in metrics) / len(metrics))


def verify_refit(engine, trainers: Trainers, method: str, version: str, ckpt: str) -> bool:
    """After a refit by ``method`` to ``version``: the engine serves ``version``, and its workers hold the
    same bytes as after a reference refit of the same weights (a checkpoint reload, or ``reshard`` for
    the checkpoint method). Raises ``AssertionError`` naming the difference."""
    served = engine.call("weight_version").result(trainers.timeout_s)
    if served != version:
        raise AssertionError(f"after a refit by {method} to version {version!r} the engine serves {served!r}")
    after = engine.call("digests").result(trainers.timeout_s)
    reference = RESHARD if method == CHECKPOINT else CHECKPOINT
    trainers.all("refit", reference, version, ckpt)
    engine.call("take_window").result(trainers.timeout_s)
    expected = engine.call("digests").result(trainers.timeout_s)
    if after != expected:
        raise AssertionError(f"step to version {version!r}: after the refit by {method} the engine's workers hold "
                             f"{after}, after a refit of the same weights by {reference} {expected}")
    return True


__all__ = ["PHASES", "RLConfig", "Rig", "RunResult", "StepRecord", "Trainers", "VersionError", "batch_version", "run",
           "scored", "shards", "step_prompts", "verify_refit"]
