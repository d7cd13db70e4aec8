"""Refits off the critical path: a trainer that steps while its weights leave, engines that keep their
version in place while the next one arrives (``refit(wait=False)``, ``receive="staged"``)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from launch import launch
from reshard.execution import faults
from reshard.refit import RefitError, RefitSession, Side
from reshard.refit.background import RefitHandle
from test_refit_session import CONFIG, full_state, save_model, trainer_model

# every session wait; launch() starts the ranks once every process is up, so no wait includes a start
TIMEOUT = timedelta(seconds=60)
DESTINATION_DELAY_S = 3.0  # the engines come late to the first refit, so the trainer's step finds it in flight


def _slow_read(param: torch.nn.Parameter, started: threading.Event, delay_s: float):
    def run():
        started.set()
        time.sleep(delay_s)
        return param.detach().clone()
    return run


@pytest.mark.parametrize("guarded", [True, False])
def test_an_optimizer_step_waits_for_the_refit_that_reads_its_parameters(guarded):
    """The guard is what keeps the step from changing a tensor still being sent: without it (no
    sources given), the slow "refit" reads the updated value."""
    w = torch.nn.Parameter(torch.ones(4))
    other = torch.nn.Parameter(torch.ones(4))
    optimizer, other_optimizer = torch.optim.SGD([w], lr=1.0), torch.optim.SGD([other], lr=1.0)
    w.grad, other.grad = torch.ones(4), torch.ones(4)
    started = threading.Event()
    # the "refit" reads w 5 s after it started: the step below comes well before that, on a busy machine too
    handle = RefitHandle(_slow_read(w, started, 5.0), sources=[w] if guarded else [])
    assert started.wait(30)
    optimizer.step()
    if guarded:
        assert handle.done() and handle.guard_waits == 1
        assert handle.wait().tolist() == [1.0] * 4  # the refit saw the weights of before the step
    else:
        assert handle.wait().tolist() == [0.0] * 4  # a forgotten wait corrupts the refit
    # an optimizer over other parameters does not wait
    started = threading.Event()
    handle = RefitHandle(_slow_read(w, started, 5.0), sources=[w])
    assert started.wait(30)
    other_optimizer.step()
    assert not handle.done() and handle.guard_waits == 0
    handle.wait()


def test_the_guard_lets_a_step_go_once_the_sources_were_sent():
    """A refit that has sent every byte (``sources_sent``) but not yet committed holds no step back: the
    step changes only weights that already left; the refit's end (here, its error) still comes on wait()."""
    from reshard.refit.background import sources_sent

    w = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.ones(4)
    sent, commit = threading.Event(), threading.Event()

    def refit():
        read = w.detach().clone()
        sources_sent()
        sent.set()
        assert commit.wait(60)  # the destinations prepare and commit: the trainer need not wait for that
        raise RuntimeError(f"the commit failed after sending {read.tolist()}")

    handle = RefitHandle(refit, sources=[w])
    assert sent.wait(30)
    optimizer.step()  # returns while the refit still runs
    assert not handle.done() and w.tolist() == [0.0] * 4 and handle.guard_wait_s < 30
    commit.set()
    with pytest.raises(RuntimeError, match=r"after sending \[1.0, 1.0, 1.0, 1.0\]"):
        handle.wait(60)


def test_source_tensors_must_match_the_source_side():
    from reshard.refit.session import _replacing
    from reshard.tensors import LayoutError

    src = {"w": torch.zeros(2, 3)}
    assert _replacing(src, {"w": torch.ones(2, 3)}, 0)["w"].sum() == 6
    with pytest.raises(LayoutError, match=r"rank 1: source_tensors\['w'\] is \(3, 2\)"):
        _replacing(src, {"w": torch.ones(3, 2)}, 1)
    with pytest.raises(LayoutError, match="rank 0: source_tensors lacks buffer 'w'"):
        _replacing(src, {}, 0)


def test_errors_surface_on_wait():
    def fail():
        raise RefitError("transfer round 0", "rank 3: boom", ranks=[3], moved=True)

    handle = RefitHandle(fail)
    with pytest.raises(RefitError, match="rank 3: boom"):
        handle.wait(timeout=30)
    assert handle.done() and isinstance(handle.exception(), RefitError)


def _overlapped(job, job_rank, rank, world, store_addr, path, out_dir):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    options = dict(timeout=TIMEOUT, max_bucket_bytes=64 << 10, receive="staged")
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    if job == 0:  # trainer: FSDP2 over ranks 0-1; each step's forward, backward and step overlap the refit
        model, opt = trainer_model(path)
        session = RefitSession.connect(source=Side.from_module(model, rank), store_addr=store_addr, rank=rank,
                                       world_size=world, **options)
        for step in range(3):
            state = full_state(model)
            if job_rank == 0:
                torch.save(state, f"{out_dir}/expected{step}.pt")
            handle = session.refit(version=step, wait=False)
            model(input_ids=ids, labels=ids).loss.backward()  # reads the shards the refit is sending
            opt.step()  # changes them: waits until the refit has sent them
            opt.zero_grad()
            assert handle.sent
            if step == 0:  # the engines came late: the step found the refit in flight and waited
                assert handle.guard_waits == 1, handle.guard_waits
            assert handle.wait().sent_bytes > 0
        # a failure on a trainer rank while the engines receive: it surfaces on wait(), on every rank
        if job_rank == 0:
            faults.arm("raise@transfer round 0")
        with pytest.raises(RefitError, match="transfer") as failed:
            session.refit(version=3, wait=False).wait()
        faults.arm(None)
        assert not failed.value.moved  # staged engines: no live byte moved
        session = session.recover()
        state = full_state(model)
        if job_rank == 0:
            torch.save(state, f"{out_dir}/expected4.pt")
        handle = session.refit(version=4, wait=False, snapshot=True)  # copies first: nothing waits
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        assert handle.guard_waits == 0 and handle.snapshot_bytes == session.source.layout_bytes()
        handle.wait()
        session.close()
        return
    # engines: transformers tp_plan over ranks 2-3, receiving into staging while they keep their version
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(tp_plan="auto", tp_size=2))
    side = Side.from_module(model, rank, rank_of={0: 2, 1: 3})
    session = RefitSession.connect(destination=side, store_addr=store_addr, rank=rank, world_size=world, **options)
    for step in range(3):
        before = full_state(model)
        if step == 0:
            time.sleep(DESTINATION_DELAY_S)
        stats = session.receive(version=step)
        assert session.state == "staged" and session.version == (step - 1 if step else None)
        now = full_state(model)
        assert all(torch.equal(now[n], before[n]) for n in now)  # still the version it had: servable
        with torch.no_grad():
            model(input_ids=ids)
        assert stats.receive_staging_bytes == side.layout_bytes()
        report = session.apply()
        assert session.state == "ready" and session.version == step
        want = torch.load(f"{out_dir}/expected{step}.pt")
        got = full_state(model)
        assert all(torch.equal(got[n], want[n]) for n in got), (rank, step)
        assert set(report.paths.values()) == {"staged"}
    before = full_state(model)
    with pytest.raises(RefitError, match="transfer") as failed:
        session.receive(version=3)
    assert not failed.value.moved and session.state == "ready" and session.version == 2
    now = full_state(model)
    assert all(torch.equal(now[n], before[n]) for n in now)  # the failed refit tore nothing
    session = session.recover()
    stats = session.refit(version=4)  # staged, then put in place at once
    assert session.state == "ready" and session.version == 4 and set(stats.paths.values()) == {"staged"}
    want = torch.load(f"{out_dir}/expected4.pt")
    got = full_state(model)
    assert all(torch.equal(got[n], want[n]) for n in got), rank
    session.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_steps_while_staged_engines_receive(tmp_path):
    path = str(tmp_path / "model")
    save_model(path)
    launch(_overlapped, [2, 2], path, str(tmp_path))


def _staging_bound(job, job_rank, rank, world, store_addr):
    import reshard as rs

    spec = rs.TensorSpec("w", (64, 64), torch.float32)
    src = rs.Layout.from_placements(spec, [0], (1,), [rs.Replicate()])
    dst = rs.Layout.from_placements(spec, [1], (1,), [rs.Replicate()])
    side = (Side.from_layout(src, 0, src.materialize(0, {"w": torch.ones(64, 64)})) if rank == 0 else
            Side.from_layout(dst, 1, dst.empty_buffers(1)))
    with pytest.raises(RefitError, match=r"rank 1: a staged receive needs 16384 bytes of staging, more than "
                                         r"max_receive_staging_bytes=1000"):
        RefitSession.connect(**({"source": side} if rank == 0 else {"destination": side}), store_addr=store_addr,
                             rank=rank, world_size=world, timeout=TIMEOUT, receive="staged",
                             max_receive_staging_bytes=1000)


def test_staging_over_its_bound_is_refused_at_connect_on_every_rank():
    launch(_staging_bound, [1, 1])


@pytest.mark.parametrize("notes, reported, moved", [
    ({1: False, 2: False}, [0, 1, 2], False), ({1: False, 2: True}, [0, 1, 2], True), ({1: False}, [0, 1, 2], True),
    ({1: False, 2: False}, [0, 1], False), ({1: False}, [0, 1], True)],
    ids=["none wrote", "one wrote", "one silent", "one unreported, noted", "one unreported, silent"])
def test_a_failed_refit_moved_bytes_only_if_a_destination_says_it_wrote(notes, reported, moved):
    """A source rank that got past the agreement alone (the others gave up there) moved no destination
    byte: ``moved`` follows the destinations' own notes; one that posts none counts as written. Only
    the destinations that reported to the decision are waited for; the others' notes are looked up
    once (a killed destination must not hold every rank's error up)."""
    from types import SimpleNamespace

    from reshard.options import RefitOptions
    from reshard.refit.session import MOVED_NOTE_WAIT_S

    asked = []
    control = SimpleNamespace(reported=lambda n: (asked.append(("reported", n)), reported)[1],
                              notes=lambda key, ranks, timeout: (asked.append((key, list(ranks), timeout)),
                                                                 {r: notes[r] for r in ranks if r in notes})[1])
    session = SimpleNamespace(options=RefitOptions(), group=SimpleNamespace(control=control),
                              members={0: (None, "ready", False), 1: (None, "ready", True), 2: (None, "ready", True)})
    touched = SimpleNamespace(touched=True)
    assert RefitSession._moved(session, touched, 7) is moved
    assert asked == [("reported", 7), ("written/7", [r for r in (1, 2) if r in reported], MOVED_NOTE_WAIT_S),
                     ("written/7", [r for r in (1, 2) if r not in reported], 0.0)]
    assert RefitSession._moved(session, SimpleNamespace(touched=False), 7) is False  # never got past agreement
