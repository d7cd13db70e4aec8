"""The RL loop under chaos (``reshard.apps.rl.chaos_loop``): faults and membership changes in a real run.

Without processes: chaos specs (every bad token named; schedules drawn from the seed alone) and the
prompt split over engines.

One real run on tiny sizes: 2 FSDP2 trainer ranks, 2 vLLM engines (TP=1, local processes) at
start. A grow, a SIGKILL of an engine worker, a stall (SIGSTOP, past the generation timeout) and a
shrink happen during it. Checked (issue 21, point 3):

* every step ends within the loop's stated bound; the run ends (no hang);
* every rollout is labelled, token for token, with the version its engine committed, and that
  engine was serving (the loop checks each one and counts them: every prompt's group, once);
* one version per batch, the one of the last refit (staleness 0);
* the reward rises (sampling is seeded per prompt, so this does not depend on which engine served);
* the killed and the stalled engine are fenced and replaced, each replacement caught up and
  digest-checked before it serves; the grown engine joins; the shrunk one leaves;
* at the end every engine is bit-equal to the trainer's last weights (one reloads a checkpoint of
  them; the digests of all must equal its own);
* nothing is left: no child of this process, no process with the run's id.

Which step each event lands on is fixed by the schedule, not by timing; how many steps a starting
engine needs to come up is not, so the checks ask only what holds either way.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reshard.apps.rl.chaos import ChaosSpecError, Event, parse
from reshard.apps.rl.fleet import assign

# ---------------------------------------------------------------------- no processes


@pytest.mark.parametrize("spec, message", [
    ("", "empty"),
    ("explode@3", "unknown kind 'explode'"),
    ("kill-engine@x", "STEP must be a whole number"),
    ("kill-engine@-1", "STEP must be a whole number"),
    ("kill-engine@2:y", "TARGET must be a whole number"),
    ("grow@2:1", "grow starts a new engine"),
    ("kill-engine=1.5", "RATE is a probability"),
    ("kill-engine=nan", "RATE must be a number"),
    ("stall=0", "stall's seconds"),
    ("seed=abc", "the seed must be"),
    ("kill-engine", "expected KIND@STEP"),
])
def test_bad_chaos_specs_name_the_token(spec, message):
    with pytest.raises(ChaosSpecError, match=message):
        parse(spec)


def test_chaos_schedule_is_drawn_from_the_seed_alone():
    spec = parse("kill-engine=0.3,trainer-raise=0.2,grow@4,seed=5")
    first = spec.events(40, engines=3, trainers=2)
    assert first == spec.events(40, engines=3, trainers=2)
    assert first != parse("kill-engine=0.3,trainer-raise=0.2,grow@4,seed=6").events(40, engines=3, trainers=2)
    assert Event("grow", 4) in first
    assert all(e.step > 0 for e in first if e.kind != "grow")  # step 0 stays clean
    assert all(0 <= e.target < 2 for e in first if e.kind == "trainer-raise")
    assert all(0 <= e.target < 3 for e in first if e.kind == "kill-engine")
    with pytest.raises(ChaosSpecError, match="no trainer rank 2"):
        parse("trainer-raise@1:2").events(5, engines=2, trainers=2)
    assert parse("kill-engine@9").events(5, engines=2, trainers=2) == []  # beyond the run


def test_rl_config_refuses_a_bad_chaos_run_before_anything_starts():
    from reshard.apps.rl.loop import RLConfig

    with pytest.raises(ChaosSpecError, match="'shrink@x'"):
        RLConfig(engines=2, chaos="shrink@x", methods=("reshard",))
    with pytest.raises(ValueError, match="--methods reshard"):
        RLConfig(engines=2, methods=("reshard", "checkpoint"))
    with pytest.raises(ValueError, match="gen_timeout_s"):
        RLConfig(engines=2, methods=("reshard",), gen_timeout_s=0)


@given(st.integers(0, 200), st.integers(1, 9))
def test_assign_covers_every_prompt_once_in_order(n, engines):
    keys = [f"e{i}" for i in range(engines)]
    parts = assign(n, keys)
    covered = [i for a, b in parts.values() for i in range(a, b)]
    assert covered == list(range(n))
    sizes = [b - a for a, b in parts.values()]
    assert not sizes or max(sizes) - min(sizes) <= 1
    assert list(parts) == keys[: len(parts)]


# ---------------------------------------------------------------------- a real run

CHAOS = "grow@1,kill-engine@2:1,stall-engine@4:0,shrink@5:0,seed=3"
STEPS, LR = 12, 3e-2  # enough steps at this rate for the reward to rise (as in test_rl_loop's async test)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_chaos_run_keeps_training_through_kill_stall_grow_shrink():
    pytest.importorskip("vllm")
    from test_rl_loop import _run

    from reshard.apps.rl.chaos_loop import run
    from reshard.apps.rl.loop import RLConfig

    cfg = RLConfig(steps=STEPS, engines=2, tp=1, trainers=2, prompts=4, group=4, max_tokens=8, methods=("reshard",),
                   chaos=CHAOS, lr=LR, gen_timeout_s=40.0, refit_timeout_s=40.0, timeout_s=180.0)
    result = _run(cfg, run)
    log = result.chaos
    print("\n" + "\n".join(f"{f['kind']:<13} step {f['step']} {f['target']:<4} detected {f['detection_s']} "
                           f"recovered {f['recovery_s']}: {f['outcome']}" for f in log["faults"]))
    # 0 hangs: every step ended, each within the stated bound
    assert [s.step for s in result.steps] == list(range(STEPS))
    assert all(s.total < log["step_bound_s"] for s in result.steps)
    # rollouts: each checked once against its engine's committed version; batch k by version k
    assert log["rollouts_checked"] == STEPS * cfg.prompts * cfg.group
    assert [s.version for s in result.steps] == [str(k) for k in range(STEPS)]
    assert {s.staleness for s in result.steps} == {0}
    assert all(0.0 <= s.reward <= 1.0 and s.loss == s.loss for s in result.steps)
    # the reward still rises: sampling is seeded per prompt and every engine holds the trainer's exact weights,
    # so which engine served a prompt does not change its rollouts, and this does not depend on timing
    rewards = [s.reward for s in result.steps]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.05, rewards
    # every scheduled event happened and was recovered from
    faults = {f["kind"]: f for f in log["faults"]}
    assert set(faults) >= {"grow", "kill-engine", "stall-engine", "shrink"}, log["faults"]
    assert all(f["recovered"] is not None for f in log["faults"]), log["faults"]
    assert faults["kill-engine"]["outcome"].startswith("replaced by")
    assert faults["stall-engine"]["outcome"].startswith("replaced by")
    assert faults["stall-engine"]["detection_s"] >= cfg.gen_timeout_s - 1  # seen by the bounded wait, not before
    assert all(f["steps_lost"] == 0 for f in log["faults"])
    engines = {e["key"]: e for e in log["engines"]}
    assert engines[faults["kill-engine"]["target"]]["state"] == "dead"
    assert engines[faults["stall-engine"]["target"]]["state"] == "dead"
    assert engines[faults["shrink"]["target"]]["state"] == "left"
    serving = sorted(k for k, e in engines.items() if e["state"] == "serving")
    assert faults["grow"]["target"] in serving or engines[faults["grow"]["target"]]["state"] in ("dead", "left")
    # the end: every engine still in the group bit-equal to the trainer's last version
    assert log["final"]["bit_equal"] and log["final"]["version"] == str(STEPS)
    assert log["final"]["engines"] == serving and len(serving) >= 1
