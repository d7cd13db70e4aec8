"""Faults while a refit overlaps other work (issue 19 §5): a staged destination receiving on a thread
while it serves, a trainer stepping with ``refit(wait=False)`` in flight, and both at once.

A fixed subset of ``benchmarks/bench_faults.py``'s overlap families, over real gloo processes
(:mod:`reshard.apps.fault_suite`). Each scenario asserts what the suite counts: no hang, no silent
corruption, no torn model (a staged destination also checks its live weights, every 10 ms while
its receive is in flight, against the version it holds), every rank told, every destination that
had not started putting bytes in place still ``ready`` at its previous version with its bytes, every
refit in flight guarding the trainer's parameters (and the committed bytes, the version from before
the trainer's step); then the survivors refit again. A control shows the "kept serving" count can fall short: the same fault with in-place
destinations leaves the one it reached poisoned.

Timeouts: each refit's is ``T`` (5 s: a loaded 2-core machine stretches a clean refit of these
layouts to well under 1 s); the workers are started and ready (torch, the optimizer's imports)
before any scenario runs, so no timeout includes a process start (``Driver``'s own bound: 120 s).
"""

from __future__ import annotations

import pytest

from reshard.apps.fault_scenarios import Outcome, Scenario, family_figures, missed
from reshard.apps.fault_suite import Driver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
T = 20.0  # every session wait: the raises and the kill are heard at once, the margin is for a loaded machine


def scenario(i, fault, rank, overlap, checksum=False):
    """2 sources -> 2 destinations, seed 7 (several rounds at a 512-byte staging cap, as in test_failures)."""
    return Scenario(i, 7, 2, 2, fault, rank, checksum=checksum, timeout_s=T, bucket_bytes=512).in_family(overlap)


# (scenario, what it must come to)
CASES = [
    # staged receive: the fault strikes while the destinations receive on their thread and serve
    (scenario(0, "kill@transfer round 0", 0, "staged"), {"recovered", "unrecoverable: a source's only copy was lost"}),
    (scenario(1, "raise@transfer round 1", 3, "staged"), {"recovered"}),  # in a destination's own receive thread
    (scenario(2, "corrupt@transfer round 0", 0, "staged", checksum=True), {"recovered"}),
    # trainer in flight: the fault strikes in the refit thread while the trainer runs forward, backward, step
    (scenario(3, "raise@transfer round 0", 0, "trainer"), {"recovered"}),
    (scenario(4, "raise@commit", 1, "trainer"), {"recovered"}),
    # both: the trainer in flight, the destinations staged
    (scenario(5, "raise@transfer round 0", 1, "both"), {"recovered"}),
    (scenario(6, None, 0, "both"), {"committed"}),
]


def _check(o: Outcome, expected: set[str]) -> None:
    s = o.scenario
    where = s.describe()
    if s.fault is not None:
        assert o.fired, f"{where}: the fault never fired"
    assert not o.hung, f"{where}: ranks {o.hung} never reported (a hang)"
    assert o.silent == 0, f"{where}: a committed destination holds wrong bytes"
    assert o.torn == 0, f"{where}: a destination held or served a mix of versions: {o.notes}"
    assert o.guard_broken == 0, f"{where}: a refit in flight guarded no parameter: {o.notes}"
    assert o.result in expected, f"{where}: came to {o.result!r}, expected one of {expected}; {o.notes}"
    if s.fault is None:
        return
    surviving = s.destinations - (s.fault_rank >= s.sources and s.kind == "kill")
    if s.staged:  # every surviving staged destination kept serving its version, bit for bit
        assert o.kept == o.kept_due == surviving, f"{where}: kept {o.kept} of {o.kept_due} (due), {surviving} alive"
    assert not missed(o), f"{where}: {o.notes}"
    assert o.detection_s is not None and o.detection_s < 3 * T + 5, (where, o.detection_s)
    errors = [e for r in o.reports for e in r["events"] if e[0] == "error"]
    live = s.world - (s.kind == "kill")
    assert len(errors) == live, f"{where}: {len(errors)} of {live} live ranks raised: {errors}"
    assert all(s.fault_rank in e[2] for e in errors), f"{where}: not every rank named rank {s.fault_rank}: {errors}"


def test_faults_during_a_staged_receive_or_with_the_trainer_in_flight():
    driver = Driver(workers=4)
    outcomes = []
    try:
        for s, expected in CASES:
            o = driver.run(s)
            outcomes.append(o)
            _check(o, expected)
        # the control: the destination fault of case 1, received in place, poisons what it reached
        o = driver.run(scenario(7, "raise@transfer round 1", 3, ""))
    finally:
        driver.close()
    assert o.fired and not o.hung and o.silent == 0 and o.torn == 0 and o.result == "recovered", (o.result, o.notes)
    assert o.kept < 2, "in place, the destination the failed refit reached cannot have kept its version"
    families = family_figures(outcomes)
    assert set(families) == {"staged receive", "trainer in flight", "both"}
    # trainer ranks stepped while their refit was in flight, and the guard made those steps wait
    assert sum(o.guard_waits for o in outcomes if o.scenario.in_flight) >= 1
    assert sum(o.served for o in outcomes if o.scenario.staged) >= 1  # the staged ranks served while receiving


def test_missed_targets_are_counted():
    s = scenario(0, "raise@transfer round 0", 0, "staged")
    assert not missed(Outcome(s, kept=2, kept_due=2))
    assert missed(Outcome(s, kept=1, kept_due=2))
    assert missed(Outcome(scenario(1, "raise@commit", 0, "trainer"), guard_broken=1))
    with pytest.raises(ValueError, match="overlap"):
        scenario(2, None, 0, "sideways")


def test_the_vllm_suite_draws_families_and_counts_them_apart():
    """The vLLM suite's draws in a family keep the blocking draw's faults; its figures count "kept serving"
    per family (no engine needed)."""
    import random

    from reshard.apps import fault_suite_vllm
    from reshard.apps.fault_scenarios import OVERLAPS

    blocking = [fault_suite_vllm.random_scenario(i, random.Random(5), 2, 3, {0: [0], 1: [1]}) for i in range(4)]
    staged = [fault_suite_vllm.random_scenario(i, random.Random(5), 2, 3, {0: [0], 1: [1]}, overlap="staged")
              for i in range(4)]
    assert [(s.fault, s.fault_rank) for s in blocking] == [(s.fault, s.fault_rank) for s in staged]
    assert all(s.staged and not s.in_flight for s in staged) and not any(s.staged for s in blocking)
    outcomes = [Outcome(staged[0], fired=True, result="recovered", kept=1, kept_due=1),
                Outcome(blocking[0], fired=True, result="recovered"),
                Outcome(staged[1].in_family("trainer"), fired=True, result="recovered", guard_waits=2)]
    figures = fault_suite_vllm.engine_summary(outcomes)
    assert figures["kept serving the previous version / should have (failed refits)"] == "1 / 1"
    families = family_figures(outcomes)
    assert families["staged receive"]["kept serving the previous version"] == 1
    assert families["trainer in flight"]["optimizer steps that waited / unguarded refits"] == "2 / 0"
    assert not fault_suite_vllm.needs_a_look(outcomes[0])
    assert fault_suite_vllm.needs_a_look(Outcome(staged[0], fired=True, result="recovered", kept=0, kept_due=1))
    assert len(OVERLAPS) == 4


def test_the_vllm_suite_leaves_its_serving_check_out_of_rank_0s_times():
    """A staged scenario's serving check runs inside trainer rank 0's refit call, before its refit: its time
    is the harness's (an engine being shut down can hold its calls for tens of seconds), so rank 0's
    detection time and bound leave it out; rank 1's are as measured (no engine needed)."""
    import random
    from types import SimpleNamespace

    from reshard.apps import fault_suite_vllm
    from reshard import RefitError

    rig = SimpleNamespace(timeout_s=5.0, stall_s=15.0, engine=SimpleNamespace(grace_s=10.0))
    driver = fault_suite_vllm.EngineDriver(rig)
    s = fault_suite_vllm.random_scenario(0, random.Random(5), 2, 3, {0: [0], 1: [1]}, overlap="staged")
    s = type(s)(**{**vars(s), "fault": "raise@agreement", "fault_rank": 2})  # on an engine worker: both trainers raise

    def judge(check_at: float | None, check_s: float, end0: float, end1: float) -> fault_suite_vllm.Outcome:
        o = fault_suite_vllm.Outcome(s, fired=True, harness_at=check_at, harness_s=check_s)
        error = RefitError("agreement", "x", ranks=[2])
        attempt = fault_suite_vllm.Attempt("v1", 0, 100.0, error, end0, ("error", end1), 101.0, False, [])
        driver._judge_failure(s, attempt, o)
        return o

    # the fault fires at 101; the check runs 100.5-145 (44.5 s, 44 after the fault); rank 0 raises at 146
    o = judge(100.5, 44.5, 146.0, 102.0)
    assert o.detection_s == pytest.approx(1.0) and not o.late, (o.detection_s, o.notes)
    o = judge(None, 0.0, 146.0, 102.0)  # the same times without a check: rank 0 raised 46 s after the start
    assert o.detection_s == pytest.approx(45.0) and o.late, (o.detection_s, o.notes)
    o = judge(100.0, 0.5, 102.5, 103.5)  # a quick check before the fault: rank 1 is the later one
    assert o.detection_s == pytest.approx(2.5) and not o.late
