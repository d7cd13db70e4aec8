"""Issue 23 §3: MXFP8 (OCP Microscaling v1.0: 1x32 blocks along the reduction dim, E8M0 scales).

The reference here is written from the spec element by element in plain Python (``math.frexp`` for the
shared exponent, the 256 float8_e4m3fn codes enumerated for the element cast), independent of
:func:`reshard.quant.quantize_mx`; the refit's engine bytes must equal it on the full tensor whichever
path each block took (quantized on a source that holds it whole, or on the destination)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as rs
from reshard.planning.precision import (DESTINATION, SOURCE, DtypePolicy, Keep, MXFP8Block,
                                        PrecisionPlan, precision_layout)
from reshard.quant import FP8_DTYPE, dequantize_mx, e8m0_to_float, quantize_mx

from strategies import run_precision_or_refused
from vllm_helpers import run_in_worker, vllm_worker  # noqa: F401  (vllm_worker: a fixture)

BF16, F32, U8 = torch.bfloat16, torch.float32, torch.uint8
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MX = MXFP8Block()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# ---------------------------------------------------------------------------- the reference, from the spec
def _e4m3_value(code: int) -> float:
    """float8_e4m3fn's value of ``code`` (bias 7, no infinities, S.1111.111 is NaN), from the format."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0 ** -9
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


E4M3 = sorted((_e4m3_value(c), c) for c in range(128) if not math.isnan(_e4m3_value(c)))  # non-negative codes


def _e4m3_code(v: float) -> int:
    """Round ``v`` to float8_e4m3fn: nearest, ties to the even code, saturating at 448; NaN -> 0x7F."""
    if math.isnan(v):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), 448.0)
    best = min(E4M3, key=lambda vc: (abs(vc[0] - a), vc[1] & 1))
    return sign | best[1]


def spec_mx(x: torch.Tensor, k: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX v1.0 conversion, block by block, element by element (the rounding rules of quantize_mx's doc)."""
    rows, cols = x.shape
    xs = x.float().tolist()
    q = np.zeros((rows, cols), np.uint8)
    s = np.zeros((rows, -(-cols // k)), np.uint8)
    for i in range(rows):
        for j in range(0, cols, k):
            block = xs[i][j:j + k]
            if any(math.isnan(v) or math.isinf(v) for v in block):
                s[i, j // k] = 0xFF
                q[i, j:j + k] = 0x7F
                continue
            amax = max(abs(v) for v in block)
            e = -127 if amax == 0 else math.frexp(amax)[1] - 1 - 8  # floor(log2(amax)) - emax_elem
            e = max(-127, min(127, e))
            s[i, j // k] = e + 127
            for c, v in enumerate(block):
                q[i, j + c] = _e4m3_code(v * 2.0 ** -e)
    return torch.from_numpy(q).view(FP8_DTYPE), torch.from_numpy(s)


@st.composite
def mx_tensors(draw):
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 100))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    x = torch.randn(rows, cols, generator=g) * 10.0 ** torch.randint(-40, 38, (rows, 1), generator=g).float()
    special = draw(st.sampled_from(["none", "zero", "nan", "inf", "tiny", "ties"]))
    if special == "zero":
        x[0, :32] = 0
    elif special == "nan":
        x[0, min(5, cols - 1)] = float("nan")
    elif special == "inf":
        x[-1, 0] = -float("inf")
    elif special == "tiny":  # float32 subnormals: exponent clamps at -127
        x[0] = torch.randn(cols, generator=g) * 1e-42
    elif special == "ties":  # exact halfway points between e4m3 values, and values above 448 after scaling
        x[0] = torch.tensor([(1 + (2 * (i % 8) + 1) / 16) * 2.0 ** (i % 5) for i in range(cols)])
        x[0, 0] = 1.99 * 2 ** 4
    return x.to(draw(st.sampled_from([BF16, F32])))


@PROPS
@given(mx_tensors())
def test_quantize_mx_equals_the_spec_written_out(x):
    q, s = quantize_mx(x)
    want_q, want_s = spec_mx(x)
    assert s.dtype == U8 and s.shape == want_s.shape and torch.equal(s, want_s)
    assert same_bits(q, want_q)


def test_e8m0_scales_and_saturation():
    # amax 1.99 * 2**4: e = 4 - 8 = -4, amax * 2**4 = 509.4 saturates to 448 (the spec's clamp)
    x = torch.tensor([[1.99 * 16, 1.0] + [0.0] * 30])
    q, s = quantize_mx(x)
    assert s.tolist() == [[127 - 4]] and q.float()[0, :2].tolist() == [448.0, 16.0]
    assert e8m0_to_float(s).tolist() == [[2.0 ** -4]]
    # dequantized: exact for values e4m3 can hold at that scale
    y = torch.tensor([[3.0, -96.0, 0.5, 0.0] + [1.0] * 28])
    assert torch.equal(dequantize_mx(*quantize_mx(y)), y)
    assert MX.scale_dtype == U8 and MX.scale_name("w.weight") == "w.weight_scale" and MX.mx
    with pytest.raises(ValueError, match="MXFP8Block takes no options"):
        MXFP8Block(block=(1, 16))


def test_named_policies_and_cli_choice():
    pol = DtypePolicy.named("mxfp8")
    spec = lambda n: rs.TensorSpec(n, (64, 64), BF16)  # noqa: E731
    assert pol(spec("model.layers.0.self_attn.qkv_proj.weight")) == MX
    assert isinstance(pol(spec("model.layers.0.mlp.gate.weight")), Keep)
    assert DtypePolicy.named("mxfp8").key != DtypePolicy.named("fp8").key
    with pytest.raises(ValueError, match="mxfp8"):
        DtypePolicy.named("mxfp4")


# ---------------------------------------------------------------------------- layouts
def _spec(name="model.layers.0.mlp.down_proj.weight", shape=(8, 256), dtype=BF16):
    return rs.TensorSpec(name, shape, dtype)


def test_a_split_through_a_32_element_block_names_the_tensor():
    w = _spec(shape=(64, 96))
    src = rs.Layout.from_placements(w, [0], (1,), [rs.Replicate()])
    ok = rs.Layout.from_placements(w, [1, 2, 3], (3,), [rs.Shard(1)])  # 32 columns each: whole blocks
    PrecisionPlan(src, ok, "mxfp8")
    bad = rs.Layout.from_placements(w, [1, 2], (2,), [rs.Shard(1)])  # 48 columns: cuts a block
    with pytest.raises(rs.LayoutError, match=r"tensor 'model.layers.0.mlp.down_proj.weight'.*column 48.*1x32 blocks"):
        PrecisionPlan(src, bad, "mxfp8")
    # rows split anywhere: a block is one row
    rows = rs.Layout.from_placements(w, [1, 2, 3], (3,), [rs.Shard(0)])  # 22 + 22 + 20 rows
    p = PrecisionPlan(src, rows, "mxfp8")
    assert p.destination.buffers(3)[w.name + "_scale"] == ((20, 3), U8)


def test_mx_paths_figures_and_staging():
    """FSDP-like column cut on the source (by rows of 32-element blocks: cols 0:40 | 40:96): the block
    [32:64) of every row is cut, so it crosses raw and is quantized at the destination."""
    w = _spec(shape=(4, 96))
    src = rs.Layout.from_pieces([w], [rs.Piece(w.name, (0, 0), (4, 40), "w", (0, 0), 0),
                                      rs.Piece(w.name, (0, 40), (4, 56), "w", (0, 0), 1)])
    dst = rs.Layout.from_placements(w, [2, 3], (2,), [rs.Shard(0)])
    p = PrecisionPlan(src, dst, "mxfp8")
    assert p.block_paths(w.name).tolist() == [[SOURCE, DESTINATION, SOURCE]] * 4
    assert p.wire_bytes_by_path() == {"fp8": 4 * 64, "scales": 4 * 2, "raw": 4 * 32 * 2, "other": 0}
    assert p.wire_bytes_by_dtype() == {"bfloat16": 256, "float8_e4m3fn": 256, "uint8": 8}
    assert p.destination.buffers(2) == {w.name: ((2, 96), FP8_DTYPE), w.name + "_scale": ((2, 3), U8)}
    assert p.fingerprint() != PrecisionPlan(src, rs.Layout.from_placements(w, [2, 3], (2,), [rs.Shard(0)]),
                                            DtypePolicy.fp8(block=(1, 32))).fingerprint()


def test_vllm_layouts_in_mxfp8_have_vllms_parameters():
    """precision_layout of vllm_layout under MXFP8 against the parameters vLLM 0.32's MXFP8 layers create
    (ModelOpt ``KMxfp8Static.create_weights`` and compressed-tensors ``CompressedTensorsW8A8Mxfp8``: weight
    [out_per_rank, in_per_rank] float8_e4m3fn, weight_scale [out_per_rank, in_per_rank // 32] uint8;
    MoE (``ModelOptMxFp8FusedMoE``, ``CompressedTensorsW8A8Mxfp8MoEMethod``): w13_weight_scale
    [E, 2 I / tp, H // 32], w2_weight_scale [E, H, I / tp // 32] uint8)."""
    from reshard.frameworks.vllm import vllm_layout
    from tiny_archs import tiny

    a = tiny("qwen3_moe", hidden=256, heads=4, kv_heads=2, head_dim=128, intermediate=512, moe_intermediate=128,
             experts=4, dtype=BF16)
    eng = precision_layout(vllm_layout(a, [0, 1], tp=2), DtypePolicy.mxfp8())
    b = eng.buffers(1)
    p = "model.layers.0."
    assert b[p + "self_attn.qkv_proj.weight"] == ((512, 256), FP8_DTYPE)
    assert b[p + "self_attn.qkv_proj.weight_scale"] == ((512, 8), U8)
    assert b[p + "self_attn.o_proj.weight_scale"] == ((256, 8), U8)  # row parallel: in 512 / tp 2 / 32
    assert b[p + "mlp.experts.routed_experts.w13_weight"] == ((4, 128, 256), FP8_DTYPE)
    assert b[p + "mlp.experts.routed_experts.w13_weight_scale"] == ((4, 128, 8), U8)
    assert b[p + "mlp.experts.routed_experts.w2_weight_scale"] == ((4, 256, 2), U8)
    assert b[p + "mlp.gate.weight"] == ((4, 256), BF16) and p + "mlp.gate.weight_scale" not in b
    assert not any(n.endswith("_scale_inv") for n in b)
    # 64 intermediate rows over TP 2 is fine for MX (rows are free); 48 input columns per rank are not
    small = tiny("qwen3", hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=96, dtype=BF16)
    with pytest.raises(rs.LayoutError, match=r"tensor 'model.layers.0.mlp.down_proj.weight'.*1x32"):
        precision_layout(vllm_layout(small, [0, 1], tp=2), DtypePolicy.mxfp8())


# ---------------------------------------------------------------------------- property tests over layouts
def _cuts(draw, n: int, step: int, max_parts: int) -> list[int]:
    inner = list(range(step, n, step))
    chosen = draw(st.lists(st.sampled_from(inner), max_size=max_parts - 1, unique=True)) if inner else []
    return [0] + sorted(chosen) + [n]


@st.composite
def mx_cases(draw):
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 4 * 32 + 7))
    sdtype = draw(st.sampled_from([BF16, F32]))
    w = rs.TensorSpec("mlp.up_proj.weight", (rows, cols), sdtype)
    keep = rs.TensorSpec("norm.weight", (5,), sdtype)
    rc, cc = _cuts(draw, rows, 1, 3), _cuts(draw, cols, 1, 4)  # source: cuts anywhere
    pieces = []
    for i in range(len(rc) - 1):
        for j in range(len(cc) - 1):
            box = ((rc[i], cc[j]), (rc[i + 1] - rc[i], cc[j + 1] - cc[j]))
            for r in draw(st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True)):
                pieces.append(rs.Piece(w.name, *box, f"w{i}.{j}", (0, 0), r))
    src = rs.Layout.merge([rs.Layout.from_pieces([w], pieces), rs.Layout.from_placements(keep, [0, 1], (2,),
                                                                                         [rs.Shard(0)])])
    dr, dc = _cuts(draw, rows, 1, 3), _cuts(draw, cols, 32, 3)  # destination: whole 32-element blocks
    dpieces, buffers = [], {}
    for i in range(len(dr) - 1):
        for j in range(len(dc) - 1):
            size = (dr[i + 1] - dr[i], dc[j + 1] - dc[j])
            lead = draw(st.integers(0, 2))
            for r in draw(st.lists(st.integers(2, 5), min_size=1, max_size=2, unique=True)):
                name = f"d{i}.{j}"
                buffers.setdefault(r, {})[name] = ((lead + size[0] + draw(st.integers(0, 1)), size[1]), BF16)
                dpieces.append(rs.Piece(w.name, (dr[i], dc[j]), size, name, (lead, 0), r))
    dst = rs.Layout.merge([rs.Layout.from_pieces([w], dpieces, buffers),
                           rs.Layout.from_placements(keep, [2, 3], (2,), [rs.Replicate()])])
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    full = {s.name: (torch.randn(s.shape, generator=g) * 10 ** torch.randint(-3, 4, s.shape, generator=g)).to(s.dtype)
            for s in (w, keep)}
    if draw(st.booleans()):
        full[w.name][0, :32] = 0
    domains = draw(st.sampled_from([None, {r: r // 2 for r in range(6)}]))
    return src, dst, draw(st.sampled_from([None, 512, 4096])), domains, full


@PROPS
@given(mx_cases())
def test_mxfp8_refit_equals_the_spec_reference_bit_for_bit(case):
    src, dst, bucket, domains, full = case
    plan = PrecisionPlan(src, dst, "mxfp8", max_bucket_bytes=bucket, domains=domains)
    eng = plan.destination
    out = {r: {b: torch.full(shape, 7).to(dt) for b, (shape, dt) in eng.buffers(r).items()} for r in eng.ranks}
    if not run_precision_or_refused(plan, {r: src.materialize(r, full) for r in src.ranks}, out):
        return  # the drawn cap leaves the wire too little beside the staging: refused, nothing written
    name = "mlp.up_proj.weight"
    ref_q, ref_s = spec_mx(full[name])
    ref = {name: ref_q, name + "_scale": ref_s, "norm.weight": full["norm.weight"]}
    for r in eng.ranks:
        for p in eng.pieces(r):
            got = rs.tensors.buffer_view(out[r][p.buffer], p.buffer_offsets, p.sizes)
            assert same_bits(got, ref[p.tensor][rs.tensors.box_slices(p.offsets, p.sizes)]), (r, p)
    # every block took one path, the source path exactly where a source piece holds its 32 elements whole
    paths = plan.block_paths(name)
    rows, cols = full[name].shape
    whole = np.zeros(paths.shape, bool)
    for p in src.all_pieces():
        if p.tensor == name:
            for j in range(paths.shape[1]):
                lo, hi = j * 32, min((j + 1) * 32, cols)
                if p.offsets[1] <= lo and hi <= p.offsets[1] + p.sizes[1]:
                    whole[p.offsets[0]:p.offsets[0] + p.sizes[0], j] = True
    assert ((paths == SOURCE) == whole).all() and ((paths == DESTINATION) == ~whole).all()
    assert sum(plan.wire_bytes_by_path().values()) == plan.wire_bytes


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mx_cases(), st.sampled_from(["gather-broadcast", "hybrid"]))
def test_mxfp8_through_other_methods_is_exact(case, method):
    from reshard.execution.methods import make_plan

    src, dst, bucket, _, full = case
    extra = {"hybrid_rule": ["up_proj"]} if method == "hybrid" else {}
    plan = make_plan(rs.RefitOptions(method=method, precision="mxfp8", max_bucket_bytes=bucket, **extra), src, dst)
    out = {r: plan.destination.empty_buffers(r) for r in plan.destination.ranks}
    if not run_precision_or_refused(plan, {r: src.materialize(r, full) for r in src.ranks}, out):
        return  # the drawn cap leaves the wire too little beside the staging: refused, nothing written
    name = "mlp.up_proj.weight"
    ref_q, ref_s = spec_mx(full[name])
    ref = {name: ref_q, name + "_scale": ref_s, "norm.weight": full["norm.weight"]}
    for r in plan.destination.ranks:
        for p in plan.destination.pieces(r):
            got = rs.tensors.buffer_view(out[r][p.buffer], p.buffer_offsets, p.sizes)
            assert same_bits(got, ref[p.tensor][rs.tensors.box_slices(p.offsets, p.sizes)]), (method, r, p)


# ---------------------------------------------------------------------------- the CLI
def test_plan_precision_mxfp8(capsys):
    from reshard.apps.cli import main

    args = ["plan", "--model", "qwen3-8b", "--train", "tp2,pp2", "--infer", "tp4,dp2", "--json"]
    assert main(args + ["--precision", "mxfp8"]) == 0
    mx = json.loads(capsys.readouterr().out)
    assert main(args + ["--precision", "fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert mx["precision"] == "mxfp8"
    assert mx["wire_bytes_by_dtype"]["float8_e4m3fn"] == fp8["wire_bytes_by_dtype"]["float8_e4m3fn"]
    # one uint8 scale per 32 elements: 1/32 of the fp8 bytes (TP2 x PP2 holds every 1x32 block whole)
    assert mx["wire_bytes_by_precision"]["scales"] == mx["wire_bytes_by_precision"]["fp8"] // 32
    assert mx["wire_bytes_by_precision"]["raw"] == 0 and mx["blocks"]["at_destination"] == 0
    assert main(args[:-1] + ["--precision", "mxfp8"]) == 0
    assert "MXFP8" in capsys.readouterr().out


# ---------------------------------------------------------------------------- against vLLM's own MXFP8 loaders
def check_vllm_mxfp8(family: str, tp: int) -> list[str]:
    """Build vLLM 0.32's MXFP8 model (``quantization_config`` ``quant_method: mxfp8``, which vLLM reads as a
    ModelOpt MXFP8 checkpoint: ``ModelOptMxFp8Config``) on every simulated TP rank, load an MXFP8
    checkpoint made by the spec reference (``<name>.weight`` e4m3, ``<name>.weight_scale`` uint8 E8M0)
    with vLLM's own ``load_weights``, and compare every parameter (names, shapes, dtypes, bytes) with
    what an FSDP BF16 -> MXFP8 refit writes into ``precision_layout(vllm_layout(...), "mxfp8")``
    (:func:`vllm_helpers.check_quantized_loads`)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization import modelopt
    from vllm_helpers import check_quantized_loads

    from tiny_archs import tiny

    kw = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, dtype=BF16)
    if family == "qwen3_moe":
        kw.update(moe_intermediate=128, experts=4)
    a = tiny(family, **kw)
    config = {"quant_method": "mxfp8", "kv_cache_quant_algo": None,
              "ignored_layers": ([f"model.layers.{i}.mlp.gate" for i in range(a.layers)] if family == "qwen3_moe"
                                 else []) + ["lm_head"]}

    def quantize(plan, full):
        out = {}
        for name in plan.fp8:
            out[name], out[name + "_scale"] = spec_mx(full[name])
        return out

    def stub_kernel(error):
        if "MXFP8 linear" not in str(error):
            return None
        original = modelopt.select_linear_kernel
        modelopt.select_linear_kernel = lambda *a, **k: SimpleNamespace(input_quant_key=lambda: None)
        return (f"vLLM finds no MXFP8 matmul kernel on this CPU ({str(error).splitlines()[0]}) -- "
                f"checking its parameters with the kernel choice stubbed out",
                lambda: setattr(modelopt, "select_linear_kernel", original))

    return check_quantized_loads(a, tp, config, "mxfp8", quantize, seed=5, stub_kernel=stub_kernel,
                                 headline=lambda plan: f"{family} tp{tp}: {len(plan.fp8)} MXFP8 tensors")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,tp", [("qwen3", 2), ("qwen3_moe", 2)])
def test_mxfp8_layouts_match_vllm_mxfp8_loaders(vllm_worker, family, tp):
    run_in_worker(vllm_worker, check_vllm_mxfp8, family, tp)
