"""Issue 13 §4: `reshard plan --precision fp8`, `reshard simulate --precision`, the Kimi-K2 rows as published
(FSDP BF16 training -> FP8 inference), and run_local taking a PrecisionPlan."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import reshard as rs
from reshard.apps.cli import main
from reshard.apps.simulate import CASES, METHODS, Case, simulate_case, to_json
from reshard.execution.local import run_local
from reshard.planning.precision import precision_plan
from reshard.quant import quantize_blocks

KNOWN = {c.key: c for c in CASES}
PLAN = ["plan", "--model", "qwen3-8b", "--train", "tp2,pp2", "--infer", "tp4,dp2"]


def _plan_json(capsys, *extra) -> dict:
    assert main(PLAN + ["--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_reports_the_fp8_wire(capsys):
    bf16 = _plan_json(capsys)
    fp8 = _plan_json(capsys, "--precision", "fp8")
    assert bf16["precision"] == "bf16" and fp8["precision"] == "fp8"
    for out in (bf16, fp8):
        assert {"wire_bytes", "wire_bytes_by_precision", "wire_bytes_by_dtype", "blocks", "bf16_wire_bytes",
                "fingerprint", "max_send_bytes", "max_recv_bytes"} <= set(out)
        assert set(out["wire_bytes_by_precision"]) == {"fp8", "scales", "raw", "other"}
        assert sum(out["wire_bytes_by_precision"].values()) == out["wire_bytes"]
        assert sum(out["wire_bytes_by_dtype"].values()) == out["wire_bytes"]
        assert out["bf16_wire_bytes"] == bf16["wire_bytes"]
    assert bf16["wire_bytes_by_precision"]["other"] == bf16["wire_bytes"] and bf16["blocks"]["at_source"] == 0
    # TP2 x PP2 sources hold every 128x128 block whole: all quantized at a source, half the bytes or so
    assert fp8["blocks"]["at_source"] > 0 and fp8["blocks"]["at_destination"] == 0
    assert fp8["wire_bytes_by_precision"]["raw"] == 0 and fp8["wire_bytes_by_precision"]["fp8"] > 0
    assert 0.5 * bf16["wire_bytes"] < fp8["wire_bytes"] < 0.6 * bf16["wire_bytes"]
    assert fp8["wire_bytes_by_dtype"]["float8_e4m3fn"] == fp8["wire_bytes_by_precision"]["fp8"]
    assert fp8["fingerprint"] != bf16["fingerprint"]


def test_plan_tables_show_the_fp8_wire(capsys):
    assert main(PLAN + ["--precision", "fp8"]) == 0
    out = capsys.readouterr().out
    for words in ("FP8 destination", "fp8 values", "raw blocks", "BF16 plan, for comparison", "quantized at a source"):
        assert words in out


def test_plan_topology_models_the_fp8_traffic_and_bf16_baselines(capsys):
    bf16 = _plan_json(capsys, "--topology", "dgx-h100")
    fp8 = _plan_json(capsys, "--topology", "dgx-h100", "--precision", "fp8")
    assert set(fp8["modeled_s"]) == set(METHODS)
    # reshard moves the FP8 wire: faster; the baselines move BF16 and the engine quantizes (assumed): unchanged
    assert fp8["modeled_s"]["hierarchical"] < 0.7 * bf16["modeled_s"]["hierarchical"]
    assert fp8["lower_bound_s"] < 0.7 * bf16["lower_bound_s"]
    for k in ("gather_broadcast", "gather_broadcast_naive", "hybrid"):
        assert fp8["modeled_s"][k] == pytest.approx(bf16["modeled_s"][k])
    assert fp8["wire_bytes"] < bf16["wire_bytes"]


def test_a_split_through_a_block_is_one_line_naming_the_tensor(capsys):
    # Qwen3-30B-A3B's experts (768 rows) over TP 8: 96 rows a rank, inside one 128-row block
    args = ["plan", "--model", "qwen3-30b-a3b", "--train", "ep8,pp2", "--infer", "tp8,dp2", "--precision", "fp8"]
    assert main(args) == 2
    out = capsys.readouterr().out.strip()
    assert "Traceback" not in out and len(out.splitlines()) == 1
    assert "'model.layers.0.mlp.experts.0.gate_proj.weight'" in out and "cuts through 128x128 blocks" in out
    assert main(args + ["--json", "--topology", "dgx-h100"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "cuts through 128x128 blocks" in captured.err


def test_kimi_rows_are_fsdp_bf16_training_to_fp8_inference():
    for key in ("kimi-h100", "kimi-h100-engines"):
        c = KNOWN[key]
        assert c.model == "kimi-k2" and c.train.startswith("fsdp:") and c.precision == "fp8"
        assert "Megatron" not in c.differs and "FP8" not in c.differs.split(";")[0]
    assert ",ep" in KNOWN["kimi-h100"].infer  # TP over 128 ranks would split the experts through blocks
    assert all(c.precision == "bf16" for c in CASES if not c.key.startswith("kimi"))


def test_simulate_fp8_row_on_a_small_case():
    case = Case("qwen8-fsdp", "qwen3-8b", "fsdp:dp16", "tp8,dp2,independent", "dgx-h100", "-")
    bf16, fp8 = simulate_case(case), simulate_case(case, precision="fp8")
    assert bf16.precision == "bf16" and fp8.precision == "fp8"
    f = fp8.figures
    # FSDP over 16 ranks: most blocks are whole on a source; the rest are assembled in their training domain
    # (8 GPUs) first and cross as FP8 too: nothing crosses raw (issue 23 §4)
    assert f["blocks_at_source"] > f["blocks_assembled"] > 0 == f["blocks_at_destination"]
    assert f["wire_bytes_by_precision"]["raw"] == 0 and f["assembly_bytes"] > 0 and f["assembly_s"] > 0
    assert f["wire_bytes"] < 0.7 * bf16.figures["wire_bytes"]
    assert fp8.seconds("hierarchical") < bf16.seconds("hierarchical")
    assert fp8.seconds("gather_broadcast") == pytest.approx(bf16.seconds("gather_broadcast"))
    assert fp8.lower_bound_s <= fp8.seconds("hierarchical")
    row = to_json(fp8)
    assert row["precision"] == "fp8" and set(row["wire_bytes_by_precision"]) == {"fp8", "scales", "raw", "other"}
    with pytest.raises(ValueError, match="unknown precision 'fp4'"):
        simulate_case(case, precision="fp4")


def test_simulate_reports_a_layout_fp8_cannot_take_in_its_row(capsys):
    r = simulate_case(KNOWN["qwen30-h100"], precision="fp8")
    assert r.figures is None and r.does_not_fit.startswith("FP8 does not fit this layout: tensor 'model.layers.0.mlp")
    assert to_json(r)["fits"] is False and to_json(r)["precision"] == "fp8"
    assert main(["simulate", "--cases", "qwen30-h100", "--precision", "fp8", "--png", ""]) == 0
    out = capsys.readouterr().out
    assert "FP8 does not fit this layout" in out and "cuts through" in out


def test_a_kimi_engine_that_does_not_fit_says_so_in_fp8():
    # the published training side (FSDP over 256 GPUs) takes a while to build: Megatron here, the inference
    # side as the row has it. 16 independent TP8 engines in FP8 still hold 130 GB a GPU
    case = replace(KNOWN["kimi-h100-engines"], train="tp1,ep32,pp4,dp2")
    r = simulate_case(case)
    assert r.figures is None and r.precision == "fp8"
    assert "inference rank" in r.does_not_fit and "130 GB of weights, a dgx-h100 GPU has 80 GB" in r.does_not_fit


def test_run_local_points_a_precision_plan_to_run_local_precision():
    spec = rs.TensorSpec("mlp.up_proj.weight", (256, 256), torch.bfloat16)
    src = rs.Layout.from_placements(spec, [0, 1, 2], (3,), [rs.Shard(0)])  # uneven: both paths
    dst = rs.Layout.from_placements(spec, [3, 4], (2,), [rs.Shard(1)])
    plan = precision_plan(src, dst, "fp8")
    full = {spec.name: torch.randn(spec.shape).to(spec.dtype)}
    out = {r: plan.destination.empty_buffers(r) for r in plan.destination.ranks}
    sources = {r: src.materialize(r, full) for r in src.ranks}
    with pytest.raises(TypeError, match="run_local_precision"):
        run_local(plan, sources, out)
    rs.run_local_precision(plan, sources, out)
    q, s = quantize_blocks(full[spec.name])
    assert torch.equal(out[3][spec.name].view(torch.uint8), q[:, :128].view(torch.uint8))
    assert torch.equal(out[4][spec.name + "_scale_inv"], s[:, 1:])
