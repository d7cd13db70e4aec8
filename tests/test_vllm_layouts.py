"""vLLM inference layouts (``reshard.frameworks.vllm``), without vLLM.

Each case refits full tensors (one source rank) into ``vllm_layout`` with the
planner and the in-process executor, then compares every destination buffer with
what this file builds by hand from the full tensors, in vLLM's order, with torch
slicing (``chunk`` / ``cat`` / ``stack``): an oracle independent of the layout's
numpy arithmetic. Destination buffers start as NaN: padding rows must stay
untouched (they belong to no logical tensor) and every other element must be
written. ``tests/test_vllm_loaders.py`` checks the same layouts against vLLM's
own weight loaders.
"""

from __future__ import annotations

import dataclasses
import re
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_archs import tiny

import reshard as rs
from reshard.frameworks.vllm import EXPERTS_W2, EXPERTS_W13, expert_owners, pad_vocab, vllm_layout
from reshard.models import Arch, get_arch, model_specs

SRC = 1000  # the source rank (holds every full tensor)
F32 = torch.float32


# ---------------------------------------------------------------------------- the oracle
def expected_buffers(a: Arch, full: dict[str, torch.Tensor], tp: int, dp: int, j: int, *, ep: bool = False,
                     independent: bool = False, placement: str = "linear", sp: bool | None = None,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """What vLLM holds on position ``j`` of ``ranks`` (engine j // tp, TP rank j % tp), by hand."""
    dt = dtype or a.dtype
    t = j % tp
    group = tp if independent else tp * dp  # the FusedMoE group
    m = j % tp if independent else j
    if sp is None:
        sp = ep and tp > 1 and not independent and dp > 1
    out: dict[str, torch.Tensor] = {}

    def rows(x, parts=tp, k=t):
        return x.chunk(parts, 0)[k]

    def cols(x, parts=tp, k=t):
        return x.chunk(parts, 1)[k]

    def vocab(x):
        per = pad_vocab(x.shape[0]) // tp
        buf = torch.full((per, x.shape[1]), float("nan"))
        real = x[t * per: (t + 1) * per]
        buf[: len(real)] = real
        return buf

    out["model.embed_tokens.weight"] = vocab(full["model.embed_tokens.weight"])
    if not a.tie_embeddings:
        out["lm_head.weight"] = vocab(full["lm_head.weight"])
    out["model.norm.weight"] = full["model.norm.weight"]
    for i in range(a.layers):
        p = f"model.layers.{i}."

        def f(name):
            return full[p + name]

        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = f(n)
        if a.is_mla:
            if a.q_lora_rank:
                out[p + "self_attn.fused_qkv_a_proj.weight"] = torch.cat(
                    [f("self_attn.q_a_proj.weight"), f("self_attn.kv_a_proj_with_mqa.weight")])
                out[p + "self_attn.q_a_layernorm.weight"] = f("self_attn.q_a_layernorm.weight")
                out[p + "self_attn.q_b_proj.weight"] = rows(f("self_attn.q_b_proj.weight"))
            else:
                out[p + "self_attn.q_proj.weight"] = rows(f("self_attn.q_proj.weight"))
                out[p + "self_attn.kv_a_proj_with_mqa.weight"] = f("self_attn.kv_a_proj_with_mqa.weight")
            out[p + "self_attn.kv_a_layernorm.weight"] = f("self_attn.kv_a_layernorm.weight")
            out[p + "self_attn.kv_b_proj.weight"] = rows(f("self_attn.kv_b_proj.weight"))
        else:
            q = rows(f("self_attn.q_proj.weight"))
            if tp >= a.kv_heads:  # one whole KV head per rank, tp / kv_heads ranks share it
                head = t // (tp // a.kv_heads)
                k, v = (f(n)[head * a.head_dim: (head + 1) * a.head_dim]
                        for n in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"))
            else:
                k, v = rows(f("self_attn.k_proj.weight")), rows(f("self_attn.v_proj.weight"))
            out[p + "self_attn.qkv_proj.weight"] = torch.cat([q, k, v])
            if a.family != "llama":
                out[p + "self_attn.q_norm.weight"] = f("self_attn.q_norm.weight")
                out[p + "self_attn.k_norm.weight"] = f("self_attn.k_norm.weight")
        out[p + "self_attn.o_proj.weight"] = cols(f("self_attn.o_proj.weight"))
        if not a.is_moe_layer(i):
            out[p + "mlp.gate_up_proj.weight"] = torch.cat([rows(f("mlp.gate_proj.weight")),
                                                            rows(f("mlp.up_proj.weight"))])
            out[p + "mlp.down_proj.weight"] = cols(f("mlp.down_proj.weight"))
            continue
        out[p + "mlp.gate.weight"] = f("mlp.gate.weight")
        if a.is_mla:
            out[p + "mlp.gate.e_score_correction_bias"] = f("mlp.gate.e_score_correction_bias")
        if a.is_mla and a.shared_experts:
            sh = "mlp.shared_experts."
            parts, k = (1, 0) if sp else (tp, t)
            out[p + sh + "gate_up_proj.weight"] = torch.cat([rows(f(sh + "gate_proj.weight"), parts, k),
                                                             rows(f(sh + "up_proj.weight"), parts, k)])
            out[p + sh + "down_proj.weight"] = cols(f(sh + "down_proj.weight"), parts, k)

        def ex(e, n):
            return f(f"mlp.experts.{e}.{n}_proj.weight")

        if ep:  # whole experts: vLLM's determine_expert_map, spelled out
            if placement == "linear":
                base, rem = divmod(a.experts, group)
                start = m * base + min(m, rem)
                mine = list(range(start, start + base + (1 if m < rem else 0)))
            else:
                mine = list(range(m, a.experts, group))
            w13 = [torch.cat([ex(e, "gate"), ex(e, "up")]) for e in mine]
            w2 = [ex(e, "down") for e in mine]
        else:  # every expert, intermediate split over the MoE group
            w13 = [torch.cat([rows(ex(e, "gate"), group, m), rows(ex(e, "up"), group, m)]) for e in range(a.experts)]
            w2 = [cols(ex(e, "down"), group, m) for e in range(a.experts)]
        i_m = a.moe_intermediate if ep else a.moe_intermediate // group
        out[p + EXPERTS_W13] = torch.stack(w13) if w13 else torch.zeros(0, 2 * i_m, a.hidden)
        out[p + EXPERTS_W2] = torch.stack(w2) if w2 else torch.zeros(0, a.hidden, i_m)
    return {k: v.to(torch.float32 if k.endswith("e_score_correction_bias") else dt) for k, v in out.items()}


# ---------------------------------------------------------------------------- the check
def full_tensors(specs, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # integers up to 256 are exact in bf16 and fp16: any cast chain preserves them
    return {s.name: torch.randint(-256, 257, s.shape, generator=g).to(s.dtype) for s in specs}


def refit_and_check(a: Arch, tp: int, dp: int = 1, *, ranks=None, ep=False, independent=False, placement="linear",
                    sp=None, dtype=None) -> rs.Layout:
    ranks = list(ranks if ranks is not None else range(tp * dp))
    dst = vllm_layout(a, ranks, tp, dp, expert_parallel=ep, independent_engines=independent,
                      expert_placement=placement, sequence_parallel_moe=sp, dtype=dtype, validate=True)
    specs = dst.tensors
    full = full_tensors(specs)
    src = rs.Layout.merge(rs.Layout.from_placements(s, [SRC], (1,), [rs.Replicate()]) for s in specs)
    plan = rs.plan(src, dst)
    src_bufs = {SRC: src.materialize(SRC, full)}
    dst_bufs = {r: {k: torch.full(shape, float("nan"), dtype=dtype_) for k, (shape, dtype_) in dst.buffers(r).items()}
                for r in dst.ranks}
    rs.run_local(plan, src_bufs, dst_bufs)
    assert dst.ranks == sorted(ranks)
    for j, r in enumerate(ranks):
        want = expected_buffers(a, full, tp, dp, j, ep=ep, independent=independent, placement=placement, sp=sp,
                                dtype=dtype)
        got = dst_bufs[r]
        assert sorted(got) == sorted(want), f"rank {r}: buffer names differ"
        for k, w in want.items():
            assert got[k].shape == w.shape and got[k].dtype == w.dtype, (r, k, got[k].shape, w.shape)
            torch.testing.assert_close(got[k], w, rtol=0, atol=0, equal_nan=True, msg=f"rank {r} buffer {k}")
    return dst


# ---------------------------------------------------------------------------- families
@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (2, 2), (1, 3)])
def test_llama(tp, dp):
    refit_and_check(tiny("llama"), tp, dp, ranks=[10 + 3 * j for j in range(tp * dp)])


def test_qwen3_tied_embeddings_and_bf16():
    a = tiny("qwen3", tie_embeddings=True)
    lay = refit_and_check(a, 2, 2, dtype=torch.bfloat16)
    assert "lm_head.weight" not in lay.specs and "lm_head.weight" not in lay.buffers(0)


def test_kv_heads_replicated_when_tp_exceeds_them():
    a = tiny("qwen3", heads=8, kv_heads=2)
    lay = refit_and_check(a, 8, 1)
    k = lay.tables["model.layers.0.self_attn.k_proj.weight"]
    # 8 ranks, 2 KV heads: ranks 0-3 hold head 0, ranks 4-7 head 1, each right after its q rows
    assert k.offsets[:, 0].tolist() == [0] * 4 + [8] * 4
    assert k.buffer_offsets[:, 0].tolist() == [8] * 8  # q rows per rank: 8 heads * 8 / 8
    assert lay.buffers(3)["model.layers.0.self_attn.qkv_proj.weight"][0] == (8 + 8 + 8, 32)


def test_vocab_padding_leaves_a_rank_with_padding_only():
    # vocab 130 -> padded 192, tp 4 -> 48 rows per rank: ranks hold 48, 48, 34 and 0 real rows
    lay = refit_and_check(tiny("llama"), 4, 1)
    emb = lay.tables["model.embed_tokens.weight"]
    assert emb.ranks.tolist() == [0, 1, 2] and emb.sizes[:, 0].tolist() == [48, 48, 34]
    assert all(lay.buffers(r)["model.embed_tokens.weight"][0] == (48, 32) for r in range(4))


def test_qwen3_moe_tp_flattened_over_dp():
    # vLLM's data parallelism: MoE layers split the intermediate size over all tp * dp ranks
    lay = refit_and_check(tiny("qwen3_moe"), 2, 2)
    assert lay.buffers(3)["model.layers.0." + EXPERTS_W13][0] == (5, 2 * 24 // 4, 32)


def test_qwen3_moe_independent_engines():
    lay = refit_and_check(tiny("qwen3_moe"), 2, 2, independent=True)
    assert lay.buffers(3)["model.layers.0." + EXPERTS_W2][0] == (5, 32, 24 // 2)


@pytest.mark.parametrize("independent", [False, True])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_qwen3_moe_expert_parallel_with_remainder(independent, placement):
    lay = refit_and_check(tiny("qwen3_moe", experts=7), 2, 2, ep=True, independent=independent, placement=placement)
    counts = [lay.buffers(r)["model.layers.1." + EXPERTS_W13][0][0] for r in range(4)]
    assert counts == ([2, 2, 2, 1] if not independent else [4, 3, 4, 3])


def test_expert_owners_match_vllm_rule():
    owner, local = expert_owners(10, 4)  # 3, 3, 2, 2: the remainder goes to the first ranks
    assert owner.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3] and local.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 0, 1]
    owner, local = expert_owners(10, 4, "round_robin")
    assert owner.tolist() == [0, 1, 2, 3] * 2 + [0, 1] and local.tolist() == [0] * 4 + [1] * 4 + [2] * 2


@pytest.mark.parametrize("tp,dp,ep", [(1, 1, False), (2, 1, False), (2, 2, False), (2, 2, True), (4, 1, True)])
def test_deepseek_v3_mla(tp, dp, ep):
    refit_and_check(tiny("deepseek_v3"), tp, dp, ep=ep)


def test_deepseek_shared_experts_replicated_under_sequence_parallel_moe():
    a = tiny("deepseek_v3")
    lay = refit_and_check(a, 2, 2, ep=True)  # vLLM's rule: EP, tp > 1, dp > 1
    assert lay.buffers(1)["model.layers.1.mlp.shared_experts.gate_up_proj.weight"][0] == (32, 32)
    lay = refit_and_check(a, 2, 2, ep=True, sp=False)  # e.g. a non-sequence-parallel all2all backend
    assert lay.buffers(1)["model.layers.1.mlp.shared_experts.gate_up_proj.weight"][0] == (16, 32)


def test_deepseek_without_q_lora_drops_mtp_and_keeps_fp32_bias():
    a = tiny("deepseek_v3", q_lora_rank=None, mtp_layers=1, dtype=torch.bfloat16)
    lay = refit_and_check(a, 2, 1, dtype=torch.bfloat16)
    assert not any(n.startswith(f"model.layers.{a.layers}.") for n in lay.specs)  # MTP layer not kept
    assert set(lay.specs) == {s.name for s in model_specs(a) if not s.name.startswith(f"model.layers.{a.layers}.")}
    assert lay.buffers(0)["model.layers.1.mlp.gate.e_score_correction_bias"] == ((5,), torch.float32)


def test_presets_shrunk_with_replace():
    for name in ("qwen3-8b", "qwen3-30b-a3b", "llama-3-8b", "kimi-k2"):
        p = get_arch(name)
        small = dataclasses.replace(p, hidden=32, layers=min(p.layers, 2), vocab=200, intermediate=32,
                                    experts=min(p.experts, 6), moe_intermediate=16 if p.is_moe else 0,
                                    heads=8, kv_heads=p.kv_heads if not p.is_mla else 8, head_dim=8,
                                    q_lora_rank=16 if p.is_mla else None, kv_lora_rank=8, qk_nope_head_dim=8,
                                    qk_rope_head_dim=4, v_head_dim=8, dtype=F32)
        refit_and_check(small, 2, 2, ep=small.is_moe)


# ---------------------------------------------------------------------------- random configs
@st.composite
def configs(draw):
    family = draw(st.sampled_from(["llama", "qwen3", "qwen3_moe", "deepseek_v3"]))
    tp = draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.integers(1, 3))
    kw = dict(vocab=draw(st.integers(1, 300)), layers=draw(st.integers(1, 3)), heads=4 * draw(st.integers(1, 2)),
              hidden=draw(st.sampled_from([8, 16])), intermediate=4 * draw(st.integers(1, 4)),
              tie_embeddings=family != "deepseek_v3" and draw(st.booleans()))
    if family == "deepseek_v3":
        kw.update(kv_heads=kw["heads"], q_lora_rank=draw(st.sampled_from([None, 8])),
                  first_dense_layers=draw(st.integers(0, 2)), shared_experts=draw(st.integers(0, 2)),
                  mtp_layers=draw(st.integers(0, 1)))
    else:
        kv = draw(st.sampled_from([1, 2, 4]))
        kw.update(kv_heads=kv)
    ep = False
    if family in ("qwen3_moe", "deepseek_v3"):
        ep = draw(st.booleans())
        kw.update(experts=draw(st.integers(tp, 9)), moe_intermediate=4 * tp * dp * draw(st.integers(1, 2)))
    independent = draw(st.booleans())
    placement = draw(st.sampled_from(["linear", "round_robin"]))
    dtype = draw(st.sampled_from([None, torch.bfloat16]))
    return tiny(family, **kw), tp, dp, ep, independent, placement, dtype


@settings(max_examples=60, deadline=None)
@given(configs())
def test_random_configs(cfg):
    a, tp, dp, ep, independent, placement, dtype = cfg
    refit_and_check(a, tp, dp, ep=ep, independent=independent, placement=placement, dtype=dtype,
                    ranks=list(range(tp * dp))[::-1])


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("arch,ranks,tp,dp,kw,match", [
    (tiny("llama"), range(3), 2, 2, {}, re.escape("3 ranks given, but tp*dp = 2*2 = 4")),
    (tiny("llama"), [0, 0], 2, 1, {}, "repeat a rank"),
    (tiny("llama", heads=6, kv_heads=2), range(4), 4, 1, {}, r"attention heads \(6\) is not divisible by 4"),
    (tiny("llama", heads=8, kv_heads=8), range(3), 3, 1, {}, "attention heads"),
    (tiny("llama", heads=12, kv_heads=4), range(6), 6, 1, {}, "tp is not a multiple of the KV heads"),
    (tiny("llama", heads=8, kv_heads=6), range(4), 4, 1, {}, r"KV heads \(6\) is not divisible by 4"),
    (tiny("llama", intermediate=30), range(4), 4, 1, {}, r"intermediate size \(30\)"),
    (tiny("llama", heads=6, kv_heads=3, vocab=100), range(3), 3, 1, {}, r"vocab padded to a multiple of 64 \(128\)"),
    (tiny("qwen3_moe", moe_intermediate=12), range(8), 2, 4, {}, r"MoE intermediate size \(12\) is not divisible by 8"),
    (tiny("qwen3_moe", experts=3), range(4), 4, 1, {}, "greater than the number of experts"),
    (tiny("deepseek_v3", tie_embeddings=True), range(2), 2, 1, {}, "does not tie word embeddings"),
    (tiny("deepseek_v3", moe_intermediate=6), range(4), 4, 1, {"expert_parallel": True},
     r"shared-expert intermediate size \(6\)"),
    (tiny("qwen3_moe"), range(2), 2, 1, {"expert_placement": "random"}, "unknown expert placement"),
    (tiny("llama"), [], 0, 1, {}, "tp must be a positive integer"),
])
def test_impossible_configurations(arch, ranks, tp, dp, kw, match):
    with pytest.raises(rs.LayoutError, match=match) as info:
        vllm_layout(arch, list(ranks), tp, dp, **kw)
    assert "\n" not in str(info.value)


def test_moe_intermediate_needs_only_engine_tp_when_independent_or_ep():
    a = tiny("qwen3_moe", moe_intermediate=12)
    vllm_layout(a, range(8), 2, 4, independent_engines=True)
    vllm_layout(a, range(8), 2, 4, expert_parallel=True)


# ---------------------------------------------------------------------------- scale
def test_deepseek_v3_on_128_ranks_builds_fast():
    t0 = time.perf_counter()
    lay = vllm_layout(get_arch("deepseek-v3"), range(128), 8, 16)
    took = time.perf_counter() - t0
    assert took < 20  # about 1 s on a 2-core VM; generous for shared CI machines
    assert len(lay.specs) == len(model_specs(get_arch("deepseek-v3")))
    bufs = lay.buffers(127)
    assert bufs["model.layers.3." + EXPERTS_W13][0] == (256, 2 * 2048 // 128, 7168)
    assert bufs["model.layers.3.self_attn.q_b_proj.weight"][0] == (128 * 192 // 8, 1536)
    assert bufs["model.embed_tokens.weight"][0] == (129280 // 8, 7168)
    up = lay.tables["model.layers.60.mlp.experts.255.up_proj.weight"]
    assert len(up) == 128 and up.buffer_offsets[127].tolist() == [255, 16, 0] and up.offsets[127].tolist() == [127 * 16, 0]


def test_kimi_k2_expert_parallel_on_128_ranks():
    lay = vllm_layout(get_arch("kimi-k2"), range(128), 8, 16, expert_parallel=True)
    down = lay.tables["model.layers.1.mlp.experts.383.down_proj.weight"]
    assert down.ranks.tolist() == [127] and down.buffer_offsets.tolist() == [[2, 0, 0]]  # 384 / 128 = 3 each
    assert lay.buffers(0)["model.layers.1." + EXPERTS_W2][0] == (3, 7168, 2048)
    # sequence-parallel MoE (EP, tp 8, dp 16): shared experts whole on every rank
    assert lay.buffers(0)["model.layers.1.mlp.shared_experts.down_proj.weight"][0] == (7168, 2048)


def test_docstring_examples():
    import doctest

    import reshard.frameworks.vllm as mod

    assert doctest.testmod(mod).failed == 0
