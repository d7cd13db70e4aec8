"""FP8 block-quantized refit: the quantizer, dtype policies, FP8 destination layouts, the plan's block
paths and the executors, bit for bit against a reference quantizer applied to the full tensor.

* the quantizer against a plain per-block loop (fp32 scales and UE8M0, zero blocks, saturation);
* property tests (hypothesis, in one process): random 2-D shapes and block shapes, random uneven
  source boxes (replicas, colocated ranks, both dims) and block-aligned destination boxes placed at
  block boundaries of bigger buffers, with a kept and a cast tensor beside; every FP8 byte and scale
  equals ``quantize_blocks`` of the full tensor whichever path its block took;
* bad input: a split through a block names the tensor, fused buffers of two precisions, ...;
* one multi-process gloo run (FSDP-like uneven split -> TP 2, both paths);
* vLLM's block-FP8 Qwen3 / Qwen3-MoE models (see :func:`check_vllm`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as rs
from reshard.execution.precision import PrecisionExecutor
from reshard.execution.process_group import free_port
from reshard.planning.precision import (DESTINATION, SOURCE, Cast, DtypePolicy, FP8Block, Keep, PrecisionPlan,
                                        layout_precisions, precision_layout)
from reshard.quant import FP8_DTYPE, FP8_MAX, quantize_blocks, scale_name

from strategies import run_precision_or_refused
from vllm_helpers import run_in_worker, vllm_worker  # noqa: F401  (vllm_worker: a fixture)

BF16, F32 = torch.bfloat16, torch.float32
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# ---------------------------------------------------------------------------- the quantizer
def loop_quantize(x: torch.Tensor, block, ue8m0=False):
    """The rule of reshard.quant, block by block, written out plainly."""
    bn, bk = block
    rows, cols = x.shape
    gr, gc = -(-rows // bn), -(-cols // bk)
    q = torch.empty(rows, cols, dtype=FP8_DTYPE)
    s = torch.empty(gr, gc, dtype=F32)
    for i in range(gr):
        for j in range(gc):
            blk = x[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            scale = blk.abs().max() / torch.tensor(448.0)
            if ue8m0 and scale > 0:
                e = 0
                while torch.tensor(2.0 ** e, dtype=F32) < scale:
                    e += 1
                while torch.tensor(2.0 ** (e - 1), dtype=F32) >= scale:
                    e -= 1
                scale = torch.tensor(2.0 ** e, dtype=F32)
            if scale == 0:
                scale = torch.tensor(1.0)
            s[i, j] = scale
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / scale).clamp(-448, 448).to(FP8_DTYPE)
    return q, s


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape,block,dtype", [((300, 200), (128, 128), BF16), ((7, 5), (2, 3), F32),
                                               ((32, 16), (16, 16), torch.float16), ((5, 9), (1, 4), F32)])
def test_quantizer_matches_a_loop_over_blocks(shape, block, dtype, ue8m0):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[1])).to(dtype)
    x[: block[0], : block[1]] = 0  # an all-zero block: scale 1
    x[-1, -1] = 3e4  # one large value: its block saturates nowhere, others keep their own scales
    q, s = quantize_blocks(x, block, ue8m0)
    want_q, want_s = loop_quantize(x, block, ue8m0)
    assert same_bits(q, want_q) and same_bits(s, want_s)
    assert s[0, 0] == 1 and (q[: block[0], : block[1]].float() == 0).all()
    assert q.float().abs().max() <= FP8_MAX and not torch.isnan(q.float()).any()
    if ue8m0:
        m, _ = torch.frexp(s)
        assert (m == 0.5).all()  # powers of two
    # dequantized within half a step of e4m3 (3 mantissa bits; subnormal steps of 2**-9 near zero)
    full_s = s.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]
    err = (q.float() * full_s - x.float()).abs()
    assert (err <= x.float().abs() / 16 + full_s * 2.0 ** -10).all()


def test_quantizer_is_local_to_blocks():
    """A box of whole blocks quantizes to the full tensor's bits (what lets each path quantize apart)."""
    x = torch.randn(50, 70).to(BF16)
    q, s = quantize_blocks(x, (8, 16))
    q2, s2 = quantize_blocks(x[16:50, 32:70], (8, 16))
    assert same_bits(q2, q[16:50, 32:70]) and same_bits(s2, s[2:, 2:])


def test_saturation_is_explicit():
    """x / s may land a rounding step above 448 (s = amax / 448 rounds down): it saturates to 448."""
    hits = 0
    for amax in torch.linspace(1, 2, 4001):
        scale = amax / 448.0
        if amax / scale > 448:
            hits += 1
            q, _ = quantize_blocks(amax.view(1, 1), (1, 1))
            assert q.float().item() == 448.0
    assert hits  # the case exists for some values


# ---------------------------------------------------------------------------- policies
def test_default_policy_keeps_what_fp8_checkpoints_keep():
    pol = DtypePolicy.fp8()
    spec = lambda n: rs.TensorSpec(n, (256, 256), BF16)  # noqa: E731
    fp8 = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
           "model.layers.0.self_attn.kv_b_proj.weight", "model.layers.3.mlp.experts.7.down_proj.weight",
           "model.layers.3.mlp.shared_experts.gate_proj.weight", "decoder.layers.0.mlp.linear_fc1.weight",
           "decoder.layers.0.self_attn.linear_qkv.weight"]
    keep = ["model.layers.3.mlp.gate.weight", "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight",
            "lm_head.weight", "model.layers.0.self_attn.q_proj.bias", "model.layers.3.mlp.gate.e_score_correction_bias",
            "model.norm.weight", "model.layers.0.self_attn.q_a_layernorm.weight"]
    assert all(isinstance(pol(spec(n)), FP8Block) for n in fp8), [n for n in fp8 if not isinstance(pol(spec(n)), FP8Block)]
    assert all(pol(spec(n)) == Keep() for n in keep)
    assert DtypePolicy.fp8(block=(64, 32), ue8m0=True)(spec(fp8[0])) == FP8Block((64, 32), True)
    custom = DtypePolicy(predicate=lambda s: Cast(BF16) if s.name.startswith("lm_head") else None,
                         rules=(("proj", FP8Block()),))
    assert custom(spec("lm_head.weight")) == Cast(BF16) and custom(spec("o_proj.weight")) == FP8Block()
    assert DtypePolicy.fp8().key != DtypePolicy.fp8(ue8m0=True).key


@pytest.mark.parametrize("bad,match", [
    (lambda: DtypePolicy.named("int4"), "unknown precision 'int4'"),
    (lambda: FP8Block((128,)), "FP8Block block must be two positive integers"),
    (lambda: FP8Block((0, 128)), "FP8Block block must be two positive integers"),
    (lambda: DtypePolicy(rules=(("x", "fp8"),)), r"rule \('x', 'fp8'\)"),
    (lambda: DtypePolicy(rules=(("(", Keep()),)), "not a regular expression"),
    (lambda: Cast("bf16"), "Cast takes a torch.dtype"),
])
def test_bad_policies_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


# ---------------------------------------------------------------------------- bad layouts
def _spec(name="model.layers.0.mlp.down_proj.weight", shape=(256, 256), dtype=BF16):
    return rs.TensorSpec(name, shape, dtype)


def test_split_through_a_block_names_the_tensor():
    w = _spec(shape=(256, 384))
    src = rs.Layout.from_placements(w, [0], (1,), [rs.Replicate()])
    for dst, where in [(rs.Layout.from_placements(w, [1, 2, 3], (3,), [rs.Shard(0)]), "split at row 86"),
                       (rs.Layout.from_placements(w, [1, 2, 3, 4], (4,), [rs.Shard(1)]), "split at column 96")]:
        with pytest.raises(rs.LayoutError, match=rf"tensor '{w.name}': destination rank 1 holds box .* {where} cuts "
                                                 r"through 128x128 blocks"):
            PrecisionPlan(src, dst)
    # a 64 x 64 block fits the 3-way column split of 384: the option changes the verdict
    PrecisionPlan(src, rs.Layout.from_placements(w, [1, 2, 3], (3,), [rs.Shard(1)]), DtypePolicy.fp8(block=(64, 64)))
    # a fused partner starting inside a block: k at buffer row 128 + 64
    q, k = _spec("q_proj.weight", (128, 128)), _spec("k_proj.weight", (64, 128))
    v = _spec("v_proj.weight", (64, 128))
    pieces = [rs.Piece("q_proj.weight", (0, 0), (128, 128), "qkv", (0, 0), 1),
              rs.Piece("k_proj.weight", (0, 0), (64, 128), "qkv", (128, 0), 1),
              rs.Piece("v_proj.weight", (0, 0), (64, 128), "qkv", (192, 0), 1)]
    fused = rs.Layout.from_pieces([q, k, v], pieces)
    src = rs.Layout.merge(rs.Layout.from_placements(s, [0], (1,), [rs.Replicate()]) for s in (q, k, v))
    with pytest.raises(rs.LayoutError, match=r"tensor 'v_proj.weight': .* its place at row 192 of buffer 'qkv'"):
        PrecisionPlan(src, fused)


def test_other_bad_layouts_name_the_tensor():
    w, n = _spec(), _spec("model.norm.weight", (256,))
    src = rs.Layout.merge([rs.Layout.from_placements(w, [0], (1,), [rs.Replicate()]),
                           rs.Layout.from_placements(n, [0], (1,), [rs.Replicate()])])
    dst = rs.Layout.merge([rs.Layout.from_placements(w, [1], (1,), [rs.Replicate()]),
                           rs.Layout.from_placements(n, [1], (1,), [rs.Replicate()])])
    with pytest.raises(rs.LayoutError, match="tensor 'model.norm.weight': block FP8 takes 2-D floating tensors"):
        PrecisionPlan(src, dst, DtypePolicy(default=FP8Block()))
    q, k = _spec("q_proj.weight", (128, 128)), _spec("k_proj.weight", (128, 128))
    fused = rs.Layout.from_pieces([q, k], [rs.Piece("q_proj.weight", (0, 0), (128, 128), "qkv", (0, 0), 1),
                                           rs.Piece("k_proj.weight", (0, 0), (128, 128), "qkv", (128, 0), 1)])
    src = rs.Layout.merge(rs.Layout.from_placements(s, [0], (1,), [rs.Replicate()]) for s in (q, k))
    with pytest.raises(rs.LayoutError, match=r"rank 1 buffer 'qkv': holds tensor 'q_proj.weight' \(fp8:128x128\) "
                                             r"and tensor 'k_proj.weight' \(keep\)"):
        PrecisionPlan(src, fused, DtypePolicy(rules=(("q_proj", FP8Block()),)))
    with pytest.raises(rs.LayoutError, match="source shape"):  # the planner's own checks come first
        PrecisionPlan(rs.Layout.from_placements(_spec(shape=(128, 128)), [0], (1,), [rs.Replicate()]),
                      rs.Layout.from_placements(w, [1], (1,), [rs.Replicate()]))


# ---------------------------------------------------------------------------- layouts and paths
def test_fsdp_to_tp_paths_and_figures():
    """FSDP over 2 ranks, 150 + 106 rows, into TP 2 by columns: block row 0 is whole on rank 0."""
    w = _spec(shape=(256, 256))
    src = rs.Layout.from_pieces([w], [rs.Piece(w.name, (0, 0), (150, 256), "w", (0, 0), 0),
                                      rs.Piece(w.name, (150, 0), (106, 256), "w", (0, 0), 1)])
    dst = rs.Layout.from_placements(w, [2, 3], (2,), [rs.Shard(1)])
    p = PrecisionPlan(src, dst)
    assert p.block_paths(w.name).tolist() == [[SOURCE, SOURCE], [DESTINATION, DESTINATION]]
    assert p.tensor_paths()[w.name] == {"blocks": 4, "source": 2, "assembled": 0, "destination": 2,
                                        "raw_bytes": 128 * 256 * 2}
    assert p.wire_bytes_by_path() == {"fp8": 128 * 256, "scales": 2 * 4, "raw": 128 * 256 * 2, "other": 0}
    assert p.wire_bytes_by_dtype() == {"bfloat16": 128 * 256 * 2, "float32": 8, "float8_e4m3fn": 128 * 256}
    assert p.wire_bytes == sum(p.wire_bytes_by_dtype().values())
    assert p.staging_bytes() == {"source": {0: 128 * 256 + 8}, "destination": {2: 128 * 128 * 2, 3: 128 * 128 * 2}}
    tasks = p.quantization(0).source
    assert [(t.src_buffer, t.src_offsets, t.sizes) for t in tasks] == [("w", (0, 0), (128, 256))]
    assert [(t.q_buffer, t.q_offsets, t.s_buffer, t.s_offsets) for t in p.quantization(3).destination] == [
        (w.name, (128, 0), scale_name(w.name), (1, 0))]
    eng = p.destination
    assert eng.buffers(3) == {w.name: ((256, 128), FP8_DTYPE), scale_name(w.name): ((2, 1), F32)}
    assert p.fingerprint() == PrecisionPlan(src, dst).fingerprint() != PrecisionPlan(
        src, dst, DtypePolicy.fp8(ue8m0=True)).fingerprint()


def test_vllm_layouts_in_fp8_have_vllms_shapes():
    """precision_layout of vllm_layout against the shapes vLLM's Fp8LinearMethod / Fp8MoEMethod
    create_weights allocate (vllm/model_executor/layers/quantization/fp8.py): weight
    [out_per_rank, in_per_rank] float8_e4m3fn, weight_scale_inv [ceil(out / 128), ceil(in / 128)];
    w13 scale [E, 2 * ceil(I / 128), ceil(H / 128)], w2 scale [E, ceil(H / 128), ceil(I / 128)]."""
    from reshard.frameworks.vllm import vllm_layout
    from tiny_archs import tiny

    a = tiny("qwen3_moe", hidden=256, heads=4, kv_heads=2, head_dim=128, intermediate=512, moe_intermediate=256,
             experts=4, dtype=BF16)
    eng = precision_layout(vllm_layout(a, [0, 1], tp=2), DtypePolicy.fp8())
    b = eng.buffers(1)
    p = "model.layers.0."
    assert b[p + "self_attn.qkv_proj.weight"] == ((512, 256), FP8_DTYPE)
    assert b[p + "self_attn.qkv_proj.weight_scale_inv"] == ((4, 2), F32)
    assert b[p + "self_attn.o_proj.weight_scale_inv"] == ((2, 2), F32)
    assert b[p + "mlp.experts.routed_experts.w13_weight"] == ((4, 256, 256), FP8_DTYPE)
    assert b[p + "mlp.experts.routed_experts.w13_weight_scale_inv"] == ((4, 2, 2), F32)
    assert b[p + "mlp.experts.routed_experts.w2_weight_scale_inv"] == ((4, 2, 1), F32)
    assert b[p + "mlp.gate.weight"] == ((4, 256), BF16) and b["lm_head.weight"][1] == BF16
    assert scale_name(p + "mlp.gate.weight") not in b
    # MoE intermediate 128 split over TP 2 cuts every expert's 128-row blocks: refused, as vLLM does
    small = tiny("qwen3_moe", hidden=256, heads=4, kv_heads=2, head_dim=128, intermediate=512, moe_intermediate=128,
                 experts=4, dtype=BF16)
    with pytest.raises(rs.LayoutError, match=r"tensor 'model.layers.0.mlp.experts.0.(gate|up)_proj.weight'"):
        precision_layout(vllm_layout(small, [0, 1], tp=2), DtypePolicy.fp8())


# ---------------------------------------------------------------------------- property tests
def _cuts(draw, n: int, step: int, max_parts: int) -> list[int]:
    """Sorted cut points 0 < c < n at multiples of ``step`` (plus 0 and n)."""
    inner = [c for c in range(step, n, step)]
    chosen = draw(st.lists(st.sampled_from(inner), max_size=max_parts - 1, unique=True)) if inner else []
    return [0] + sorted(chosen) + [n]


@st.composite
def fp8_cases(draw):
    bn, bk = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    rows, cols = draw(st.integers(1, 5 * bn + 3)), draw(st.integers(1, 4 * bk + 3))
    sdtype = draw(st.sampled_from([BF16, F32]))
    w = rs.TensorSpec("mlp.up_proj.weight", (rows, cols), sdtype)
    keep = rs.TensorSpec("norm.weight", (5,), sdtype)
    cast = rs.TensorSpec("lm_head.weight", (3, 4), F32)
    # source: random boxes (uneven, both dims) on ranks 0..3, some replicated on a second rank
    rc, cc = _cuts(draw, rows, 1, 4), _cuts(draw, cols, 1, 3)
    pieces = []
    for i in range(len(rc) - 1):
        for j in range(len(cc) - 1):
            box = ((rc[i], cc[j]), (rc[i + 1] - rc[i], cc[j + 1] - cc[j]))
            holders = draw(st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True))
            for r in holders:
                pieces.append(rs.Piece(w.name, *box, f"w{i}.{j}", (0, 0), r))
    src = rs.Layout.merge([rs.Layout.from_pieces([w], pieces)] + [
        rs.Layout.from_placements(s, [0, 1], (2,), [rs.Shard(0)]) for s in (keep, cast)])
    # destination: block-aligned boxes on ranks 2..5 (2, 3 colocated with sources), each at a
    # block boundary of a taller buffer; a box may sit on two ranks (data-parallel replicas)
    dr, dc = _cuts(draw, rows, bn, 3), _cuts(draw, cols, bk, 2)
    dpieces, buffers = [], {}
    for i in range(len(dr) - 1):
        for j in range(len(dc) - 1):
            size = (dr[i + 1] - dr[i], dc[j + 1] - dc[j])
            lead = bn * draw(st.integers(0, 1))
            for r in draw(st.lists(st.integers(2, 5), min_size=1, max_size=2, unique=True)):
                name = f"d{i}.{j}"
                buffers.setdefault(r, {})[name] = ((lead + size[0] + draw(st.integers(0, 2)), size[1]), BF16)
                dpieces.append(rs.Piece(w.name, (dr[i], dc[j]), size, name, (lead, 0), r))
    dst = rs.Layout.merge([rs.Layout.from_pieces([w], dpieces, buffers)] + [
        rs.Layout.from_placements(keep, [2, 3], (2,), [rs.Replicate()]),
        rs.Layout.from_placements(cast, [4, 5], (2,), [rs.Shard(1)])])
    policy = DtypePolicy(rules=(("up_proj", FP8Block((bn, bk), draw(st.booleans()))), ("lm_head", Cast(BF16))))
    bucket = draw(st.sampled_from([None, 512, 4096]))  # 512: several rounds, and the staging shares the cap
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    full = {s.name: (torch.randn(s.shape, generator=g) * 10 ** torch.randint(-3, 4, s.shape, generator=g)).to(s.dtype)
            for s in (w, keep, cast)}
    if draw(st.booleans()):  # an all-zero block
        full[w.name][:bn, :bk] = 0
    return src, dst, policy, bucket, full


def _expected(plan: PrecisionPlan, r: int, full: dict, fill) -> dict[str, torch.Tensor]:
    """Rank r's engine buffers from the reference quantizer on the full tensors (unwritten: ``fill``)."""
    eng = plan.destination
    ref = dict(full)
    for name, info in plan.fp8.items():
        q, s = quantize_blocks(full[name], info.block, info.precision.ue8m0)
        ref[name], ref[scale_name(name)] = q, s
    out = {b: fill(shape, dt) for b, (shape, dt) in eng.buffers(r).items()}
    for p in eng.pieces(r):
        view = rs.tensors.buffer_view(out[p.buffer], p.buffer_offsets, p.sizes)
        view.copy_(ref[p.tensor][rs.tensors.box_slices(p.offsets, p.sizes)])
    return out


def _sentinel(shape, dtype):
    return torch.full(shape, -7.0).to(dtype)


def _zeros(shape, dtype):
    return torch.zeros(shape, dtype=dtype)


@PROPS
@given(fp8_cases())
def test_fp8_refit_equals_the_reference_quantizer_bit_for_bit(case):
    src, dst, policy, bucket, full = case
    plan = PrecisionPlan(src, dst, policy, max_bucket_bytes=bucket)
    out = {r: {b: _sentinel(shape, dt) for b, (shape, dt) in plan.destination.buffers(r).items()}
           for r in plan.destination.ranks}
    if not run_precision_or_refused(plan, {r: src.materialize(r, full) for r in src.ranks}, out):
        return  # the drawn cap leaves the wire too little beside the staging: refused, nothing written
    for r in plan.destination.ranks:
        want = _expected(plan, r, full, _sentinel)
        assert out[r].keys() == want.keys()
        for b, t in want.items():
            assert same_bits(out[r][b], t), (r, b, out[r][b], t)
    # every block took exactly one path, and the source path is taken exactly where a source piece holds it whole
    name = "mlp.up_proj.weight"
    paths = plan.block_paths(name)
    bn, bk = plan.fp8[name].block
    rows, cols = full[name].shape
    whole = np.zeros(paths.shape, bool)
    for p in src.all_pieces():
        if p.tensor != name:
            continue
        for i in range(paths.shape[0]):
            for j in range(paths.shape[1]):
                lo, hi = (i * bn, j * bk), (min((i + 1) * bn, rows), min((j + 1) * bk, cols))
                if all(p.offsets[d] <= lo[d] and hi[d] <= p.offsets[d] + p.sizes[d] for d in (0, 1)):
                    whole[i, j] = True
    assert ((paths == SOURCE) == whole).all() and ((paths == DESTINATION) == ~whole).all()
    by_path = plan.wire_bytes_by_path()
    assert sum(by_path.values()) == plan.wire_bytes == sum(plan.wire_bytes_by_dtype().values())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fp8_cases(), st.sampled_from([("hybrid", ("up_proj",)), ("hybrid", ("norm", "lm_head")), ("gather-broadcast", None),
                                     ("hierarchical", None)]))
def test_every_method_takes_a_dtype_policy(case, method_rule):
    """Precision is a transform of any method's plan: the registry plans the method on the wire tensors,
    the precision executor runs around the method's executor, and the engine's bytes are the reference
    quantizer's. Gather-and-broadcast quantizes every block on the receivers; the hybrid rule picks a
    wire tensor by the tensor it carries."""
    from reshard.execution.methods import make_plan

    src, dst, policy, bucket, full = case
    method, rule = method_rule
    extra = {"hybrid_rule": list(rule)} if rule else {}
    if method == "hierarchical":
        extra["domains"] = {r: r // 3 for r in range(6)}
    options = rs.RefitOptions(method=method, precision=policy, max_bucket_bytes=bucket, **extra)
    plan = make_plan(options, src, dst)
    out = {r: plan.destination.empty_buffers(r) for r in plan.destination.ranks}
    if not run_precision_or_refused(plan, {r: src.materialize(r, full) for r in src.ranks}, out):
        return  # the drawn cap leaves the wire too little beside the staging: refused, nothing written
    for r in plan.destination.ranks:
        for b, t in _expected(plan, r, full, _zeros).items():
            assert same_bits(out[r][b], t), (method, r, b)
    paths = plan.block_paths("mlp.up_proj.weight")
    if method == "gather-broadcast":
        assert (paths == DESTINATION).all()
    if method == "hybrid":  # its broadcast part quantizes on the receivers
        assert (paths == DESTINATION).all() or rs.HybridRule(patterns=rule)("mlp.up_proj.weight")
    if method == "hybrid":  # the values, scales and raw blocks of one tensor go one way
        names = (plan.wire.reshard.tensors if plan.wire.reshard is not None else [])
        carried = {n.split("@")[0].removesuffix("_scale_inv") for n in names}
        assert all(rs.HybridRule(patterns=rule)(n) for n in carried), names


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fp8_cases())
def test_hierarchical_fp8_refit_is_exact_too(case):
    src, dst, policy, bucket, full = case
    domains = {r: r // 2 for r in range(6)}
    plan = PrecisionPlan(src, dst, policy, max_bucket_bytes=bucket, domains=domains)
    out = {r: plan.destination.empty_buffers(r) for r in plan.destination.ranks}
    if not run_precision_or_refused(plan, {r: src.materialize(r, full) for r in src.ranks}, out):
        return  # the drawn cap leaves the wire too little beside the staging: refused, nothing written
    for r in plan.destination.ranks:
        for b, t in _expected(plan, r, full, _zeros).items():
            assert same_bits(out[r][b], t), (r, b)


# ---------------------------------------------------------------------------- multi-process (gloo)
def _gloo_fp8(rank, world, store_addr):
    """Ranks 0-2: FSDP-like uneven split (chunk: 171 + 171 + 170 rows); ranks 3-4: TP 2 engine (qkv-like
    fused buffer of two FP8 tensors by rows, a kept norm)."""
    from datetime import timedelta

    a = rs.TensorSpec("model.layers.0.self_attn.q_proj.weight", (512, 200), BF16)
    b = rs.TensorSpec("model.layers.0.self_attn.k_proj.weight", (256, 200), BF16)
    n = rs.TensorSpec("model.layers.0.input_layernorm.weight", (200,), BF16)
    src = rs.Layout.merge(rs.Layout.from_placements(s, [0, 1, 2], (3,), [rs.Shard(0)]) for s in (a, b, n))
    pieces = []
    for t, r in enumerate((3, 4)):
        pieces += [rs.Piece(a.name, (256 * t, 0), (256, 200), "qkv", (0, 0), r),
                   rs.Piece(b.name, (128 * t, 0), (128, 200), "qkv", (256, 0), r)]
    dst = rs.Layout.merge([rs.Layout.from_pieces([a, b], pieces),
                           rs.Layout.from_placements(n, [3, 4], (2,), [rs.Replicate()])])
    plan = PrecisionPlan(src, dst, max_bucket_bytes=8192)
    paths = plan.tensor_paths()
    assert paths[a.name]["source"] and paths[a.name]["destination"], paths  # both paths in one refit
    g = torch.Generator().manual_seed(5)
    full = {s.name: torch.randn(s.shape, generator=g).to(BF16) for s in (a, b, n)}
    sb = src.materialize(rank, full) if rank in src.ranks else {}
    db = {k: _sentinel(*v) for k, v in plan.destination.buffers(rank).items()}
    ex = PrecisionExecutor(plan, timeout=timedelta(seconds=60))
    stats = ex.run(sb, db)
    for k, want in (_expected(plan, rank, full, _sentinel) if rank in dst.ranks else {}).items():
        assert same_bits(db[k], want), (rank, k)
    assert [p.name for p in stats.phases] == ["quantize at source", "transfer", "quantize at destination"]
    assert stats.sent_bytes == sum(p.send_bytes.get(rank, 0) for p in plan.phases)
    # a destination buffer in the wrong dtype: the same error on every rank, nothing written
    if rank == 4:
        db["qkv"] = torch.zeros(db["qkv"].shape, dtype=BF16)
    before = {k: v.clone() for k, v in db.items()}
    with pytest.raises(rs.LayoutError, match=r"rank 4: destination buffer 'qkv' is \(384, 200\) torch.bfloat16, the "
                                             r"layout says \(384, 200\) torch.float8_e4m3fn"):
        ex.run(sb, db)
    assert all(same_bits(db[k], v) for k, v in before.items())
    _methods_fp8(rank, src, dst, full)
    _session_fp8(rank, world, store_addr, src, dst, full)


def _methods_fp8(rank, src, dst, full):
    """The same refit by the hybrid and gather-broadcast methods under the FP8 policy: the precision
    executor around each method's executor (collective construction: each splits a subgroup)."""
    from datetime import timedelta

    from reshard.execution.methods import make_executor, make_plan

    phase_names = {"hybrid": ["quantize at source", "transfer", "gather", "broadcast", "quantize at destination"],
                   "gather-broadcast": ["quantize at source", "gather", "broadcast", "quantize at destination"]}
    for method, rule in (("hybrid", ["q_proj"]), ("gather-broadcast", None)):
        options = rs.RefitOptions(method=method, precision="fp8", timeout=timedelta(seconds=60),
                                  **({"hybrid_rule": rule} if rule else {}))
        plan = make_plan(options, src, dst)
        db = {k: _sentinel(*v) for k, v in plan.destination.buffers(rank).items()}
        with make_executor(options, plan) as ex:
            stats = ex.run(src.materialize(rank, full) if rank in src.ranks else {}, db)
        assert [p.name for p in stats.phases] == phase_names[method], (method, [p.name for p in stats.phases])
        for k, want in (_expected(plan, rank, full, _sentinel) if rank in dst.ranks else {}).items():
            assert same_bits(db[k], want), (method, rank, k)


def _session_fp8(rank, world, store_addr, src, dst, full):
    """The same refit through a session under the FP8 policy: the engine side declares its BF16 layout
    and holds FP8 weights and scales; a fault while quantizing poisons the engines, and after recovery
    a catch-up from the trainer quantizes again, bit for bit."""
    from datetime import timedelta

    from reshard.execution import faults
    from reshard.refit.session import RefitError, RefitSession
    from reshard.refit.sides import Side

    eng = dst.ranks
    engine = precision_layout(dst, "fp8").empty_buffers(rank) if rank in eng else None
    source = Side.from_layout(src, rank, src.materialize(rank, full)) if rank in src.ranks else None
    destination = Side.from_layout(dst, rank, engine) if engine is not None else None
    s = RefitSession.connect(source=source, destination=destination, store_addr=store_addr, rank=rank,
                             world_size=world, timeout=timedelta(seconds=5), precision="fp8", max_bucket_bytes=16384)
    stats = s.refit(1)
    want = _expected(s.plan, rank, full, _zeros) if rank in eng else {}
    assert all(same_bits(engine[k], v) for k, v in want.items()), rank
    assert stats.in_place_bytes == sum(v.numel() * v.element_size() for v in want.values())
    assert [p.name for p in stats.run.phases] == ["quantize at source", "transfer", "quantize at destination"]
    # a fault at the destination's quantization: every rank raises, the engines are poisoned at version 1
    if source is not None:
        for t in source.tensors.values():
            t.mul_(2)
    if rank == 4:
        faults.arm("raise@quantize at destination")
    with pytest.raises(RefitError, match="quantize at destination"):
        s.refit(2)
    faults.arm(None)
    assert s.version == 1 and s.state == ("poisoned" if rank in eng else "ready")
    s = s.recover()
    stats = s.catch_up(source="trainer", version=2)
    assert s.state == "ready" and s.version == 2
    twice = {n: (v * 2).to(v.dtype) for n, v in full.items()}
    want = _expected(s.plan, rank, twice, _zeros) if rank in eng else {}
    assert all(same_bits(engine[k], v) for k, v in want.items()), rank
    s.close()


@pytest.mark.parametrize("options, match", [
    (dict(method="gather-broadcast", precision="fp8", checksum=True), "method 'gather-broadcast' does not take "
                                                                       "option 'checksum'"),
    (dict(precision="fp4"), "unknown precision 'fp4'"),
    (dict(precision=3), "dtype policy 3"),
])
def test_session_precision_options_are_checked_before_connecting(options, match):
    from reshard.errors import OptionsError
    from reshard.refit.session import RefitSession

    with pytest.raises(OptionsError, match=match):  # no store at port 1: it fails before any connection
        RefitSession.connect(store_addr="127.0.0.1:1", rank=0, world_size=2, **options)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fp8_refit_over_gloo():
    rs.spawn(_gloo_fp8, 5, f"127.0.0.1:{free_port()}")


def _gloo_bounded(rank, world, store_addr):
    """Six 384 x 128 tensors, rows split 2 ways by sources 0-1 (192 each: block rows 0 and 2 whole on one
    source, row 1 on both, crossing raw), replicated on destinations 2-3. Cap 64 KiB: one tensor a group
    (16 KiB of FP8 staging on a source, 32 KiB of raw on a destination), where all at once a destination
    would stage 192 KiB."""
    from datetime import timedelta

    from reshard.execution import faults
    from reshard.execution.control import RefitError

    cap = 64 << 10
    specs = [rs.TensorSpec(f"model.layers.{i}.mlp.down_proj.weight", (384, 128), BF16) for i in range(6)]
    src = rs.Layout.merge(rs.Layout.from_placements(s, [0, 1], (2,), [rs.Shard(0)]) for s in specs)
    dst = rs.Layout.merge(rs.Layout.from_placements(s, [2, 3], (2,), [rs.Replicate()]) for s in specs)
    plan = PrecisionPlan(src, dst, max_bucket_bytes=cap)
    old = plan.staging_bytes()  # what a rank staged before tensor groups: all of it at once
    all_at_once = old["source"].get(rank, 0) + old["destination"].get(rank, 0)
    assert max(old["destination"].values()) == 6 * 128 * 128 * 2 == 3 * cap
    assert plan.peak_staging_bytes().get(rank, 0) <= cap // 2 < all_at_once, (rank, plan.peak_staging_bytes())
    g = torch.Generator().manual_seed(7)
    full = {s.name: torch.randn(s.shape, generator=g).to(BF16) for s in specs}
    sb = src.materialize(rank, full) if rank in src.ranks else {}
    db = {k: _sentinel(*v) for k, v in plan.destination.buffers(rank).items()}
    ex = PrecisionExecutor(plan, timeout=timedelta(seconds=60))
    assert len(ex.children) == 6 and ex.staging_bytes() <= cap, (rank, ex.staging_bytes())
    stats = ex.run(sb, db)
    for k, want in (_expected(plan, rank, full, _sentinel) if rank in dst.ranks else {}).items():
        assert same_bits(db[k], want), (rank, k)
    assert [p.name for p in stats.phases] == ["quantize at source", "transfer", "quantize at destination"]
    # measured: each group's staging as allocated, plus its transfer's peak
    assert 0 < stats.peak_staging_bytes <= ex.staging_bytes() <= cap, (rank, stats.phases)
    assert all_at_once >= 2 * cap or rank in src.ranks, (rank, all_at_once)
    assert stats.sent_bytes == sum(p.send_bytes.get(rank, 0) for p in plan.phases)
    # a failure in one rank's quantization (the group is broken after it): RefitError on every rank
    if rank == 3:
        faults.arm("raise@quantize at destination")
    with pytest.raises(RefitError, match="quantize at destination"):
        ex.run(sb, db)
    faults.arm(None)
    ex.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fp8_refit_over_gloo_stages_a_tensor_group_at_a_time():
    rs.spawn(_gloo_bounded, 4, f"127.0.0.1:{free_port()}")


# ---------------------------------------------------------------------------- vLLM
def check_vllm(family: str, tp: int) -> list[str]:
    """Build vLLM's block-FP8 model (``quantization_config`` fp8, ``weight_block_size`` [128, 128]) on every
    simulated TP rank, load an FP8 checkpoint made by ``quantize_blocks`` with vLLM's own ``load_weights``
    and compare every parameter with what an FSDP BF16 -> FP8 refit writes into
    ``precision_layout(vllm_layout(...))`` (:func:`vllm_helpers.check_quantized_loads`).

    vLLM 0.32's CPU build cannot build these models on a CPU without AMX: ``Fp8LinearMethod.create_weights``
    registers ``weight`` and ``weight_scale_inv`` and then fails choosing a matmul kernel
    ("CPUFp8BlockScaledMMKernel requires AMX tile support"). Where that happens we record it and
    replace only that kernel choice (``init_fp8_linear_kernel``), after the parameters and their weight
    loaders exist: the layouts are still checked against vLLM's own parameters and loaders."""
    import vllm.model_executor.layers.quantization.fp8 as vfp8
    from vllm_helpers import check_quantized_loads

    from tiny_archs import tiny

    kw = dict(hidden=256, heads=4, kv_heads=2, head_dim=128, intermediate=512, dtype=BF16)
    if family == "qwen3_moe":
        kw.update(moe_intermediate=256, experts=4)
    a = tiny(family, **kw)
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
              "ignored_layers": [f"model.layers.{i}.mlp.gate" for i in range(a.layers)]}

    def quantize(plan, full):
        out = {}
        for name, info in plan.fp8.items():
            out[name], out[scale_name(name)] = quantize_blocks(full[name], info.block)
        return out

    def headline(plan):
        paths = plan.tensor_paths()
        return (f"{family} tp{tp}: {len(plan.fp8)} FP8 tensors, blocks quantized at source "
                f"{sum(p['source'] for p in paths.values())}, at destination "
                f"{sum(p['destination'] for p in paths.values())}")

    def stub_kernel(error):
        if "AMX" not in str(error):
            return None
        original = vfp8.init_fp8_linear_kernel
        vfp8.init_fp8_linear_kernel = lambda **_: None
        return (f"vLLM cannot build block-FP8 linear layers on this CPU: {str(error).splitlines()[-1]} "
                f"-- checking its parameters with the kernel choice stubbed out",
                lambda: setattr(vfp8, "init_fp8_linear_kernel", original))

    return check_quantized_loads(a, tp, config, DtypePolicy.fp8(), quantize, seed=3, stub_kernel=stub_kernel,
                                 headline=headline)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,tp", [("qwen3", 2), ("qwen3_moe", 2)])
def test_fp8_layouts_match_vllm_block_fp8_loaders(vllm_worker, family, tp):
    run_in_worker(vllm_worker, check_vllm, family, tp)


def test_tensors_sharing_piece_arrays_each_get_their_own_scale_buffers():
    """Layout builders share piece arrays among tensors alike (a model's experts); the FP8 layout checks
    and scales them once per arrays, yet every scale table names its own tensor's buffers."""
    from reshard.frameworks.parallel import model_layouts
    from reshard.models import tiny_arch
    from reshard.planning.fp8_layout import scale_table

    destination = model_layouts(tiny_arch("qwen3-30b-a3b"), "ep2", "tp2,dp2,independent").destination
    policy = DtypePolicy.fp8(block=(16, 16))
    held = precision_layout(destination, policy)
    fp8 = [n for n, p in layout_precisions(destination, policy).items() if isinstance(p, FP8Block)]
    ids = [id(destination.tables[n].offsets) for n in fp8]
    assert len(set(ids)) < len(ids) / 4  # most FP8 tensors share their arrays with others
    for name in fp8:
        alone = scale_table(destination.tables[name], (16, 16))  # worked out for this tensor alone
        got = held.tables[scale_name(name)]
        own = tuple(b + "_scale_inv" for b in destination.tables[name].buffers)
        assert tuple(got.buffers) == tuple(alone.buffers) == own
        for field in ("ranks", "offsets", "sizes", "buffer_offsets"):
            assert np.array_equal(getattr(got, field), getattr(alone, field)), (name, field)


def test_wire_tables_of_tensors_sharing_piece_arrays_equal_each_tensor_planned_alone():
    """The precision plan works out the wire's arrays once for tensors alike (a model's experts: the cut
    destination boxes, the staging of their blocks); every wire table and staging buffer must still be what
    a plan of that tensor alone gives, under that tensor's own buffer names. FSDP over 3 ranks cuts blocks,
    so both paths (quantized at a source after assembly, raw) are taken."""
    from reshard.frameworks.parallel import model_layouts
    from reshard.models import tiny_arch
    from reshard.planning.hybrid import tensor_subset
    from reshard.planning.fp8_blocks import RAW_SUFFIX

    lay = model_layouts(tiny_arch("qwen3-30b-a3b"), "fsdp:dp3", "tp2,dp2,independent")
    policy = DtypePolicy.fp8(block=(16, 16))
    assemble = {0: 0, 1: 0, 2: 1}
    whole = PrecisionPlan(lay.source, lay.destination, policy, assemble=assemble)
    experts = [n for n in whole.fp8 if ".experts." in n]
    assert len({id(lay.destination.tables[n].offsets) for n in experts}) < len(experts) / 4
    paths = set()
    for name in experts:
        alone = PrecisionPlan(tensor_subset(lay.source, [name]), tensor_subset(lay.destination, [name]), policy,
                              assemble=assemble)
        for side in ("source", "destination"):
            got, want = getattr(whole.wire, side), getattr(alone.wire, side)
            for wire_name in (name, scale_name(name), name + RAW_SUFFIX):
                assert (wire_name in got.tables) == (wire_name in want.tables), (side, wire_name)
                if wire_name not in want.tables:
                    continue
                paths.add(wire_name[len(name):])
                assert got.specs[wire_name] == want.specs[wire_name]
                g, w = got.tables[wire_name], want.tables[wire_name]
                assert tuple(g.buffers) == tuple(w.buffers), (side, wire_name)
                for field in ("ranks", "offsets", "sizes", "buffer_offsets"):
                    assert np.array_equal(getattr(g, field), getattr(w, field)), (side, wire_name, field)
                for rank, buffer in zip(g.ranks.tolist(), g.buffers):
                    assert got.buffer_spec(rank, buffer) == want.buffer_spec(rank, buffer), (side, wire_name, rank)
    assert paths == {"", "_scale_inv", RAW_SUFFIX}  # both paths taken
