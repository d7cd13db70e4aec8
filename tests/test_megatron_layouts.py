"""Megatron-Core training layouts (``reshard.frameworks.megatron``).

Pure tests (no process): for tiny models of every family, the full Hugging Face tensors sit on
one source rank, the destination is ``megatron_layout``; ``rs.plan`` + ``rs.run_local`` fill
every Megatron buffer, and each buffer is compared with one built here independently, by hand,
from the full tensors with Megatron's rules (reshape/cat, no pieces):

- rank order: nested loops over pp, dp, cp, tp (dense) and pp, expert-dp, ep, etp (experts),
  innermost fastest (megatron-core ``RankGenerator`` with ``order="tp-cp-ep-dp-pp"``);
- ``linear_qkv``: q, k, v viewed per query group and concatenated [q_g; k_g; v_g], then chunked
  by TP (megatron-core ``SelfAttention.get_query_key_value_tensors`` splits it back this way);
- ``linear_fc1`` (SwiGLU): [gate chunk t; up chunk t] (megatron-core ``apply_swiglu_sharded_factory``);
- vocab padded with zero rows to a multiple of 128 * tp (Megatron-LM ``_vocab_size_with_padding``);
- layers per stage, renumbered from 0; experts ``ep_rank * E/ep + j``; replicas over DP/CP/EDP.

The tests marked ``megatron`` check the same layouts against megatron-core itself (its
``RankGenerator``, and real ``GPTModel`` instances over gloo); they skip where megatron-core is
not installed.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import reshard as rs
from reshard.frameworks.megatron import (megatron_grid, megatron_layout, pipeline_split, suggest_pp_layers,
                                         vocab_size_with_padding, with_aliases)
from reshard.models import Arch, get_arch, model_specs

F32 = torch.float32
LLAMA = Arch("llama", hidden=16, layers=4, vocab=300, heads=4, kv_heads=2, head_dim=8, intermediate=24, dtype=F32)
QWEN3_TIED = Arch("qwen3", hidden=16, layers=4, vocab=200, heads=8, kv_heads=4, head_dim=4, intermediate=16,
                  tie_embeddings=True, dtype=F32)
QWEN3_MOE = Arch("qwen3_moe", hidden=16, layers=2, vocab=130, heads=4, kv_heads=2, head_dim=8, intermediate=0,
                 experts=4, moe_intermediate=8, dtype=F32)
DEEPSEEK = Arch("deepseek_v3", hidden=16, layers=3, vocab=150, heads=4, kv_heads=4, head_dim=6, intermediate=24,
                experts=4, moe_intermediate=8, shared_experts=1, first_dense_layers=1, q_lora_rank=12,
                kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, mtp_layers=1, dtype=F32)
DEEPSEEK_NO_QLORA = Arch("deepseek_v3", hidden=16, layers=2, vocab=64, heads=2, kv_heads=2, head_dim=6,
                         intermediate=8, experts=2, moe_intermediate=4, first_dense_layers=1, q_lora_rank=None,
                         kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, dtype=F32)


def full_tensors(arch: Arch) -> dict[str, torch.Tensor]:
    """Distinct values everywhere, so a misplaced element cannot go unnoticed."""
    out = {}
    base = 0
    for s in model_specs(arch):
        out[s.name] = (torch.arange(s.numel, dtype=torch.float64) + base).reshape(s.shape).to(s.dtype)
        base += s.numel
    return out


# ----------------------------------------------------------------------------- the hand-built reference


def coords(world, tp, cp, dp, pp, ep, etp):
    """{index: (tp, dp-ish replica, pp)} dense and {index: (etp, ep, pp)} expert, by nested loops."""
    dense, expert = {}, {}
    i = 0
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    dense[i] = (t, p)
                    i += 1
    assert i == world
    edp = world // (etp * ep * pp)
    i = 0
    for p in range(pp):
        for d in range(edp):
            for e in range(ep):
                for t in range(etp):
                    expert[i] = (t, e, p)
                    i += 1
    return dense, expert


def vocab_shard(w, tp, t):
    padded = -(-w.shape[0] // (128 * tp)) * 128 * tp
    full = torch.cat([w, torch.zeros(padded - w.shape[0], *w.shape[1:], dtype=w.dtype)])
    return full.chunk(tp)[t]


def fc1(gate, up, n, t):
    return torch.cat([gate.chunk(n)[t], up.chunk(n)[t]])


def expected_buffers(arch: Arch, full, rank_index, *, tp, cp, dp, pp, ep, etp, pp_layers=None, te=True,
                     grouped=True):
    """Megatron's local parameters of the rank at ``rank_index``, built from the full HF tensors."""
    etp = etp or tp
    world = tp * cp * dp * pp
    dense, expert = coords(world, tp, cp, dp, pp, ep, etp)
    t, stage = dense[rank_index]
    et, er, _ = expert[rank_index]
    counts = pp_layers or [arch.layers // pp] * pp
    first = sum(counts[:stage])
    layers = range(first, first + counts[stage])
    out = {}
    a = arch
    if stage == 0:
        out["embedding.word_embeddings.weight"] = vocab_shard(full["model.embed_tokens.weight"], tp, t)

    def layer(i, pre):
        p = f"model.layers.{i}."
        W = lambda n: full[p + n]  # noqa: E731
        moe = a.is_moe_layer(i)
        if a.is_mla:
            out[pre + "input_layernorm.weight"] = W("input_layernorm.weight")
            down = (lambda w: w) if te else (lambda w: w.chunk(tp)[t])
            if a.q_lora_rank:
                out[pre + "self_attention.linear_q_down_proj.weight"] = down(W("self_attn.q_a_proj.weight"))
                qn = "linear_q_up_proj.layer_norm_weight" if te else "q_layernorm.weight"
                out[pre + "self_attention." + qn] = W("self_attn.q_a_layernorm.weight")
                out[pre + "self_attention.linear_q_up_proj.weight"] = W("self_attn.q_b_proj.weight").chunk(tp)[t]
            else:
                out[pre + "self_attention.linear_q_proj.weight"] = W("self_attn.q_proj.weight").chunk(tp)[t]
            out[pre + "self_attention.linear_kv_down_proj.weight"] = down(W("self_attn.kv_a_proj_with_mqa.weight"))
            kn = "linear_kv_up_proj.layer_norm_weight" if te else "kv_layernorm.weight"
            out[pre + "self_attention." + kn] = W("self_attn.kv_a_layernorm.weight")
            out[pre + "self_attention.linear_kv_up_proj.weight"] = W("self_attn.kv_b_proj.weight").chunk(tp)[t]
        else:
            ng, qpg, hd, h = a.kv_heads, a.heads // a.kv_heads, a.head_dim, a.hidden
            qkv = torch.cat([W("self_attn.q_proj.weight").reshape(ng, qpg * hd, h),
                             W("self_attn.k_proj.weight").reshape(ng, hd, h),
                             W("self_attn.v_proj.weight").reshape(ng, hd, h)], dim=1).reshape(-1, h)
            out[pre + "self_attention.linear_qkv.weight"] = qkv.chunk(tp)[t]
            ln = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
            out[pre + ln] = W("input_layernorm.weight")
            if a.family in ("qwen3", "qwen3_moe"):
                out[pre + "self_attention.q_layernorm.weight"] = W("self_attn.q_norm.weight")
                out[pre + "self_attention.k_layernorm.weight"] = W("self_attn.k_norm.weight")
        out[pre + "self_attention.linear_proj.weight"] = W("self_attn.o_proj.weight").chunk(tp, dim=1)[t]
        ln = "mlp.linear_fc1.layer_norm_weight" if te and not moe else "pre_mlp_layernorm.weight"
        out[pre + ln] = W("post_attention_layernorm.weight")
        if not moe:
            out[pre + "mlp.linear_fc1.weight"] = fc1(W("mlp.gate_proj.weight"), W("mlp.up_proj.weight"), tp, t)
            out[pre + "mlp.linear_fc2.weight"] = W("mlp.down_proj.weight").chunk(tp, dim=1)[t]
            return
        out[pre + "mlp.router.weight"] = W("mlp.gate.weight")
        if a.is_mla:
            out[pre + "mlp.router.expert_bias"] = W("mlp.gate.e_score_correction_bias")
        per = a.experts // ep
        for j in range(per):
            e = er * per + j
            n1, n2 = ((f"experts.linear_fc1.weight{j}", f"experts.linear_fc2.weight{j}") if grouped else
                      (f"experts.local_experts.{j}.linear_fc1.weight", f"experts.local_experts.{j}.linear_fc2.weight"))
            out[pre + "mlp." + n1] = fc1(W(f"mlp.experts.{e}.gate_proj.weight"), W(f"mlp.experts.{e}.up_proj.weight"),
                                         etp, et)
            out[pre + "mlp." + n2] = W(f"mlp.experts.{e}.down_proj.weight").chunk(etp, dim=1)[et]
        if a.shared_experts:
            s = "mlp.shared_experts."
            out[pre + s + "linear_fc1.weight"] = fc1(W(s + "gate_proj.weight"), W(s + "up_proj.weight"), tp, t)
            out[pre + s + "linear_fc2.weight"] = W(s + "down_proj.weight").chunk(tp, dim=1)[t]

    for li, i in enumerate(layers):
        layer(i, f"decoder.layers.{li}.")
    if stage == pp - 1:
        out["decoder.final_layernorm.weight"] = full["model.norm.weight"]
        if not a.tie_embeddings:
            out["output_layer.weight"] = vocab_shard(full["lm_head.weight"], tp, t)
        elif pp > 1:
            out["output_layer.weight"] = vocab_shard(full["model.embed_tokens.weight"], tp, t)
        for k in range(a.mtp_layers):
            i = a.layers + k
            p, q = f"model.layers.{i}.", f"mtp.layers.{k}."
            out[q + "enorm.weight"] = full[p + "enorm.weight"]
            out[q + "hnorm.weight"] = full[p + "hnorm.weight"]
            out[q + "eh_proj.weight"] = full[p + "eh_proj.weight"].chunk(tp)[t]
            out[q + "final_layernorm.weight"] = full[p + "shared_head.norm.weight"]
            out[f"embedding.word_embeddings.weight#mtp{k}"] = vocab_shard(full[p + "embed_tokens.weight"], tp, t)
            out[f"output_layer.weight#mtp{k}"] = vocab_shard(full[p + "shared_head.head.weight"], tp, t)
            layer(i, q + "transformer_layer.")
    return out


# ----------------------------------------------------------------------------- refit into the layout


def refit_and_compare(arch, *, tp=1, cp=1, dp=1, pp=1, ep=1, etp=None, pp_layers=None, te=True, grouped=True,
                      rank_offset=0):
    world = tp * cp * dp * pp
    ranks = [rank_offset + i for i in range(world)]
    dst = megatron_layout(arch, ranks, tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, pp_layers=pp_layers,
                          transformer_impl="transformer_engine" if te else "local", moe_grouped_gemm=grouped,
                          validate=True)
    assert sorted(dst.specs) == sorted(s.name for s in model_specs(arch))
    full = full_tensors(arch)
    src_rank = rank_offset + world
    src = rs.Layout.merge(rs.Layout.from_placements(s, [src_rank], (1,), [rs.Replicate()]) for s in model_specs(arch))
    plan = rs.plan(src, dst)
    src_bufs = {src_rank: src.materialize(src_rank, full)}
    dst_bufs = {r: dst.empty_buffers(r) for r in ranks}
    rs.run_local(plan, src_bufs, dst_bufs)
    for i, r in enumerate(ranks):
        want = expected_buffers(arch, full, i, tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, pp_layers=pp_layers,
                                te=te, grouped=grouped)
        got = dst_bufs[r]
        assert sorted(got) == sorted(want), (r, sorted(set(got) ^ set(want)))
        for name, w in want.items():
            assert got[name].shape == w.shape, (r, name, got[name].shape, w.shape)
            assert torch.equal(got[name], w.to(got[name].dtype)), (r, name)
        # materialize follows the same layout (padding rows stay zero)
        mat = dst.materialize(r, full)
        assert all(torch.equal(mat[k], got[k]) for k in got)
    return dst


@pytest.mark.parametrize("kw", [
    dict(tp=1),
    dict(tp=2, dp=2, pp=2),
    dict(tp=2, pp=2, pp_layers=[1, 3]),
    dict(tp=2, cp=2),
    dict(tp=2, te=False),
], ids=lambda kw: ",".join(f"{k}{v}" for k, v in kw.items()))
def test_llama(kw):
    refit_and_compare(LLAMA, **kw)


@pytest.mark.parametrize("kw", [
    dict(tp=2, pp=2, pp_layers=[3, 1]),  # tied: the last stage's output_layer copies embed_tokens
    dict(tp=4),  # 4 query groups over 4 ranks: one group each
    dict(tp=2, dp=2),  # 2 groups per rank: q/k/v at strided positions
    dict(pp=4, te=False),
], ids=lambda kw: ",".join(f"{k}{v}" for k, v in kw.items()))
def test_qwen3_tied(kw):
    refit_and_compare(QWEN3_TIED, **kw)


@pytest.mark.parametrize("kw", [
    dict(tp=2, dp=2, ep=2, etp=1),  # expert grid etp1 x ep2 x edp2
    dict(tp=2, dp=2, ep=2),  # etp defaults to tp: etp2 x ep2
    dict(tp=1, dp=4, ep=4, grouped=False),  # SequentialMLP names, one expert per rank
    dict(tp=2, dp=2, pp=2, ep=2, etp=2, te=False, grouped=False),
    dict(tp=1, dp=4, pp=2, ep=2),  # expert dp 2 over 8 ranks
], ids=lambda kw: ",".join(f"{k}{v}" for k, v in kw.items()))
def test_qwen3_moe(kw):
    refit_and_compare(QWEN3_MOE, **kw)


@pytest.mark.parametrize("kw", [
    dict(tp=2, dp=2, pp=2, ep=2, pp_layers=[2, 1]),
    dict(tp=2, pp=2, ep=2, etp=1, pp_layers=[1, 2]),
    dict(tp=2, dp=2, ep=4, etp=1, te=False, grouped=False),
    dict(tp=1, dp=2, pp=3, ep=2),
], ids=lambda kw: ",".join(f"{k}{v}" for k, v in kw.items()))
def test_deepseek_mla_mtp(kw):
    refit_and_compare(DEEPSEEK, **kw)


def test_deepseek_without_q_lora():
    refit_and_compare(DEEPSEEK_NO_QLORA, tp=2, ep=2, etp=1)
    refit_and_compare(DEEPSEEK_NO_QLORA, tp=2, ep=2, etp=1, te=False, grouped=False)


def test_global_ranks_need_not_start_at_zero():
    refit_and_compare(LLAMA, tp=2, pp=2, rank_offset=5)


# ----------------------------------------------------------------------------- piece structure


def test_qkv_pieces_land_at_strided_positions():
    # 8 heads, 4 query groups of 2 q heads, head_dim 4, hidden 16; tp=2 -> 2 groups per rank.
    lay = megatron_layout(QWEN3_TIED, range(2), tp=2)
    got = {(p.tensor.rsplit(".", 2)[-2], p.offsets[0], p.sizes[0], p.buffer_offsets[0])
           for p in lay.pieces(1) if p.buffer == "decoder.layers.0.self_attention.linear_qkv.weight"}
    # rank 1 holds groups 2, 3: per group [2 q heads (8 rows); k (4); v (4)] = 16 rows
    assert got == {("q_proj", 16, 8, 0), ("k_proj", 8, 4, 8), ("v_proj", 8, 4, 12),
                   ("q_proj", 24, 8, 16), ("k_proj", 12, 4, 24), ("v_proj", 12, 4, 28)}
    assert lay.buffers(1)["decoder.layers.0.self_attention.linear_qkv.weight"] == ((32, 16), F32)


def test_vocab_padding_rows_belong_to_no_tensor():
    assert vocab_size_with_padding(300, 2) == 512
    assert vocab_size_with_padding(151936, 8) == 152576
    assert vocab_size_with_padding(129280, 1) == 129280
    lay = megatron_layout(Arch("llama", 16, 2, 100, 4, 4, 8, 24, dtype=F32), range(4), tp=4)
    # 100 rows padded to 512: rank 0 holds 0:100 of its 128, ranks 1-3 only padding
    assert lay.buffers(0)["embedding.word_embeddings.weight"] == ((128, 16), F32)
    emb = [p for r in range(4) for p in lay.pieces(r) if p.tensor == "model.embed_tokens.weight"]
    assert [(p.rank, p.offsets, p.sizes) for p in emb] == [(0, (0, 0), (100, 16))]
    assert "embedding.word_embeddings.weight" in lay.buffers(3)


def test_replicas_over_dp_cp_and_expert_dp():
    lay = megatron_layout(QWEN3_MOE, range(8), tp=2, dp=2, cp=2, ep=2, etp=1)
    t = lay.tables["model.layers.0.self_attn.o_proj.weight"]
    # tp coordinate 0 is ranks 0, 2, 4, 6 (tp fastest, then cp, then dp)
    assert sorted(t.ranks[t.offsets[:, 1] == 0].tolist()) == [0, 2, 4, 6]
    t = lay.tables["model.layers.0.mlp.experts.3.down_proj.weight"]
    # expert grid etp1 x ep2 x edp4: ep rank 1 (experts 2, 3) is every odd rank
    assert sorted(t.ranks.tolist()) == [1, 3, 5, 7]
    held = {p.buffer for r in (1, 3) for p in lay.pieces(r) if p.tensor.endswith("0.mlp.experts.3.down_proj.weight")}
    assert held == {"decoder.layers.0.mlp.experts.linear_fc2.weight1"}


def test_pipeline_stages_and_local_numbering():
    lay = megatron_layout(LLAMA, range(2), pp=2, pp_layers=[1, 3])
    names0, names1 = set(lay.buffers(0)), set(lay.buffers(1))
    assert "embedding.word_embeddings.weight" in names0 and "embedding.word_embeddings.weight" not in names1
    assert {"output_layer.weight", "decoder.final_layernorm.weight"} <= names1
    assert "decoder.layers.1.self_attention.linear_qkv.weight" not in names0
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in names1
    t = lay.tables["model.layers.1.self_attn.q_proj.weight"]  # global layer 1 = stage 1, local 0
    assert set(t.ranks.tolist()) == {1} and set(t.buffers) == {"decoder.layers.0.self_attention.linear_qkv.weight"}


def test_rank_grid_table_from_the_docstring():
    g = megatron_grid(8, tp=2, pp=2, ep=2, etp=1)
    assert g.dp == 2 and g.edp == 2
    assert g.dense[:, 0].tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert g.dense[:, 2].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert g.dense[:, 3].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert g.expert[:, 1].tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert g.expert[:, 2].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]


def test_dtype_override_keeps_expert_bias_fp32():
    lay = megatron_layout(DEEPSEEK, range(2), tp=2, dtype=torch.bfloat16, validate=True)
    b = lay.buffers(0)
    assert b["decoder.layers.1.mlp.router.expert_bias"][1] == torch.float32
    assert b["decoder.layers.1.mlp.router.weight"][1] == torch.bfloat16


def test_with_aliases_binds_mtp_buffers():
    lay = megatron_layout(DEEPSEEK, range(1))
    params = {n: torch.zeros(s, dtype=d) for n, (s, d) in lay.buffers(0).items() if "#" not in n}
    bound = with_aliases(lay, 0, params)
    assert bound["output_layer.weight#mtp0"] is params["output_layer.weight"]
    assert bound["embedding.word_embeddings.weight#mtp0"] is params["embedding.word_embeddings.weight"]
    with pytest.raises(rs.LayoutError, match="output_layer.weight"):
        with_aliases(lay, 0, {k: v for k, v in params.items() if k != "output_layer.weight"})


def test_dp_defaults_to_what_the_ranks_leave():
    lay = megatron_layout(QWEN3_MOE, range(16), tp=2, pp=2, ep=4, etp=1)  # dp = 4, expert-dp = 2
    t = lay.tables["model.layers.1.mlp.experts.0.up_proj.weight"]
    assert sorted(t.ranks.tolist()) == [8, 12]  # stage 1, ep rank 0, expert-dp 0 and 1
    assert sorted(lay.tables["model.norm.weight"].ranks.tolist()) == list(range(8, 16))


def test_pipeline_split():
    assert suggest_pp_layers(61, 4) == [16, 15, 15, 15] and suggest_pp_layers(62, 4) == [15, 16, 16, 15]
    assert suggest_pp_layers(61, 16) == [2] + [4] * 14 + [3]  # not [16, 3, ..., 3]
    assert pipeline_split(8, 4) == [2, 2, 2, 2]
    assert pipeline_split(61, 4, [16, 15, 15, 15]) == [16, 15, 15, 15]


# ----------------------------------------------------------------------------- errors


def raises(*parts):
    return pytest.raises(rs.LayoutError, match=".*".join(re.escape(p) for p in parts))


@pytest.mark.parametrize("arch, ranks, kw, msg", [
    (LLAMA, 4, dict(tp=4), ["tp=4 does not divide the 2 kv heads"]),
    (LLAMA, 8, dict(tp=8), ["tp=8 does not divide the 4 attention heads"]),
    (LLAMA, 4, dict(tp=2, dp=1), ["4 ranks given", "tp*cp*dp*pp = 2*1*1*1 = 2"]),
    (LLAMA, 3, dict(tp=2), ["3 ranks do not divide by tp*cp*pp = 2"]),
    (LLAMA, 2, dict(dp=0), ["dp must be a positive integer"]),
    (LLAMA, 3, dict(pp=3), ["4 layers do not split evenly over pp=3", "pp_layers=[2, 1, 1]"]),
    (LLAMA, 2, dict(pp=2, pp_layers=[1, 2]), ["pp_layers [1, 2] sum to 3, the model has 4 layers"]),
    (LLAMA, 2, dict(pp=2, pp_layers=[4]), ["pp_layers has 1 entries for pp=2"]),
    (LLAMA, 2, dict(dp=2, ep=2), ["ep=2 but the model has no experts"]),
    (LLAMA, 2, dict(tp=0), ["tp must be a positive integer"]),
    (QWEN3_MOE, 3, dict(dp=3, ep=3), ["ep=3 does not divide the 4 experts"]),
    (QWEN3_MOE, 4, dict(dp=4, ep=2, etp=4), ["world size 4 does not divide by etp*ep*pp = 4*2*1"]),
    (QWEN3_MOE, 2, dict(tp=2, etp=2, ep=1, moe_grouped_gemm=True, transformer_impl="local"),
     ["legacy GroupedMLP"]),
    (LLAMA, 1, dict(transformer_impl="te"), ["transformer_impl must be one of"]),
    (Arch("llama", 16, 2, 64, 4, 2, 8, 20, dtype=F32), 8, dict(tp=8), ["tp=8 does not divide the 4 attention heads",
                                                                      "intermediate size 20"]),
    (DEEPSEEK.with_overrides(qk_rope_head_dim=4), 4, dict(tp=4, te=False, moe_grouped_gemm=False, pp_layers=[3]),
     ["kv_lora_rank + qk_rope_head_dim = 10"]),
])
def test_impossible_configs(arch, ranks, kw, msg):
    kw = dict(kw)
    if kw.pop("te", True) is False:
        kw["transformer_impl"] = "local"
    with raises(*msg):
        megatron_layout(arch, range(ranks), **kw)


def test_deepseek_local_mla_down_proj_needs_tp_dividing():
    with raises("tp=4 does not divide q_lora_rank 10 (local MLA)"):
        megatron_layout(DEEPSEEK.with_overrides(q_lora_rank=10), range(4), tp=4, etp=1, transformer_impl="local",
                        moe_grouped_gemm=False)


def test_repeated_ranks():
    with raises("ranks repeat a rank"):
        megatron_layout(LLAMA, [0, 0], dp=2)


def test_presets_build_fast_enough_for_a_test():
    # the scale configs themselves are timed in the benchmark; here a mid-size one, unvalidated
    lay = megatron_layout(get_arch("qwen3-30b-a3b"), range(16), tp=2, ep=8, etp=1, pp=2, dp=4, validate=False)
    assert len(lay.specs) == len(model_specs(get_arch("qwen3-30b-a3b")))


# ============================================================================= against megatron-core
#
# Needs megatron-core (``pip install --no-deps megatron-core``; it imports on CPU without
# Transformer Engine). What is checked where:
#
# - rank order: megatron-core's own ``parallel_state.RankGenerator`` (dense generator with ep=1,
#   expert generator with cp=1, ``order="tp-cp-ep-dp-pp"``, as ``initialize_model_parallel`` builds
#   them) against ``megatron_grid``;
# - names, local shapes and values: real ``GPTModel`` instances (``get_gpt_decoder_block_spec`` /
#   ``get_gpt_layer_local_spec``, i.e. ``transformer_impl="local"``) on 4 gloo processes with
#   ``initialize_model_parallel``: every rank's ``named_parameters`` (+ the router's
#   ``expert_bias`` buffer) equal the layout's buffers by name and shape; the layout's
#   ``materialize`` is loaded into the model and Megatron's forward (TP all-reduces, MoE token
#   dispatch over EP, PP hand-off by send/recv) gives the logits of a plain-torch Hugging Face-style
#   forward of the full tensors; ``sharded_state_dict()`` (Megatron's checkpoint metadata) puts each
#   local parameter at the global layer, global expert and global offset the layout says (fc1's
#   gate/up halves through its SwiGLU factory);
# - Transformer Engine names (the default ``transformer_impl``) cannot be instantiated without TE:
#   they are checked against the keys the local model's ``sharded_state_dict`` writes, which
#   megatron-core maps to the TE names (``sharded_state_dict_keys_map`` in
#   ``get_gpt_layer_local_spec``) for dense GQA layers; MLA's TE names
#   (``linear_q_up_proj.layer_norm_weight``, ``linear_kv_up_proj.layer_norm_weight``, duplicated
#   ``linear_q_down_proj`` / ``linear_kv_down_proj``), MoE layers' ``pre_mlp_layernorm`` and
#   ``TEGroupedMLP``'s ``linear_fc1.weight{j}`` follow megatron-core 0.16's
#   ``get_gpt_layer_with_transformer_engine_spec`` / ``TEGroupedMLP`` source, not a run;
# - vocab padding: Megatron-LM's ``_vocab_size_with_padding`` lives in ``megatron/training``, not in
#   megatron-core; the models here are built with our padded size, so a wrong padding shows up
#   as a shape mismatch against Megatron's ``VocabParallelEmbedding`` split.
#
# megatron-core 0.16 on a CPU-only torch needs a few patches in the worker processes, none of
# which touches a weight's layout: ``torch.cuda.current_device`` returns "cpu" (rotary embedding
# and router move tensors to it), ``Tensor.cuda`` is the identity (MTP's embedding-group
# all-reduce), the CUDA RNG tracker's ``fork`` is a no-op (dropout is 0), ``moe_utils.te_general_gemm``
# is defined as None (a NameError without TE), MLA's ``HAVE_TE`` is False (TE classes are
# MagicMock placeholders), and MLA's core attention is plain SDPA (the local DotProductAttention
# does not take MLA's k/v head sizes).


@pytest.mark.parametrize("tp, cp, dp, pp, ep, etp", [
    (2, 1, 2, 2, 2, 1), (1, 1, 8, 2, 4, 1), (2, 2, 2, 1, 2, 2), (4, 1, 4, 2, 2, 2), (1, 2, 4, 2, 8, 1),
])
def test_rank_order_matches_megatron_rank_generator(tp, cp, dp, pp, ep, etp):
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    world = tp * cp * dp * pp
    g = megatron_grid(world, tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    grids = ((dense, g.dense, ("tp", "cp", "dp", "pp")), (expert, g.expert, ("tp", "ep", "dp", "pp")))
    for gen, coords_, tokens in grids:
        for col, tok in enumerate(tokens):
            groups = gen.get_ranks(tok)
            assert sorted(r for grp in groups for r in grp) == list(range(world))
            for grp in groups:
                for k, r in enumerate(grp):
                    assert coords_[r, col] == k, (tok, r, grp)
                # the other coordinates are constant within a group
                assert len({tuple(coords_[r, [c for c in range(4) if c != col]]) for r in grp}) == 1


# ----------------------------------------------------------------------------- reference forward


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_tables(dim, s, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    emb = torch.cat([torch.outer(torch.arange(s, dtype=torch.float32), inv)] * 2, -1)
    return emb.cos(), emb.sin()


def _rotate(t, cos, sin):
    d = t.shape[-1]
    return t * cos + torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1) * sin


def hf_reference(a: Arch, W, ids, topk=2):
    """Logits of a plain-torch forward of the Hugging Face tensors (Llama / Qwen3 / Qwen3-MoE with
    softmax top-k routing / DeepSeek-V3 MLA with dense MLPs)."""
    def mlp(h, p):
        return (F.silu(h @ W[p + "gate_proj.weight"].T) * (h @ W[p + "up_proj.weight"].T)) @ W[p + "down_proj.weight"].T

    b, s = ids.shape
    x = W["model.embed_tokens.weight"][ids]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        h = _rms(x, W[p + "input_layernorm.weight"])
        if a.is_mla:
            r, nope, vd, H = a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim, a.heads
            cos, sin = _rope_tables(r, s)
            deint = lambda t: t.view(*t.shape[:-1], r // 2, 2).transpose(-1, -2).reshape(t.shape)  # noqa: E731
            q = _rms(h @ W[p + "self_attn.q_a_proj.weight"].T, W[p + "self_attn.q_a_layernorm.weight"])
            q = (q @ W[p + "self_attn.q_b_proj.weight"].T).view(b, s, H, nope + r).transpose(1, 2)
            q_nope, q_pe = q.split([nope, r], -1)
            c, k_pe = (h @ W[p + "self_attn.kv_a_proj_with_mqa.weight"].T).split([a.kv_lora_rank, r], -1)
            kv = _rms(c, W[p + "self_attn.kv_a_layernorm.weight"]) @ W[p + "self_attn.kv_b_proj.weight"].T
            k_nope, v = kv.view(b, s, H, nope + vd).transpose(1, 2).split([nope, vd], -1)
            q_pe, k_pe = _rotate(deint(q_pe), cos, sin), _rotate(deint(k_pe.view(b, 1, s, r)), cos, sin)
            q = torch.cat([q_nope, q_pe], -1)
            k = torch.cat([k_nope, k_pe.expand(b, H, s, r)], -1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=(nope + r) ** -0.5)
        else:
            hd = a.head_dim
            cos, sin = _rope_tables(hd, s)
            q = (h @ W[p + "self_attn.q_proj.weight"].T).view(b, s, a.heads, hd)
            k = (h @ W[p + "self_attn.k_proj.weight"].T).view(b, s, a.kv_heads, hd)
            v = (h @ W[p + "self_attn.v_proj.weight"].T).view(b, s, a.kv_heads, hd).transpose(1, 2)
            if a.family in ("qwen3", "qwen3_moe"):
                q, k = _rms(q, W[p + "self_attn.q_norm.weight"]), _rms(k, W[p + "self_attn.k_norm.weight"])
            q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
            rep = a.heads // a.kv_heads
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                               is_causal=True)
        x = x + o.transpose(1, 2).reshape(b, s, -1) @ W[p + "self_attn.o_proj.weight"].T
        h = _rms(x, W[p + "post_attention_layernorm.weight"])
        if a.is_moe_layer(i):
            assert a.family == "qwen3_moe"
            val, idx = (h @ W[p + "mlp.gate.weight"].T).topk(topk, dim=-1)
            prob = val.softmax(-1)
            x = x + sum((prob * (idx == e)).sum(-1, keepdim=True) * mlp(h, f"{p}mlp.experts.{e}.")
                        for e in range(a.experts))
        else:
            x = x + mlp(h, p + "mlp.")
    x = _rms(x, W["model.norm.weight"])
    return x @ W["lm_head.weight" if not a.tie_embeddings else "model.embed_tokens.weight"].T


# ----------------------------------------------------------------------------- megatron worker


class _SdpaCoreAttention(torch.nn.Module):
    """Causal SDPA with Megatron's core-attention interface ([s, b, n, d] in, [s, b, n*dv] out)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None, softmax_scale=None, **kw):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kw):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return o.permute(2, 0, 1, 3).reshape(o.shape[2], o.shape[0], -1)


def _patch_megatron_for_cpu():
    import contextlib
    import types

    import megatron.core.tensor_parallel as mtp
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla

    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    mtp.get_cuda_rng_tracker = lambda *a, **k: types.SimpleNamespace(fork=lambda *a, **k: contextlib.nullcontext())
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    mla.HAVE_TE = False


def _megatron_model(a: Arch, *, tp, pp, ep, etp, pp_layers):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kw = dict(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, num_query_groups=a.kv_heads,
              kv_channels=a.head_dim, ffn_hidden_size=a.intermediate or 8, normalization="RMSNorm",
              gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              qk_layernorm=a.family in ("qwen3", "qwen3_moe", "deepseek_v3"), use_cpu_initialization=True,
              params_dtype=torch.float32, pipeline_dtype=torch.float32, tensor_model_parallel_size=tp,
              pipeline_model_parallel_size=pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
              bias_activation_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
              persist_layer_norm=False, apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
              layernorm_epsilon=1e-5)
    if pp_layers is not None:
        kw.update(num_layers_in_first_pipeline_stage=pp_layers[0], num_layers_in_last_pipeline_stage=pp_layers[-1])
    if a.is_moe:
        kw.update(num_moe_experts=a.experts, moe_ffn_hidden_size=a.moe_intermediate, moe_router_topk=2,
                  moe_layer_freq=[0 if i < a.first_dense_layers else 1 for i in range(a.layers)],
                  moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0)
    if a.is_mla:
        kw.update(multi_latent_attention=True, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
                  qk_head_dim=a.qk_nope_head_dim, qk_pos_emb_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
                  rope_type="rope", rotary_scaling_factor=1.0, mtp_num_layers=a.mtp_layers or None)
        if a.is_moe:
            kw.update(moe_shared_expert_intermediate_size=a.shared_experts * a.moe_intermediate or None,
                      moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
        cfg = MLATransformerConfig(**kw)
    else:
        cfg = TransformerConfig(**kw)
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    if a.is_mla:
        for spec in block.layer_specs:
            spec.submodules.self_attention.submodules.core_attention = _SdpaCoreAttention
    mtp = get_gpt_mtp_block_spec(cfg, block.layer_specs[-1], use_transformer_engine=False) if a.mtp_layers else None
    return GPTModel(cfg, block, vocab_size=vocab_size_with_padding(a.vocab, tp), max_sequence_length=64,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=a.tie_embeddings, position_embedding_type="rope",
                    mtp_block_spec=mtp)


def _layer_and_expert(tensor: str):
    m = re.match(r"model\.layers\.(\d+)\.", tensor)
    e = re.search(r"\.experts\.(\d+)\.", tensor)
    return (int(m.group(1)) if m else None), (int(e.group(1)) if e else None)


def _check_names_and_shapes(m, lay, rank):
    params = {n: tuple(p.shape) for n, p in m.named_parameters()}
    params.update({n: tuple(b.shape) for n, b in m.named_buffers() if n.endswith("router.expert_bias")})
    bufs = {n: s for n, (s, _) in lay.buffers(rank).items()}
    aliases = {n for n in bufs if "#" in n}
    for n in aliases:  # Megatron's MTP stage holds the shared embedding (first-stage copy if pp > 1)
        base = n.split("#")[0]
        if base in params:
            assert params[base] == bufs[n], (rank, n)
    extra = set(params) - set(bufs)
    assert extra <= {"embedding.word_embeddings.weight"} and (not extra or aliases), (rank, sorted(extra))
    assert set(bufs) - aliases <= set(params), (rank, sorted(set(bufs) - aliases - set(params)))
    for n in set(bufs) - aliases:
        assert params[n] == bufs[n], (rank, n, params[n], bufs[n])


def _check_sharded_state_dict(m, lay, te_lay, rank, a):
    """Megatron's checkpoint metadata puts each local parameter where the layout says."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    sd = m.sharded_state_dict(metadata={"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)})
    by_buffer: dict[str, list] = {}
    for p in lay.pieces(rank):
        by_buffer.setdefault(p.buffer, []).append(p)
    te_buffer = {(p.tensor, p.offsets): p.buffer for p in te_lay.pieces(rank)}
    checked = 0
    for local, sh in sd.items():
        if "_extra_state" in local or not isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
            continue
        pieces = by_buffer.get(local) or by_buffer.get(local + "#mtp0", [])
        if isinstance(sh, ShardedTensorFactory):
            built = sh.build()
            shards = list(built.values()) if isinstance(built, dict) else list(built)
        else:
            shards = [sh]
        assert pieces or local.endswith("word_embeddings.weight") or local.endswith("output_layer.weight"), local
        for st in shards:
            n = st.prepend_axis_num
            key_layer = re.match(r"(decoder|mtp)\.layers\.(\d+)\.", st.key)
            if key_layer:
                layer = int(key_layer.group(2)) + (a.layers if key_layer.group(1) == "mtp" else 0)
            elif st.key.startswith("decoder.layers.") and n >= 1:
                layer = st.global_offset[0]
            else:
                layer = None
            expert = st.global_offset[n - 1] if ".experts.experts." in st.key else None
            for p in pieces:
                hl, he = _layer_and_expert(p.tensor)
                if layer is not None and "#" not in p.buffer:
                    assert hl == layer, (rank, local, st.key, p.tensor)
                assert he == expert, (rank, local, st.key, p.tensor, expert)
            checked += 1
        body = lambda st: tuple(st.global_offset[st.prepend_axis_num:])  # noqa: E731
        if len(shards) == 2 and len(pieces) == 2:  # SwiGLU fc1: [gate; up] globally, halves locally
            gate, up = sorted(pieces, key=lambda p: p.buffer_offsets)
            half = shards[0].global_shape[shards[0].prepend_axis_num] // 2
            assert body(shards[0]) == gate.offsets and gate.tensor.endswith("gate_proj.weight"), (rank, local)
            assert body(shards[1]) == (up.offsets[0] + half, up.offsets[1]), (rank, local)
        elif len(shards) == 1 and len(pieces) == 1:
            assert body(shards[0]) == pieces[0].offsets, (rank, local, body(shards[0]), pieces[0].offsets)
        # Transformer Engine names: the local model's checkpoint keys are TE's (dense GQA layers)
        lk = re.match(r"decoder\.layers\.(?:\d+\.)?(.*)$", sh.key)
        if (lk and not a.is_mla and ".experts." not in local and "router" not in local and pieces
                and not a.is_moe_layer(_layer_and_expert(pieces[0].tensor)[0])):
            te_name = te_buffer[(pieces[0].tensor, pieces[0].offsets)]
            assert te_name.split(".", 3)[3] == lk.group(1), (rank, local, sh.key, te_name)
    assert checked


def _refit_from_megatron(m, a, rank, full, common):
    """A refit session reads the live Megatron model (Side.from_megatron) and refits every logical
    tensor into full replicas on rank 0, which is a source rank too (colocated): bit-exact."""
    from reshard.refit import RefitSession, Side

    source = Side.from_megatron(m, a, rank, pp_layers=common["pp_layers"], transformer_impl="local",
                                moe_grouped_gemm=False)
    specs = model_specs(a)
    dst = rs.Layout.merge(rs.Layout.from_placements(s, [0], (1,), [rs.Replicate()], dtype=torch.float32)
                          for s in specs)
    destination = Side.from_layout(dst, rank, dst.empty_buffers(rank)) if rank == 0 else None
    session = RefitSession.connect(source=source, destination=destination)
    session.refit(version=1)
    if destination is not None:
        bad = [n for n, t in destination.tensors.items() if not torch.equal(t, full[n])]
        assert not bad, (a.family, bad[:5])
    with pytest.raises(rs.LayoutError, match=r"rank \d: Megatron parameter '.+' is \(.*\), the layout says"):
        Side.from_megatron(m, a.with_overrides(hidden=a.hidden * 2), rank, pp_layers=common["pp_layers"],
                           transformer_impl="local", moe_grouped_gemm=False)


def _forward_check(m, lay, a, rank, tp, pp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    g = torch.Generator().manual_seed(1)
    full = {s.name: torch.randn(s.shape, generator=g) * 0.3 for s in model_specs(a)}
    bufs = lay.materialize(rank, full)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(bufs[n] if n in bufs else bufs[n + "#mtp0"])
    b, s = 2, 6
    ids = torch.randint(0, a.vocab, (b, s), generator=g)
    pos = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(s, s), diagonal=1).bool()[None, None]
    m.eval()
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            h = torch.empty(s, b, a.hidden)
            dist.recv(h, src=ps.get_pipeline_model_parallel_prev_rank())
            m.set_input_tensor(h)
        out = m(ids, pos, mask)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return full
    ref = hf_reference(a, full, ids)
    per = vocab_size_with_padding(a.vocab, tp) // tp
    t = ps.get_tensor_model_parallel_rank()
    lo, hi = t * per, min((t + 1) * per, a.vocab)
    err = (out[..., : max(0, hi - lo)] - ref[..., lo:hi]).abs().max().item() if hi > lo else 0.0
    assert err < 1e-4, (a.family, rank, err)
    return full


MEGATRON_SCENARIOS = [
    # arch, tp, pp, ep, etp, pp_layers, forward
    (QWEN3_TIED.with_overrides(tie_embeddings=False), 2, 1, 1, None, None, True),
    (LLAMA, 2, 2, 1, None, [1, 3], True),
    (QWEN3_TIED, 1, 2, 1, None, None, True),  # tied embeddings: last stage's output_layer copy
    (QWEN3_MOE, 2, 1, 2, 1, None, True),
    (QWEN3_MOE, 2, 1, 2, 2, None, True),
    (DEEPSEEK.with_overrides(layers=4, qk_rope_head_dim=4), 2, 2, 2, 1, [1, 3], False),
    (DEEPSEEK.with_overrides(layers=2, first_dense_layers=2, mtp_layers=0, qk_rope_head_dim=4), 2, 1, 1, None,
     None, True),
]


def _megatron_worker(rank, world):
    torch.manual_seed(0)
    _patch_megatron_for_cpu()
    from megatron.core import parallel_state as ps

    for a, tp, pp, ep, etp, pp_layers, forward in MEGATRON_SCENARIOS:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                     create_gloo_process_groups=False)
        try:
            m = _megatron_model(a, tp=tp, pp=pp, ep=ep, etp=etp or tp, pp_layers=pp_layers)
            common = dict(tp=tp, pp=pp, ep=ep, etp=etp, dp=world // (tp * pp), pp_layers=pp_layers,
                          moe_grouped_gemm=False)
            lay = megatron_layout(a, range(world), transformer_impl="local", **common)
            te_lay = megatron_layout(a, range(world), transformer_impl="transformer_engine", **common)
            _check_names_and_shapes(m, lay, rank)
            _check_sharded_state_dict(m, lay, te_lay, rank, a)
            if forward:
                full = _forward_check(m, lay, a, rank, tp, pp)
                _refit_from_megatron(m, a, rank, full, common)
        finally:
            ps.destroy_model_parallel()


@pytest.mark.slow
def test_against_megatron_core_models():
    """Real megatron-core GPTModels over 4 gloo ranks: names, shapes, checkpoint metadata, forward."""
    pytest.importorskip("megatron.core")
    rs.spawn(_megatron_worker, 4, backend="gloo")
