"""FSDP2 / HSDP (over TP) training layouts (``reshard.frameworks.fsdp``).

Pure tests compare the layout with local shards built by hand with ``torch.chunk`` (FSDP2 chunks
dim 0 of what TP left on the rank). ``test_against_torch_fully_shard`` applies torch's real
``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``) and ``fully_shard`` to a tiny
module with the Hugging Face names over 4 gloo processes and compares every parameter's
``to_local()`` with ``layout.materialize(rank, full)``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import reshard as rs
from reshard.frameworks.fsdp import fsdp_layout, fsdp_placements
from reshard.frameworks.tensor_parallel import tp_placement
from reshard.models import Arch, model_specs
from reshard.placements import from_torch_placement

F32 = torch.float32
# uneven everywhere: vocab 130, kv rows 12, expert intermediate 10 (5 per TP rank -> 3 + 2)
QWEN3_MOE = Arch("qwen3_moe", hidden=16, layers=2, vocab=130, heads=4, kv_heads=2, head_dim=6, intermediate=0,
                 experts=3, moe_intermediate=10, dtype=F32)
DEEPSEEK = Arch("deepseek_v3", hidden=16, layers=3, vocab=150, heads=4, kv_heads=4, head_dim=6, intermediate=24,
                experts=4, moe_intermediate=8, shared_experts=1, first_dense_layers=1, q_lora_rank=12,
                kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, mtp_layers=1, dtype=F32)
LLAMA = Arch("llama", hidden=12, layers=2, vocab=50, heads=4, kv_heads=2, head_dim=3, intermediate=20, dtype=F32)


def full_tensors(specs):
    return {s.name: (torch.arange(s.numel, dtype=F32) + 1000 * i).reshape(s.shape) for i, s in enumerate(specs)}


def expected_local(name, w, d, t, *, dp_shard, tp):
    """FSDP2's local shard on (dp_shard coord d, tp coord t), by hand: TP chunk, then dim-0 chunk."""
    pl = tp_placement(name, w.dim())
    if tp > 1 and pl != rs.Replicate():
        w = w.chunk(tp, dim=pl.dim)[t] if t < len(w.chunk(tp, dim=pl.dim)) else w.narrow(pl.dim, 0, 0)
    chunks = w.chunk(dp_shard, dim=0)
    return chunks[d] if d < len(chunks) else w.narrow(0, 0, 0)


@pytest.mark.parametrize("arch", [QWEN3_MOE, DEEPSEEK, LLAMA], ids=lambda a: a.family)
@pytest.mark.parametrize("dp_replicate, dp_shard, tp", [(1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2), (1, 3, 2),
                                                         (1, 7, 1)])
def test_refit_into_fsdp_matches_torch_chunk(arch, dp_replicate, dp_shard, tp):
    specs = model_specs(arch)
    world = dp_replicate * dp_shard * tp
    dst = fsdp_layout(arch, range(world), dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp, validate=True)
    full = full_tensors(specs)
    src = rs.Layout.merge(rs.Layout.from_placements(s, [world], (1,), [rs.Replicate()]) for s in specs)
    plan = rs.plan(src, dst)
    dst_bufs = {r: dst.empty_buffers(r) for r in range(world)}
    rs.run_local(plan, {world: src.materialize(world, full)}, dst_bufs)
    for r in range(world):
        d, t = (r // tp) % dp_shard, r % tp
        assert sorted(dst_bufs[r]) == sorted(full)
        for name, w in full.items():
            want = expected_local(name, w, d, t, dp_shard=dp_shard, tp=tp)
            assert torch.equal(dst_bufs[r][name], want), (r, name)


def test_placements_table():
    q = rs.TensorSpec("model.layers.0.self_attn.q_proj.weight", (8, 4), F32)
    o = rs.TensorSpec("model.layers.0.self_attn.o_proj.weight", (4, 8), F32)
    n = rs.TensorSpec("model.layers.0.input_layernorm.weight", (4,), F32)
    e = rs.TensorSpec("model.embed_tokens.weight", (10, 4), F32)
    r = rs.TensorSpec("model.layers.3.mlp.gate.weight", (4, 4), F32)
    assert fsdp_placements(q, dp_shard=4) == ((4,), [rs.Shard(0)])
    assert fsdp_placements(q, dp_shard=2, dp_replicate=2) == ((2, 2), [rs.Replicate(), rs.Shard(0)])
    assert fsdp_placements(q, dp_shard=2, tp=2) == ((2, 2), [rs.StridedShard(0, 2), rs.Shard(0)])
    assert fsdp_placements(o, dp_shard=2, tp=2) == ((2, 2), [rs.Shard(0), rs.Shard(1)])
    assert fsdp_placements(n, dp_shard=2, tp=2) == ((2, 2), [rs.Shard(0), rs.Replicate()])
    assert fsdp_placements(e, dp_shard=2, tp=4) == ((2, 4), [rs.StridedShard(0, 4), rs.Shard(0)])  # vocab rows
    assert fsdp_placements(r, dp_shard=2, tp=2) == ((2, 2), [rs.Shard(0), rs.Replicate()])  # router
    assert fsdp_placements(q, dp_shard=2, dp_replicate=3, tp=2) == (
        (3, 2, 2), [rs.Replicate(), rs.StridedShard(0, 2), rs.Shard(0)])


def test_docstring_example_strided_rows():
    w = rs.TensorSpec("model.layers.0.mlp.up_proj.weight", (8, 2), F32)
    lay = fsdp_layout([w], range(4), dp_shard=2, tp=2)
    # rank 1 = (dp 0, tp 1): TP shard 1 is rows 4:8, its dp chunk 0 is rows 4:6
    assert [(p.offsets, p.sizes) for p in lay.pieces(1)] == [((4, 0), (2, 2))]
    # rank 2 = (dp 1, tp 0): rows 2:4
    assert [(p.offsets, p.sizes) for p in lay.pieces(2)] == [((2, 0), (2, 2))]


def test_tp_plan_override_and_errors():
    specs = [rs.TensorSpec("model.layers.0.self_attn.q_proj.weight", (8, 4), F32)]
    lay = fsdp_layout(specs, range(4), dp_shard=2, tp=2, tp_plan={"*.q_proj": "rowwise"})
    assert lay.buffers(1)["model.layers.0.self_attn.q_proj.weight"][0] == (4, 2)
    with pytest.raises(rs.LayoutError, match=re.escape("unknown TP style 'sideways'")):
        fsdp_layout(specs, range(4), dp_shard=2, tp=2, tp_plan={"*": "sideways"})
    with pytest.raises(rs.LayoutError, match=re.escape("3 ranks given, but dp_replicate*dp_shard*tp = 1*2*2 = 4")):
        fsdp_layout(specs, range(3), dp_shard=2, tp=2)
    with pytest.raises(rs.LayoutError, match="dp_shard must be a positive integer"):
        fsdp_layout(specs, range(3), dp_shard=0)
    with pytest.raises(rs.LayoutError, match="scalar"):
        fsdp_layout([rs.TensorSpec("s", (), F32)], range(2), dp_shard=2)
    with pytest.raises(rs.LayoutError, match="colwise needs a 2-D weight"):
        fsdp_layout([rs.TensorSpec("x.q_proj.weight", (4,), F32)], range(2), dp_shard=1, tp=2)


def test_dtype_override_and_shared_arrays():
    lay = fsdp_layout(LLAMA, range(4), dp_shard=4, dtype=torch.bfloat16)
    assert {dt for _, dt in lay.buffers(2).values()} == {torch.bfloat16}
    a = lay.tables["model.layers.0.self_attn.q_proj.weight"]
    b = lay.tables["model.layers.1.self_attn.q_proj.weight"]
    assert a.offsets is b.offsets and a.geometry_key() == b.geometry_key()


# ----------------------------------------------------------------------------- against torch


class _Holder(nn.Module):
    pass


def hf_module(specs) -> nn.Module:
    """A module whose named_parameters are exactly ``specs`` (nn.Linear / nn.Embedding for 2-D weights)."""
    root = _Holder()
    for s in specs:
        *path, leaf = s.name.split(".")
        mod = root
        for i, part in enumerate(path):
            if not hasattr(mod, part):
                if i == len(path) - 1 and len(s.shape) == 2 and leaf == "weight":
                    new = (nn.Embedding(*s.shape) if part == "embed_tokens"
                           else nn.Linear(s.shape[1], s.shape[0], bias=False))
                else:
                    new = _Holder()
                mod.add_module(part, new)
            mod = getattr(mod, part)
        if not hasattr(mod, leaf):
            mod.register_parameter(leaf, nn.Parameter(torch.empty(s.shape, dtype=s.dtype)))
    return root


def _torch_scenario(rank, world, arch, dp_replicate, dp_shard, tp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    specs = model_specs(arch)
    full = full_tensors(specs)
    m = hf_module(specs)
    assert sorted(n for n, _ in m.named_parameters()) == sorted(full)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(full[n])
    mesh = init_device_mesh("cpu", (dp_replicate, dp_shard, tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    if tp > 1:  # the TP plan, applied the way torchtitan does, from our own placement rule
        plan = {}
        for n, mod in m.named_modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                pl = tp_placement(n + ".weight", 2)
                if pl == rs.Replicate():
                    continue
                rows = pl == rs.Shard(0)
                emb = isinstance(mod, nn.Embedding)
                plan[n] = ColwiseParallel() if rows != emb else RowwiseParallel()
        parallelize_module(m, mesh["tp"], plan)
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dp_replicate > 1 else mesh["dp_shard"]
    for i in range(arch.layers + arch.mtp_layers):
        fully_shard(getattr(m.model.layers, str(i)), mesh=dp_mesh)
    fully_shard(m, mesh=dp_mesh)
    lay = fsdp_layout(arch, range(world), dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp)
    want = lay.materialize(rank, full)
    for n, p in m.named_parameters():
        local = p.to_local()
        assert local.shape == want[n].shape and torch.equal(local, want[n]), (arch.family, rank, n, p.placements)
        mesh_shape, placements = fsdp_placements(lay.specs[n], dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp)
        if tuple(p.device_mesh.shape) == mesh_shape:  # TP-replicated params live on the DP mesh only
            assert [from_torch_placement(x) for x in p.placements] == placements, (n, p.placements)


def _torch_main(rank, world):
    torch.manual_seed(0)
    for arch, dp_replicate, dp_shard, tp in [(QWEN3_MOE, 1, 4, 1), (DEEPSEEK, 2, 2, 1), (QWEN3_MOE, 1, 2, 2),
                                             (DEEPSEEK, 1, 2, 2), (LLAMA, 2, 1, 2)]:
        _torch_scenario(rank, world, arch, dp_replicate, dp_shard, tp)


@pytest.mark.slow
def test_against_torch_fully_shard():
    """FSDP2, HSDP, FSDP2 over TP (strided rows), HSDP over TP with dp_shard=1: torch's own local shards."""
    rs.spawn(_torch_main, 4, backend="gloo")
