"""Refit sessions over real process groups: a trainer under FSDP2 refitting a Hugging Face ``tp_plan``
model in place (two jobs, each its own default gloo group, joined by the session's standalone group),
explicit layouts over the default group, and sides that do not match failing at connect on every rank."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

import reshard as rs
from launch import launch
from reshard.refit import RefitError, RefitSession, Side

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# every session wait: launch() starts the ranks once every process is up, so a connect waits only for
# the peers' work before it (a small model built or loaded, ~2-5 s here, ~10 s with both cores busy):
# a margin of 6x or more
TIMEOUT = __import__("datetime").timedelta(seconds=60)
CONFIG = dict(hidden_size=64, num_hidden_layers=2, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=128, max_position_embeddings=64, tie_word_embeddings=False)


def save_model(path, **overrides) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", **{**CONFIG, **overrides})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(path)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def storage(model) -> dict[str, int]:
    """Where each parameter's local data lives."""
    return {n: (p.to_local() if hasattr(p, "to_local") else p).data_ptr() for n, p in model.named_parameters()}


def trainer_model(path):
    """The model under FSDP2 (each decoder layer and the root sharded over the trainer's group), with
    an optimizer."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt, step) -> None:
    torch.manual_seed(100 + step)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter gathered (a collective over the model's group)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def _fsdp_to_hf(job, job_rank, rank, world, store_addr, path, out_dir, steps):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if job == 0:  # trainer: FSDP2 over ranks 0-1
        model, opt = trainer_model(path)
        session = RefitSession.connect(source=Side.from_module(model, rank), store_addr=store_addr, rank=rank,
                                       world_size=world, timeout=TIMEOUT, max_bucket_bytes=64 << 10)
        for step in range(steps):
            train_step(model, opt, step)
            state = full_state(model)
            if job_rank == 0:
                torch.save(state, f"{out_dir}/expected{step}.pt")
            stats = session.refit(version=step)
            assert stats.sent_bytes > 0 and stats.recv_bytes == 0, stats
        session.close()
        return
    # inference: transformers tp_plan over ranks 2-3 (its own group: mesh ranks 0-1 are refit ranks 2-3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(tp_plan="auto", tp_size=2))
    before = full_state(model)
    side = Side.from_module(model, rank, rank_of={0: 2, 1: 3})
    session = RefitSession.connect(destination=side, store_addr=store_addr, rank=rank, world_size=world,
                                   timeout=TIMEOUT, max_bucket_bytes=64 << 10)
    plan, fingerprint = session.plan, session.plan.fingerprint()
    live = storage(model)
    memory = []
    for step in range(steps):
        stats = session.refit(version=step)
        assert session.version == step and session.state == "ready"
        want = torch.load(f"{out_dir}/expected{step}.pt")
        got = full_state(model)
        assert got.keys() == want.keys()
        bad = [n for n in got if not torch.equal(got[n], want[n])]
        assert not bad, (rank, step, bad[:5])
        assert any(not torch.equal(got[n], before[n]) for n in got)  # the trainer's steps really changed them
        # in place: the parameters' storage is the one the model computes with
        assert storage(model) == live
        assert stats.in_place_bytes == side.layout_bytes() and stats.reprocessed_bytes == 0
        assert stats.recv_bytes > 0 and stats.sent_bytes == 0
        memory.append(rss_mb())
    assert session.plan is plan and plan.fingerprint() == fingerprint  # planned once, replayed
    assert memory[-1] - memory[1] < 16, memory  # no growth from refit to refit
    session.close()
    with torch.no_grad():  # the refitted TP model runs
        model(input_ids=torch.arange(8).reshape(1, 8))


def test_fsdp2_trainer_refits_hf_tp_model_in_place(tmp_path):
    pytest.importorskip("transformers")
    path = str(tmp_path / "model")
    save_model(path)
    launch(_fsdp_to_hf, [2, 2], path, str(tmp_path), 5)


def _mismatch(job, job_rank, rank, world, store_addr, path, other, message):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(other if job == 0 else path, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if job == 0:
        names = None if message == "shape" else [n for n, _ in model.named_parameters() if "norm" not in n]
        kw = {"source": Side.from_module(model, rank, names=names)}
    else:
        kw = {"destination": Side.from_module(model, rank)}
    with pytest.raises(RefitError) as err:
        RefitSession.connect(store_addr=store_addr, rank=rank, world_size=world, timeout=TIMEOUT, **kw)
    text = str(err.value)
    if message == "shape":
        assert re.search(r"tensor 'model\.layers\.\d\.mlp\.\w+_proj\.weight': source shape \(\d+, \d+\) != "
                         r"destination shape", text), text
    else:
        assert re.search(r"unknown tensor 'model\.\S*norm\.weight': destination rank 1 needs it", text), text
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing moved


@pytest.mark.parametrize("message", ["shape", "missing"])
def test_mismatched_sides_fail_at_connect_on_every_rank(tmp_path, message):
    pytest.importorskip("transformers")
    path, other = str(tmp_path / "model"), str(tmp_path / "other")
    save_model(path)
    save_model(other, intermediate_size=96 if message == "shape" else 128)
    launch(_mismatch, [1, 1], path, other, message)


def _explicit(rank, world):
    w = rs.TensorSpec("w", (8, 6), torch.bfloat16)
    src = rs.Layout.from_placements(w, [0, 1], (2,), [rs.Shard(0)])
    dst = rs.Layout.from_placements(w, [2, 3], (2,), [rs.Replicate()])
    full = torch.arange(48, dtype=torch.bfloat16).reshape(8, 6)
    source = Side.from_layout(src, rank, src.materialize(rank, {"w": full})) if rank < 2 else None
    destination = Side.from_layout(dst, rank, dst.empty_buffers(rank)) if rank >= 2 else None
    session = RefitSession.connect(source=source, destination=destination, timeout=TIMEOUT)  # default group
    assert session.method == "reshard" and len(session.plan.phases) == 1  # gloo: no NVLink domains found
    for version in ("a", "b"):
        if source is not None:
            source.tensors["w"].add_(1)
        stats = session.refit(version)
        assert session.version == version
    if destination is not None:
        assert torch.equal(destination.tensors["w"], full + 2) and stats.recv_bytes == 96
    session.close()
    # NVLink domains given: "auto" takes the hierarchical plan, whose network phase brings each
    # byte into domain 1 once, then forwards it over the domain
    hier = RefitSession.connect(source=source, destination=destination, group=dist.group.WORLD, timeout=TIMEOUT,
                                domains={0: 0, 1: 0, 2: 1, 3: 1})
    assert hier.method == "hierarchical" and len(hier.plan.phases) > 1
    if source is not None:
        source.tensors["w"].add_(1)
    stats = hier.refit("c")
    if destination is not None:
        assert torch.equal(destination.tensors["w"], full + 3)
    network = torch.tensor([stats.run.phases[0].recv_bytes if destination is not None else 0])
    dist.all_reduce(network)
    assert network.item() == 96  # into domain 1 once, not once per rank
    hier.close()
    dist.barrier()


def test_explicit_layouts_over_the_default_group():
    rs.spawn(_explicit, 4)
