"""DeepSpeed ZeRO-3 as a refit source (``reshard.frameworks.deepspeed``, ``reshard.integrations.deepspeed``).

Pure property tests: a flat chunk's boxes are contiguous runs of the tensor in order, at most
``2*ndim - 1`` of them, and over every rank of every world size (world > numel included) every
element of every tensor is in exactly one piece; a refit from :func:`zero3_layout` rebuilds the
tensors.

Real DeepSpeed (0.19, its CPU accelerator, 2 gloo processes): a tiny Qwen3 (dense, and MoE with
transformers 5's fused experts) under ``deepspeed.zero.Init`` + ``deepspeed.initialize``, one
optimizer step; each rank's side (built before the step: its views follow the partitions) is
bit-equal to ``GatheredParameters`` and the ranks' pieces cover every logical tensor once.
Unsupported configurations (stage 2, hpZ, MiCS, a parameter outside ZeRO-3) are refused with
an error naming the option. A ZeRO-3 trainer refits a real vLLM CPU engine through the
``reshard`` backend, bit-exact against a fresh engine loaded from the gathered weights; and
``examples/deepspeed_refit.py`` runs.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as rs
from reshard.frameworks.deepspeed import flat_boxes, zero3_chunk, zero3_layout, zero3_pieces
from reshard.models import model_specs
from reshard.models.arch import parameter_segments
from reshard.tensors import LayoutError, TensorSpec, buffer_view

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)


# ------------------------------------------------------------------ pure: the layout
@PROPS
@given(shape=shapes, data=st.data())
def test_flat_boxes_are_the_range_in_order(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    boxes = flat_boxes(shape, start, stop)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    flat = torch.arange(numel).reshape(shape)
    got = []
    for offsets, sizes, first in boxes:
        assert all(s > 0 for s in sizes)
        block = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        # contiguous in memory: the box is the run first : first + its size
        assert block.reshape(-1).tolist() == list(range(first, first + math.prod(sizes)))
        got += block.reshape(-1).tolist()
    assert got == list(range(start, stop))


@PROPS
@given(shape=shapes, world=st.integers(1, 9))
def test_every_element_is_in_exactly_one_piece(shape, world):
    numel = math.prod(shape)
    count = np.zeros(shape, np.int64)
    ends = []
    for r in range(world):
        start, stop = zero3_chunk(numel, world, r)
        ends.append((start, stop))
        pieces, specs, buffers = zero3_pieces("w", shape, torch.float32, start, stop, r)
        assert sum(math.prod(s) for s, _, _ in buffers.values()) == stop - start  # padding is in no buffer
        for p in pieces:
            count[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))] += 1
    assert (count == 1).all()
    ps = -(-numel // world)
    assert ends == [(min(r * ps, numel), min((r + 1) * ps, numel)) for r in range(world)]


@PROPS
@given(experts=st.integers(1, 3), rows=st.integers(1, 4), cols=st.integers(1, 5), world=st.integers(1, 7))
def test_fused_experts_are_cut_into_checkpoint_names(experts, rows, cols, world):
    name = "model.layers.0.mlp.experts.gate_up_proj"
    shape = (experts, 2 * rows, cols)
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    want = {s.name: full[g.lead][g.offsets[0]:g.offsets[0] + s.shape[0]]
            for s, g in parameter_segments(name, shape, torch.float32)}
    got = {n: torch.full_like(t, -1.0) for n, t in want.items()}
    for r in range(world):
        start, stop = zero3_chunk(full.numel(), world, r)
        pieces, specs, buffers = zero3_pieces(name, shape, torch.float32, start, stop, r)
        assert set(specs) == set(want)
        views = {b: full.reshape(-1)[first:first + math.prod(sizes)].view(sizes)
                 for b, (sizes, _, first) in buffers.items()}
        for p in pieces:
            box = tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))
            assert (got[p.tensor][box] == -1).all()
            got[p.tensor][box] = buffer_view(views[p.buffer], p.buffer_offsets, p.sizes)
    assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_refit_from_zero3_layout_rebuilds_the_model(world):
    from tiny_archs import tiny

    arch = tiny("qwen3_moe")
    src = zero3_layout(arch, range(world))
    specs = model_specs(arch)
    full = {s.name: torch.randn(s.shape, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(specs)}
    dst = rs.Layout.merge(rs.Layout.from_placements(s, [world], (1,), [rs.Replicate()]) for s in specs)
    flat = {n: t.reshape(-1) for n, t in full.items()}
    bufs = {}
    for r in range(world):
        bufs[r] = {}
        for b, (shape, _) in src.buffers(r).items():
            name, _, rng = b.rpartition("[")
            first = int(rng.split(":")[0])
            bufs[r][b] = flat[name][first:first + math.prod(shape)].view(shape).clone()
    out = {world: dst.empty_buffers(world)}
    rs.run_local(rs.plan(src, dst), bufs, out)
    assert all(torch.equal(out[world][n], full[n]) for n in full)


def test_zero3_layout_bad_input():
    with pytest.raises(LayoutError, match="partition rank 2 is not below the world size 2"):
        zero3_chunk(10, 2, 2)
    with pytest.raises(LayoutError, match="distinct"):
        zero3_layout([TensorSpec("w", (3,), torch.float32)], [0, 0])
    with pytest.raises(LayoutError, match="flat range 3:9 is outside a tensor of shape \\(2, 3\\)"):
        flat_boxes((2, 3), 3, 9)


# ------------------------------------------------------------------ real DeepSpeed, 2 gloo processes
def _deepspeed_env(job_rank: int, world: int) -> None:
    """What DeepSpeed needs beside an existing default gloo group: its CPU accelerator, its rank."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(job_rank), WORLD_SIZE=str(world), LOCAL_RANK=str(job_rank),
                      LOCAL_WORLD_SIZE=str(world))


def ds_config(stage: int = 3, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "zero_optimization": {"stage": stage, **zero},
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "torch_adam": True}}}


def zero3_model(kind: str, config: dict, **overrides):
    """A toy Qwen3 (``kind`` dense or moe, fp32) built under ``zero.Init`` (stage 3) and wrapped by
    ``deepspeed.initialize``: the engine."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    from reshard.apps.toy_models import config as toy_config

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = toy_config(kind, **overrides)
    if config["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def train_step(engine, seed: int) -> float:
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(seed))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def gathered(module) -> dict[str, torch.Tensor]:
    """Every logical tensor of a ZeRO-3 module (checkpoint names), gathered with ``GatheredParameters``."""
    import deepspeed

    out = {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            full = p.data.detach().clone()
        for spec, seg in parameter_segments(name, tuple(full.shape), full.dtype):
            t = full[seg.lead] if seg.lead else full
            out[spec.name] = t[tuple(slice(o, o + s) for o, s in zip(seg.offsets, spec.shape))].clone()
    return out


def _check_against_gathered(job_rank, kind):
    from reshard.integrations.deepspeed import zero3_side
    from reshard.integrations.vllm import ReshardSource
    from reshard.refit import Side

    engine = zero3_model(kind, ds_config())
    source = ReshardSource(engine.module)
    side = source.side(job_rank)  # built before the step: its buffers follow the partitions
    with pytest.raises(LayoutError, match="DeepSpeed ZeRO-3 model.*zero3_side"):
        Side.from_module(engine.module, job_rank)
    train_step(engine, 1)
    full = gathered(engine.module)
    assert {m.name: (tuple(m.shape), m.dtype) for m in source.metadata()} == {
        n: (tuple(t.shape), t.dtype) for n, t in full.items()}  # every logical tensor, checkpoint names
    assert kind == "dense" or "model.layers.1.mlp.experts.7.up_proj.weight" in full
    for s in (side, zero3_side(engine, job_rank), ReshardSource(engine).side(job_rank)):
        bufs = s.read()
        for p in s.layout.pieces(job_rank):
            got = buffer_view(bufs[p.buffer], p.buffer_offsets, p.sizes)
            want = full[p.tensor][tuple(slice(o, o + n) for o, n in zip(p.offsets, p.sizes))]
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), p
            assert got.untyped_storage().data_ptr() == next(
                t for n, t in engine.module.named_parameters() if p.buffer.startswith(n + "[")
            ).ds_tensor.untyped_storage().data_ptr()  # a view of the partition, not a copy
    boxes = [(p.tensor, p.offsets, p.sizes) for p in side.layout.pieces(job_rank)]
    every = [None, None]
    dist.all_gather_object(every, boxes)
    if job_rank == 0:
        count = {n: np.zeros(t.shape, np.int64) for n, t in full.items()}
        for name, offsets, sizes in every[0] + every[1]:
            count[name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
        assert all((c == 1).all() for c in count.values()), [n for n, c in count.items() if not (c == 1).all()]
        assert set(side.layout.specs) == set(full)


def _check_refusals(job_rank):
    from deepspeed.runtime.config import DeepSpeedConfigError

    from reshard.integrations.deepspeed import zero3_side
    from reshard.integrations.vllm import ReshardSource

    stage2 = zero3_model("dense", ds_config(stage=2))
    for what in (stage2, ReshardSource(stage2)):
        with pytest.raises(LayoutError, match=r"zero_optimization\.stage is 2, not 3"):
            what.side(job_rank) if isinstance(what, ReshardSource) else zero3_side(what, job_rank)
    with pytest.raises(LayoutError, match=r"no parameter .* has a ds_tensor.*stage 0/1/2"):
        zero3_side(stage2.module, job_rank)

    hpz = zero3_model("dense", ds_config(zero_hpz_partition_size=2))
    with pytest.raises(LayoutError, match="zero_hpz_partition_size is 2"):
        zero3_side(hpz, job_rank)
    with pytest.raises(LayoutError, match="hpZ secondary partitions .*zero_hpz_partition_size"):
        ReshardSource(hpz.module).side(job_rank)

    # DeepSpeed 0.19 removed MiCS and refuses its option itself; a model partitioned by an older MiCS
    # (its parameters carry the shard groups in ``comm``) is refused by name
    with pytest.raises(DeepSpeedConfigError, match="mics_shard_size"):
        zero3_model("dense", ds_config(mics_shard_size=2))
    engine = zero3_model("dense", ds_config())
    p = engine.module.model.norm.weight
    p.comm = type("MiCS_CommGroups", (), {"param_shard_group": None})()
    with pytest.raises(LayoutError, match=r"'model\.norm\.weight' is partitioned by MiCS \(mics_shard_size\)"):
        zero3_side(engine, job_rank)
    del p.comm
    # a parameter that ZeRO-3 did not partition, in a ZeRO-3 model
    engine.module.lm_head.weight = torch.nn.Parameter(torch.zeros(320, 64))
    with pytest.raises(LayoutError, match=r"rank \d: deepspeed parameter 'lm_head\.weight' has no ds_tensor"):
        zero3_side(engine, job_rank)
    # rank_of that contradicts the default group
    with pytest.raises(LayoutError, match="is refit rank"):
        zero3_side(engine.module, job_rank, rank_of={0: 1, 1: 0})


def _check_sides_and_refusals(job, job_rank, rank, world, store_addr):
    _deepspeed_env(job_rank, 2)
    for kind in ("dense", "moe"):
        _check_against_gathered(job_rank, kind)
    _check_refusals(job_rank)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero3_sides_match_gathered_parameters_and_bad_configurations_are_refused():
    """Dense and MoE sides against ``GatheredParameters``, then the refusals, in one launch of 2 processes
    (each model and engine built afresh in it: the processes' start and DeepSpeed's import paid once)."""
    pytest.importorskip("deepspeed")
    from launch import launch

    launch(_check_sides_and_refusals, [2])


# ------------------------------------------------------------------ a ZeRO-3 trainer refits a real vLLM engine
def _refit_vllm(job, job_rank, rank, world, store_addr, ckpt, out_dir):
    _deepspeed_env(job_rank, 2)
    import deepspeed
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard.execution.process_group import free_port
    from reshard.integrations.vllm import ReshardSource, ReshardTrainerInitInfo
    from reshard.options import RefitOptions
    from vllm_helpers import close_engine, engine_tensors, start_engine

    engine = zero3_model("dense", ds_config())
    llm, port = None, [0]
    try:
        if job_rank == 0:
            llm = start_engine(ckpt)
            port = [free_port()]
        dist.broadcast_object_list(port, src=0)
        info = ReshardTrainerInitInfo(rank=job_rank, master_address="127.0.0.1", master_port=port[0],
                                      num_trainer_ranks=2, world_size=3,
                                      options=RefitOptions(timeout=120, max_bucket_bytes=1 << 20))
        sync = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ReshardSource(engine))
        sent = []
        for step in range(2):
            train_step(engine, 10 + step)
            stats = sync.send_weights(weight_version=f"zero3-{step}")
            sent.append(stats.sent_bytes)
            if job_rank == 0:
                assert llm.get_weight_version() == f"zero3-{step}"
        sync.shutdown()
        state = {}
        for name, p in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                state[name] = p.data.detach().clone()
        every = [None, None]
        dist.all_gather_object(every, sent)
        if job_rank == 0:
            model_bytes = sum(t.numel() * 2 for t in state.values())  # the engine's bf16 weights
            for per_rank in zip(*every):  # each rank sent its own half, together the model, once
                assert all(0 < s < model_bytes for s in per_rank) and abs(sum(per_rank) - model_bytes) <= 64, \
                    (per_rank, model_bytes)
            torch.save({"state": state, "got": llm.collective_rpc(engine_tensors)}, f"{out_dir}/zero3.pt")
    finally:
        if llm is not None:
            close_engine(llm)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero3_trainer_refits_a_vllm_engine_bit_exact(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("vllm")
    from launch import launch
    from vllm_helpers import close_engine, differences, engine_tensors, reap_engine_processes, save_checkpoint
    from vllm_helpers import start_engine, use_cpu_engines

    use_cpu_engines(HERE)
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(ckpt, "dense", seed=3, dtype=torch.float32)
    with reap_engine_processes():
        launch(_refit_vllm, [2], ckpt, str(tmp_path))
        out = torch.load(str(tmp_path / "zero3.pt"))
        save_checkpoint(str(tmp_path / "fresh"), "dense", state=out["state"])
        fresh = start_engine(str(tmp_path / "fresh"))
        try:
            want = fresh.collective_rpc(engine_tensors)
        finally:
            close_engine(fresh)
    assert len(out["got"]) == len(want) == 1
    bad = differences(out["got"][0], want[0])
    assert not bad, bad[:8]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_example_deepspeed_refit_runs():
    pytest.importorskip("deepspeed")
    pytest.importorskip("vllm")
    from vllm_helpers import reap_engine_processes

    with reap_engine_processes():
        done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "deepspeed_refit.py"), "--steps", "2"],
                              capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and "engine at step-1" in lines[-1], done.stdout[-2000:]
