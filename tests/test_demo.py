"""The demo path: model specs and layouts, test values and their checker, one real multi-process demo run."""

import re
from dataclasses import replace

import pytest
import torch

import reshard as rs
from reshard import verify
from reshard.apps.cli import build_parser, demo_config, main, model_from_args
from reshard.apps.demo import DemoConfig, failures, hybrid_line, preflight, run_demo
from reshard.errors import OptionsError
from reshard.execution.methods import GATHER_BROADCAST, HIERARCHICAL, HYBRID, RESHARD, method_plan
from reshard.frameworks.parallel import model_layouts
from reshard.models import DEMO_MODEL, Arch, get_arch, model_specs

TINY = Arch("qwen3", layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=256)


def demo_layouts(arch, sources, tp, dp=1, **kw):
    """The built-in demo's sides: FSDP2 over ``sources`` ranks, ``dp`` torch tensor-parallel replicas of ``tp``."""
    return model_layouts(arch, f"fsdp:dp{sources}", f"dtensor:tp{tp},dp{dp}", **kw)


def test_default_model_is_qwen3_0_6b_sized():
    arch = get_arch(DEMO_MODEL)
    specs = {s.name: s for s in model_specs(arch)}
    assert len(specs) == 1 + 28 * 11 + 2
    assert specs["model.layers.0.self_attn.q_proj.weight"].shape == (2048, 1024)
    assert specs["model.layers.27.self_attn.k_proj.weight"].shape == (1024, 1024)
    assert specs["model.layers.3.mlp.down_proj.weight"].shape == (1024, 3072)
    assert specs["lm_head.weight"].shape == (151936, 1024)
    assert all(s.dtype == torch.bfloat16 for s in specs.values())
    assert 0.7e9 < arch.num_params < 0.8e9 and not arch.tie_embeddings


def test_inference_layout_is_tensor_parallel_with_replicas():
    lay = demo_layouts(TINY, sources=3, tp=2, dp=2)
    assert lay.source_ranks == [0, 1, 2] and lay.destination_ranks == [3, 4, 5, 6]
    dst = lay.destination

    def box(rank, name):
        (p,) = [p for p in dst.pieces(rank) if p.tensor == name]
        return p.offsets, p.sizes

    q, o = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    assert box(3, q) == ((0, 0), (32, 64)) and box(4, q) == ((32, 0), (32, 64))  # column-parallel
    assert box(3, o) == ((0, 0), (64, 32)) and box(4, o) == ((0, 32), (64, 32))  # row-parallel
    assert box(5, q) == box(3, q) and box(6, o) == box(4, o)  # second replica
    assert box(4, "model.norm.weight") == ((0,), (64,))  # replicated
    src = lay.source  # FSDP2: Shard(0), torch.chunk split of 256 vocab rows over 3 ranks
    assert [p.sizes for p in src.pieces(2) if p.tensor == "lm_head.weight"] == [(84, 64)]


def test_tp_must_divide_heads():
    with pytest.raises(rs.LayoutError, match="tensor parallel size 3 does not divide"):
        demo_layouts(TINY, sources=2, tp=3)


def test_values_are_deterministic_and_box_consistent():
    shape = (10, 7, 3)
    full = verify.values("w", shape, (0, 0, 0), shape, torch.bfloat16, seed=1)
    sub = verify.values("w", shape, (2, 3, 1), (5, 4, 2), torch.bfloat16, seed=1)
    assert torch.equal(sub, full[2:7, 3:7, 1:3])
    assert not torch.equal(full, verify.values("w", shape, (0, 0, 0), shape, torch.bfloat16, seed=2))
    assert not torch.equal(full, verify.values("v", shape, (0, 0, 0), shape, torch.bfloat16, seed=1))
    a = full.float().abs()
    assert ((a >= 2 ** -7) & (a < 2 ** -3)).all()
    # defined in the logical dtype, then cast: fp32 source values cast to bf16 are the bf16 expectations
    f32 = verify.values("w", shape, (0, 0, 0), shape, torch.float32, seed=1)
    assert torch.equal(verify.values("w", shape, (0, 0, 0), shape, torch.bfloat16, seed=1,
                                     logical_dtype=torch.float32), f32.to(torch.bfloat16))


def test_fill_then_run_local_checks_clean_with_cast():
    lay = demo_layouts(TINY, sources=2, tp=2, dp=2, source_dtype=torch.float32)
    plan = rs.plan(lay.source, lay.destination, max_bucket_bytes=4096)
    src = {r: verify.fill_source(lay.source, r) for r in lay.source_ranks}
    assert src[0]["model.embed_tokens.weight"].dtype == torch.float32
    dst = {r: lay.destination.empty_buffers(r) for r in lay.destination_ranks}
    rs.run_local(plan, src, dst)
    for r in lay.destination_ranks:
        assert verify.check_destination(lay.destination, r, dst[r]) == []


def test_check_destination_names_one_flipped_element():
    lay = demo_layouts(TINY, sources=2, tp=2)
    rank = lay.destination_ranks[1]
    bufs = verify.fill(lay.destination, rank)
    assert verify.check_destination(lay.destination, rank, bufs) == []
    name = "model.layers.1.mlp.gate_proj.weight"
    bufs[name].view(torch.int16)[5, 7] ^= 1  # one bit of one element (rank 3 holds rows 64:128)
    (msg,) = verify.check_destination(lay.destination, rank, bufs)
    assert f"tensor {name!r} rank {rank}: box [64:128, 0:64]" in msg
    assert "1 of 4096 elements differ, within [69:70, 7:8]; first at (69, 7)" in msg


def test_check_destination_reports_missing_data_across_slabs(monkeypatch):
    monkeypatch.setattr(verify, "SLAB", 64)  # many slabs per piece
    lay = demo_layouts(TINY, sources=2, tp=2)
    rank = lay.destination_ranks[0]
    bufs = verify.fill(lay.destination, rank)
    bufs["model.embed_tokens.weight"][3, 60] = 0
    bufs["model.embed_tokens.weight"][100, 7] = 0
    (msg,) = verify.check_destination(lay.destination, rank, bufs)
    assert "'model.embed_tokens.weight' rank 2: box [0:128, 0:64]" in msg
    assert "2 of 8192 elements differ, within [3:101, 7:61]; first at (3, 60)" in msg


def test_cli_parses_every_option_and_scales_the_model():
    args = build_parser().parse_args(["demo", "--scale", "0.25", "--tp", "4", "--dp", "1", "--sources", "3"])
    cfg = model_from_args(args)
    assert cfg.layers == 7 and cfg.vocab % 256 == 0 and cfg.hidden == 1024
    args = build_parser().parse_args(["demo", "--layers", "3", "--vocab", "512", "--dtype", "fp32"])
    assert model_from_args(args) == get_arch(DEMO_MODEL).with_overrides(layers=3, vocab=512, dtype=torch.float32)
    assert main(["demo", "--tp", "3"]) == 2  # 16 heads do not divide by 3: refused before spawning


def test_cli_hybrid_method_and_its_rule():
    args = build_parser().parse_args(["demo", "--layers", "2", "--methods", "reshard,hybrid,gather-broadcast",
                                      "--hybrid-patterns", r"mlp\.,self_attn\.o_proj"])
    cfg = demo_config(args)
    assert cfg.methods == (RESHARD, HYBRID, GATHER_BROADCAST)
    assert cfg.hybrid_patterns == (r"mlp\.", r"self_attn\.o_proj")
    assert cfg.hybrid_rule("model.layers.0.self_attn.o_proj.weight") and not cfg.hybrid_rule("lm_head.weight")
    assert demo_config(build_parser().parse_args(["demo", "--methods", "hybrid", "--hybrid-patterns", ""])
                       ).hybrid_patterns == ()  # nothing by reshard: all by gather-broadcast
    assert main(["demo", "--hybrid-patterns", "experts"]) == 2  # without the hybrid method
    assert main(["demo", "--methods", "hybrid", "--hybrid-patterns", "(", "--layers", "1"]) == 2  # not a regex
    with pytest.raises(ValueError, match="add hybrid to the methods"):
        preflight(DemoConfig(model=TINY, train="fsdp:dp2", infer="dtensor:tp2", hybrid_patterns=("mlp",)))
    line = hybrid_line({"phases": ["transfer", "gather-broadcast"], "rule": "patterns:mlp", "reshard_tensors": 3,
                        "broadcast_tensors": 5, "part_bytes": {"reshard": 2e6, "gather": 1e6, "broadcast": 4e6}}, 10**8)
    assert line == ("hybrid (transfer -> gather-broadcast; rule patterns:mlp): 3 tensors by reshard (2.000 MB on the "
                    "wire), 5 by gather-broadcast (1.000 MB gathered, 4.000 MB broadcast)")


def test_each_method_gets_its_refit_options_checked_by_refit_options(capsys):
    cfg = DemoConfig(model=TINY, train="fsdp:dp2", infer="dtensor:tp2", methods=(RESHARD, HYBRID, HIERARCHICAL),
                     hybrid_patterns=("mlp",), max_bucket_bytes=1 << 20)
    domains = {0: 0, 1: 0, 2: 1, 3: 1}
    options = cfg.method_options(domains)
    assert list(options) == [RESHARD, HYBRID, HIERARCHICAL]
    assert all(o.method == m and o.max_bucket_bytes == 1 << 20 for m, o in options.items())
    assert options[HYBRID].hybrid_rule.patterns == ("mlp",) and options[RESHARD].hybrid_rule is None
    assert options[HIERARCHICAL].domains == domains and options[RESHARD].domains is options[HYBRID].domains is None
    for bad, culprit in [({"max_bucket_bytes": 10}, "max_bucket_bytes=10 is smaller than 16 bytes"),
                         ({"hybrid_patterns": "mlp"}, "give a list of regular expressions"),
                         ({"hybrid_patterns": ("(",)}, "'(' is not a regular expression")]:
        with pytest.raises(OptionsError, match=re.escape(culprit)):
            preflight(replace(cfg, **bad))
    # the same refusals from the command line name the flag
    assert main(["demo", "--max-bucket-mb", "1e-5", "--layers", "1"]) == 2
    assert capsys.readouterr().out.strip() == ("reshard demo: --max-bucket-mb 1e-05: max_bucket_bytes=10 is "
                                               "smaller than 16 bytes")
    assert main(["demo", "--methods", "hybrid", "--hybrid-patterns", "(", "--layers", "1"]) == 2
    assert capsys.readouterr().out.startswith("reshard demo: --hybrid-patterns: HybridRule pattern '(' is not")


@pytest.mark.slow
def test_demo_end_to_end_both_methods_bit_exact():
    cfg = DemoConfig(model=TINY, train="fsdp:dp3", infer="dtensor:tp2", max_bucket_bytes=16 << 10, progress=False)
    res = run_demo(cfg)
    assert failures(res) == []
    lay = cfg.layouts()
    plan = rs.plan(lay.source, lay.destination, max_bucket_bytes=cfg.max_bucket_bytes)
    assert res["plan"]["fingerprint"] == plan.fingerprint()
    assert res["methods"][RESHARD]["wire_bytes"] == plan.wire_bytes == res["plan"]["wire_bytes"]
    # the minimum: nothing is colocated, so each destination rank receives every element it holds
    held = sum(p.sizes[0] * (p.sizes[1] if len(p.sizes) > 1 else 1) * 2 for r in lay.destination_ranks
               for p in lay.destination.pieces(r))
    assert plan.wire_bytes == held
    gb = rs.gather_broadcast_bytes(plan)
    assert res["methods"][GATHER_BROADCAST]["wire_bytes"] == gb["gather"] + gb["broadcast"]
    assert res["plan"]["rounds"] > 1  # the 16 KiB cap forces several rounds
    # two rounds in flight, each under half the cap plus at most one copy
    assert res["methods"][RESHARD]["peak_staging_bytes"] <= cfg.max_bucket_bytes + 2 * res["plan"]["largest_copy_bytes"]


@pytest.mark.slow
def test_demo_named_model_megatron_moe_to_vllm_bit_exact():
    """A tiny random Qwen3-MoE: Megatron tp1,ep2 on ranks 0-1 -> vLLM tp2 on ranks 2-3, every executor
    but the hierarchical one (the hybrid: experts by reshard, the rest by gather-broadcast)."""
    cfg = DemoConfig(model="qwen3-30b-a3b", tiny=True, train="tp1,ep2", infer="tp2", max_bucket_bytes=64 << 10,
                     progress=False, methods=(RESHARD, HYBRID, GATHER_BROADCAST))
    arch = cfg.arch
    assert arch.family == "qwen3_moe" and arch.experts == 8 and arch.num_params < 1e6
    lay = cfg.layouts()
    assert lay.source_ranks == [0, 1] and lay.destination_ranks == [2, 3]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in {s.name for s in lay.specs}
    res = run_demo(cfg)
    assert failures(res) == []
    assert list(res["methods"]) == [RESHARD, HYBRID, GATHER_BROADCAST]
    plan = rs.plan(lay.source, lay.destination, max_bucket_bytes=cfg.max_bucket_bytes)
    assert res["plan"]["fingerprint"] == plan.fingerprint()
    assert res["methods"][RESHARD]["wire_bytes"] == plan.wire_bytes == res["plan"]["wire_bytes"]
    gb = rs.gather_broadcast_bytes(plan)
    assert res["methods"][GATHER_BROADCAST]["wire_bytes"] == gb["gather"] + gb["broadcast"]
    hy, h = res["methods"][HYBRID], method_plan(HYBRID, lay.source, lay.destination, max_bucket_bytes=64 << 10)
    assert hy["wire_bytes"] == h.wire_bytes and hy["part_bytes"] == h.part_bytes()
    assert plan.wire_bytes < h.wire_bytes < gb["gather"] + gb["broadcast"]
    assert hy["phases"] == ["transfer", "gather-broadcast"] and hy["reshard_tensors"] == len(h.reshard_tensors) > 0
    assert all("experts" in n or "mlp" in n for n in h.reshard_tensors)
    c = res["config"]
    assert (c["model"], c["train"], c["infer"], c["sources"], c["destinations"]) == \
        ("tiny qwen3-30b-a3b", "megatron tp1,ep2", "vllm tp2", 2, 2)
    assert main(["demo", "--model", "qwen3-30b-a3b", "--tp", "2"]) == 2  # ranks come from --train/--infer
    assert main(["demo", "--train", "tp2"]) == 2  # --train needs --model


def test_hierarchical_method_crosses_domains_once_per_replica_set():
    """2 data-parallel replicas of TP 2 in one pretend NVLink domain: the hierarchical refit takes
    each byte into the domain once (half of what the direct plan sends across), bit-exact."""
    from reshard.apps.demo import demo_domains
    from reshard.planning.hierarchy import domain_need_bytes

    cfg = DemoConfig(model=TINY, train="fsdp:dp2", infer="dtensor:tp2,dp2", methods=(RESHARD, HIERARCHICAL),
                     progress=False, max_bucket_bytes=1 << 14)
    assert demo_domains(cfg.layouts(), 0) == {0: 0, 1: 0, 2: 1, 3: 1, 4: 1, 5: 1}
    result = run_demo(cfg)
    assert failures(result) == []
    h, direct = result["methods"][HIERARCHICAL], result["methods"][RESHARD]
    need = domain_need_bytes(cfg.layouts().destination, demo_domains(cfg.layouts(), 0))
    assert h["cross_domain_bytes"] == need[1]  # every distinct box the domain holds, once
    # the direct plan sends each replica its own copy: twice for the DP-replicated boxes, four times
    # for the norms every rank holds
    assert 2 * h["cross_domain_bytes"] <= direct["cross_domain_bytes"] == direct["wire_bytes"]
    assert h["wire_bytes"] == direct["wire_bytes"]  # the rest moves inside the domain
    assert h["phases"] == ["network", "NVLink forward"]


def test_demo_named_model_colocated_with_fp32_training_weights():
    """Megatron fp32 master weights and vLLM bf16 weights on the same two ranks: most bytes copy
    locally (cast on the way), the rest cross; every destination byte checked."""
    cfg = DemoConfig(model="qwen3-8b", tiny=True, train="tp2", infer="tp1,dp2", colocate=True,
                     source_dtype=torch.float32, progress=False)
    lay = cfg.layouts()
    assert lay.source_ranks == lay.destination_ranks == [0, 1]
    assert {dt for r in lay.source_ranks for _, dt in lay.source.buffers(r).values()} == {torch.float32}
    res = run_demo(cfg)
    assert failures(res) == [] and res["config"]["colocate"]
    plan = rs.plan(lay.source, lay.destination)
    assert 0 < res["methods"][RESHARD]["wire_bytes"] == plan.wire_bytes < plan.wire_bytes + plan.local_bytes
