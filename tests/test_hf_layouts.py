"""Hugging Face transformers ``tp_plan="auto"`` layouts.

Fast tests: plan + ``run_local`` from a replicated full source into ``hf_layout`` for tiny
configs, against local shards built by hand with ``torch.chunk`` (independent of the
layout code). Slow test: small random models built and saved with transformers, loaded
with ``tp_plan="auto"`` over gloo, every real local shard compared with the layout.
"""

from __future__ import annotations

import re

import pytest
import torch

import reshard as rs
from reshard.frameworks.hf import (TP_PLANS, check_hf_parameters, hf_layout, hf_parameters, hf_tp_plan, tp_placement,
                                   tp_style)
from reshard.models import Arch, from_module, model_specs

F32 = torch.float32


def qwen3(tie=False, **kw) -> Arch:
    base = dict(family="qwen3", hidden=64, layers=2, vocab=128, heads=4, kv_heads=2, head_dim=16, intermediate=96,
                tie_embeddings=tie, dtype=F32)
    base.update(kw)
    return Arch(**base)


def qwen3_moe(tie=False, **kw) -> Arch:
    # moe_intermediate 24: 2*I != hidden, so a transposed fused expert parameter would show in its shape
    return qwen3(tie, **{"family": "qwen3_moe", "experts": 4, "moe_intermediate": 24, **kw})


def llama(**kw) -> Arch:
    return qwen3(family="llama", **kw)


def deepseek(**kw) -> Arch:
    base = dict(family="deepseek_v3", hidden=64, layers=2, vocab=128, heads=4, kv_heads=4, head_dim=24,
                intermediate=96, experts=4, moe_intermediate=24, shared_experts=1, first_dense_layers=1,
                q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, dtype=F32)
    base.update(kw)
    return Arch(**base)


def _full(arch):
    out = {}
    for i, s in enumerate(model_specs(arch)):
        vals = (torch.arange(s.numel, dtype=torch.int64) * 7 + 1000 * i) % 4093 - 2046
        out[s.name] = vals.reshape(s.shape).to(s.dtype)
    return out


def _chunk(x, tp, dim, t):
    """torch.chunk's part ``t`` of ``tp``, empty past the last chunk (DTensor's Shard rule)."""
    parts = torch.chunk(x, tp, dim)
    return parts[t] if t < len(parts) else x.narrow(dim, 0, 0)


_ROWS = re.compile(r"self_attn\.[qkv]_proj\.weight$|mlp\.(shared_experts\.)?(gate|up)_proj\.weight$|^lm_head\.weight$")
_COLS = re.compile(r"self_attn\.o_proj\.weight$|mlp\.(shared_experts\.)?down_proj\.weight$")


def _expected(arch, full, tp, t):
    """What mesh coordinate ``t`` of ``tp`` holds, by hand: {parameter name: local tensor}."""
    out = {}
    mla = arch.family == "deepseek_v3"
    for name, x in full.items():
        if ".experts." in name and ".shared_experts." not in name:
            continue
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= arch.layers:
            continue
        if name == "model.embed_tokens.weight":
            out[name] = _chunk(x, tp, 0, t) if arch.tie_embeddings else x
        elif mla and ".self_attn." in name:
            out[name] = x  # transformers' DeepSeek-V3 plan leaves MLA attention whole
        elif _ROWS.search(name):
            out[name] = _chunk(x, tp, 0, t)
        elif _COLS.search(name):
            out[name] = _chunk(x, tp, 1, t)
        else:
            out[name] = x
    for i in range(arch.layers):
        if not arch.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack([
            torch.cat([_chunk(full[f"{p}{e}.gate_proj.weight"], tp, 0, t),
                       _chunk(full[f"{p}{e}.up_proj.weight"], tp, 0, t)]) for e in range(arch.experts)])
        out[p + "down_proj"] = torch.stack([_chunk(full[f"{p}{e}.down_proj.weight"], tp, 1, t)
                                            for e in range(arch.experts)])
    return out


CASES = {
    "qwen3_tp2_dp2": (qwen3(), 2, 2),
    "qwen3_tied_tp4_more_than_kv_heads": (qwen3(tie=True), 4, 1),
    "qwen3_uneven_tp3": (qwen3(intermediate=100, vocab=129, heads=6, kv_heads=3), 3, 1),  # rows 100 = 34+34+32
    "qwen3_moe_tp2": (qwen3_moe(), 2, 1),
    "qwen3_moe_uneven_tp2_dp2": (qwen3_moe(moe_intermediate=5), 2, 2),  # gate/up rows 3 + 2 of each expert
    "qwen3_moe_tied_tp4": (qwen3_moe(tie=True), 4, 1),
    "llama_tp2": (llama(), 2, 1),
    "deepseek_tp2_dp2": (deepseek(), 2, 2),
    "deepseek_mtp_tp2": (deepseek(mtp_layers=1), 2, 1),
    "tp1": (qwen3_moe(), 1, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_run_local_matches_hand_built_shards(case):
    arch, tp, dp = CASES[case]
    dst_ranks = list(range(1, 1 + tp * dp))
    dst = hf_layout(arch, dst_ranks, tp, dp, partial_heads=True)
    src = rs.Layout.merge(rs.Layout.from_placements(s, [0], (1,), [rs.Replicate()]) for s in dst.tensors)
    plan = rs.plan(src, dst)
    full = _full(arch)
    src_bufs = {0: src.materialize(0, full)}
    dst_bufs = {r: dst.empty_buffers(r) for r in dst_ranks}
    rs.run_local(plan, src_bufs, dst_bufs)
    for i, r in enumerate(dst_ranks):
        want = _expected(arch, full, tp, i % tp)
        assert set(dst_bufs[r]) == set(want), (case, r, set(dst_bufs[r]) ^ set(want))
        for name, w in want.items():
            got = dst_bufs[r][name]
            assert got.shape == w.shape and got.dtype == w.dtype, (case, r, name, got.shape, w.shape)
            assert torch.equal(got, w), (case, r, name)
        assert dst.materialize(r, full).keys() == dst_bufs[r].keys()


def test_buffers_and_dtypes():
    arch = deepseek(dtype=torch.bfloat16)
    lay = hf_layout(arch, [4, 5], 2, dtype=torch.bfloat16)
    bufs = lay.buffers(5)
    assert bufs["model.layers.1.mlp.gate.e_score_correction_bias"] == ((4,), F32)  # always fp32, whole
    assert bufs["model.layers.1.mlp.experts.gate_up_proj"] == ((4, 24, 64), torch.bfloat16)
    assert bufs["model.layers.1.mlp.experts.down_proj"] == ((4, 64, 12), torch.bfloat16)
    assert bufs["model.layers.1.mlp.shared_experts.down_proj.weight"] == ((64, 12), torch.bfloat16)
    assert bufs["model.layers.0.self_attn.kv_b_proj.weight"] == ((128, 32), torch.bfloat16)
    assert bufs["lm_head.weight"] == ((64, 64), torch.bfloat16)
    # tied: one buffer, lm_head's rows split
    tied = hf_layout(qwen3(tie=True), [0, 1], 2)
    assert "lm_head.weight" not in tied.buffers(0)
    assert tied.buffers(1)["model.embed_tokens.weight"] == ((64, 64), F32)
    # MTP layers are not in transformers' DeepSeek-V3 model
    mtp = hf_layout(deepseek(mtp_layers=1), [0, 1], 2)
    assert not [n for n in mtp.specs if n.startswith("model.layers.2.")]


def test_expert_pieces_example():
    lay = hf_layout(qwen3_moe(), [0, 1], 2)
    pieces = {(p.tensor, p.buffer_offsets): p for p in lay.pieces(1) if ".experts.3." in p.tensor and
              p.tensor.startswith("model.layers.0.")}
    gate = pieces[("model.layers.0.mlp.experts.3.gate_proj.weight", (3, 0, 0))]
    up = pieces[("model.layers.0.mlp.experts.3.up_proj.weight", (3, 12, 0))]
    down = pieces[("model.layers.0.mlp.experts.3.down_proj.weight", (3, 0, 0))]
    assert (gate.offsets, gate.sizes, gate.buffer) == ((12, 0), (12, 64), "model.layers.0.mlp.experts.gate_up_proj")
    assert (up.offsets, up.sizes) == ((12, 0), (12, 64))
    assert (down.offsets, down.sizes, down.buffer) == ((0, 12), (64, 12), "model.layers.0.mlp.experts.down_proj")


def test_errors():
    with pytest.raises(rs.LayoutError, match=r"'lm_head' \(colwise_gather_output\) needs its output size 128 "
                                             r"divisible by tp=3"):
        hf_layout(qwen3(heads=6, kv_heads=3), [0, 1, 2], 3)
    with pytest.raises(rs.LayoutError, match=r"output size 130 divisible by tp=4"):
        hf_layout(qwen3(tie=True, vocab=130), [0, 1, 2, 3], 4)  # tied: checked on lm_head all the same
    with pytest.raises(rs.LayoutError, match=r"tp=4 does not divide the 4 attention heads and 2 KV heads"):
        hf_layout(qwen3(), [0, 1, 2, 3], 4)
    assert hf_layout(deepseek(heads=4), [0, 1, 2, 3, 4, 5, 6, 7], 8)  # MLA attention is not split
    with pytest.raises(rs.LayoutError, match=re.escape("3 ranks given, but tp*dp = 2*2 = 4")):
        hf_layout(qwen3(), [0, 1, 2], 2, 2)
    with pytest.raises(rs.LayoutError, match="repeat a rank"):
        hf_layout(qwen3(), [0, 0], 2)
    arch = qwen3_moe()
    shapes = {p.name: p.shape for p in hf_parameters(arch)}
    check_hf_parameters(arch, shapes)
    hf_layout(arch, [0, 1], 2, param_shapes=shapes)
    transposed = dict(shapes, **{"model.layers.1.mlp.experts.gate_up_proj": (4, 64, 48)})
    with pytest.raises(rs.LayoutError, match=r"'model.layers.1.mlp.experts.gate_up_proj' stores its experts "
                                             r"transposed, \(4, 64, 48\) instead of \(4, 48, 64\)"):
        hf_layout(arch, [0, 1], 2, param_shapes=transposed)
    with pytest.raises(rs.LayoutError, match="does not describe"):
        check_hf_parameters(arch, dict(shapes, **{"model.layers.0.self_attn.q_proj.bias": (64,)}))
    with pytest.raises(rs.LayoutError, match="lacks parameter"):
        check_hf_parameters(arch, {k: v for k, v in shapes.items() if "norm" not in k})
    with pytest.raises(rs.LayoutError, match="has shape"):
        check_hf_parameters(arch, dict(shapes, **{"model.norm.weight": (65,)}))


def test_tp_style_and_placement():
    plan = TP_PLANS["qwen3_moe"]
    assert tp_style(plan, "model.layers.12.self_attn.q_proj.weight") == "colwise"
    assert tp_style(plan, "model.layers.3.mlp.experts.gate_up_proj") == "packed_colwise"
    assert tp_style(plan, "model.layers.3.mlp.gate.weight") is None
    assert tp_style(plan, "model.embed_tokens.weight") is None
    params = {p.name: p for p in hf_parameters(qwen3_moe(tie=True))}
    emb = params["model.embed_tokens.weight"]
    assert tp_style(plan, emb.plan_name) is None
    assert tp_style(hf_tp_plan(qwen3_moe(tie=True)), emb.plan_name) == "embedding_rowwise"
    assert tp_placement(emb, "embedding_rowwise", 2) == rs.Shard(0)
    assert tp_placement(emb, "colwise", 2) == rs.Shard(1)
    gu = params["model.layers.0.mlp.experts.gate_up_proj"]
    assert tp_placement(gu, "packed_colwise", 2) == rs.StridedShard(1, 2)
    assert tp_placement(gu, "packed_colwise", 1) == rs.Replicate()
    with pytest.raises(rs.LayoutError, match="style 'bogus'"):
        tp_placement(gu, "bogus", 2)


# ----------------------------------------------------------------------------- against real transformers

MOE_EXTRA = {"num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": []}
SLOW_MODELS = {  # name -> (arch, extra config.json values)
    "qwen3": (qwen3(), {}),
    "qwen3_moe": (qwen3_moe(), MOE_EXTRA),
    "qwen3_tied": (qwen3(tie=True), {}),
    # tp=4 with 4 KV heads; local I = 12 keeps grouped_mm's 16-byte strides
    "qwen3_moe_tied": (qwen3_moe(tie=True, kv_heads=4, moe_intermediate=48), MOE_EXTRA),
    "llama": (llama(), {}),
    # head_dim: transformers uses it as the rotary dim (qk_rope_head_dim); to_hf_config gives nope + rope
    "deepseek": (deepseek(), {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "head_dim": 8}),
}
# tp=4: qwen3_tied has 2 KV heads (transformers splits heads: loads, cannot run), qwen3_moe_tied 4
SPAWNS = {2: ["qwen3", "qwen3_moe", "llama", "deepseek"], 4: ["qwen3_tied", "qwen3_moe_tied"]}


def _build_and_save(arch, extra, path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from reshard.models.arch import to_hf_config

    cfg = to_hf_config(arch)
    cfg.update(extra)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(F32)
    model.save_pretrained(path)
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    return {k: v.detach().clone() for k, v in state.items()}, model


def _check_rank(rank, world, models):
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    try:
        from transformers.distributed import DistributedConfig
        kw = {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=world)}
    except ImportError:  # transformers 4.x
        kw = {"tp_plan": "auto", "tp_size": world}
    for name, path in models:
        arch = SLOW_MODELS[name][0]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F32, **kw)
        logical = load_file(f"{path}/model.safetensors")
        hf_full = torch.load(f"{path}/full_params.pt")
        assert dict(model.tp_plan) == hf_tp_plan(arch), (name, model.tp_plan)
        real = dict(model.named_parameters())
        # from_module reads DTensors' global shapes: the same specs as the unsharded model's
        fused = from_module(model, checkpoint_names=False)
        assert {s.name: s.shape for s in fused if s.name in real} == {n: tuple(hf_full[n].shape) for n in real}, name
        assert {s.name: s.shape for s in from_module(model)} == {s.name: s.shape for s in model_specs(arch)}, name
        partial = arch.kv_heads % world != 0
        layout = hf_layout(arch, list(range(world)), world, param_shapes={n: p.shape for n, p in real.items()},
                           partial_heads=partial)
        mine = layout.materialize(rank, logical)
        state = dict(real)
        state.update((n, b) for n, b in model.named_buffers() if n in mine)  # DeepSeek's router bias
        assert set(mine) == set(state), (name, set(mine) ^ set(state))
        for pname, p in state.items():
            local = p.to_local() if isinstance(p, DTensor) else p
            want = mine[pname]
            assert local.shape == want.shape and local.dtype == want.dtype, (name, rank, pname, local.shape, want.shape)
            assert torch.equal(local, want), (name, rank, pname)
            if isinstance(p, DTensor):
                theirs = rs.Layout.from_dtensor(pname, p).materialize(rank, {pname: hf_full[pname]})[pname]
                assert torch.equal(theirs, local), (name, rank, pname, p.placements)
        if partial:
            continue  # transformers' attention cannot run on fractions of heads
        # forward runs on the TP model and agrees across ranks
        with torch.no_grad():
            logits = model(torch.arange(8).reshape(1, 8) % arch.vocab).logits
        gathered = [torch.empty_like(logits) for _ in range(world)]
        torch.distributed.all_gather(gathered, logits.contiguous())
        assert all(torch.equal(g, gathered[0]) for g in gathered), name


@pytest.mark.slow
def test_layouts_match_transformers_tp(tmp_path):
    pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")
    for world, names in SPAWNS.items():
        models = []
        for name in names:
            arch, extra = SLOW_MODELS[name]
            path = str(tmp_path / name)
            full, model = _build_and_save(arch, extra, path)
            torch.save(full, f"{path}/full_params.pt")
            logical = safetensors.load_file(f"{path}/model.safetensors")
            saved = {k: tuple(v.shape) for k, v in logical.items()}
            specs = {s.name: s.shape for s in model_specs(arch)}
            assert saved == specs, (name, set(saved) ^ set(specs))  # checkpoint names = logical tensors
            # unsharded (tp=1) layout = transformers' own fused parameters
            one = hf_layout(arch, [0], 1).materialize(0, logical)
            assert all(torch.equal(one[n], full[n]) for n in one), name
            # from_module splits transformers' fused experts back into the checkpoint's names and
            # shapes, and reads persistent buffers (e_score_correction_bias) too: exactly the logical tensors
            got = {s.name: s.shape for s in from_module(model)}
            assert got == specs, (name, set(got) ^ set(specs))
            fused = {s.name for s in from_module(model, checkpoint_names=False)}
            assert any(re.search(r"\.experts\.(gate_up_proj|down_proj)$", n) for n in fused) == arch.is_moe, name
            models.append((name, path))
        rs.spawn(_check_rank, world, models)
