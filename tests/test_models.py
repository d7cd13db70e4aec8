"""Model specs: tensor counts and parameter totals against the published model sizes."""

import pytest
import torch

import reshard as rs
from reshard.models import PRESETS, category, from_hf_config, from_module, get_arch, model_specs
from reshard.models.arch import to_hf_config

# Published totals (model cards / technical reports), in billions of parameters.
PUBLISHED_B = {
    "qwen3-0.6b": 0.596, "qwen3-8b": 8.19, "qwen3-32b": 32.8, "qwen3-30b-a3b": 30.5, "qwen3-235b-a22b": 235.1,
    "deepseek-v3": 671.0, "deepseek-v3-mtp": 685.0 - 0.5, "kimi-k2": 1026.4, "llama-3-8b": 8.03, "llama-3-70b": 70.55,
    "moe-2.4t": 2400.0,  # not published: sized to the reported 2.4 T-parameter MoE
    "qwen3-0.6b-untied": 0.596 + 151936 * 1024 / 1e9,  # not published: Qwen3-0.6B with its own LM head (the demo)
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_totals_match_published_sizes(name):
    total = sum(s.numel for s in model_specs(get_arch(name))) / 1e9
    assert total == pytest.approx(PUBLISHED_B[name], rel=0.01)


def test_deepseek_v3_structure():
    specs = {s.name: s for s in model_specs(get_arch("deepseek-v3"))}
    assert specs["model.layers.0.mlp.gate_proj.weight"].shape == (18432, 7168)  # first 3 layers dense
    assert "model.layers.2.mlp.gate.weight" not in specs
    assert specs["model.layers.3.mlp.gate.weight"].shape == (256, 7168)
    assert specs["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert specs["model.layers.60.mlp.experts.255.down_proj.weight"].shape == (7168, 2048)
    assert specs["model.layers.3.mlp.shared_experts.up_proj.weight"].shape == (2048, 7168)
    assert specs["model.layers.0.self_attn.kv_b_proj.weight"].shape == (128 * (128 + 128), 512)
    assert specs["model.layers.0.self_attn.q_b_proj.weight"].shape == (128 * 192, 1536)
    assert specs["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (512 + 64, 7168)
    experts = [n for n in specs if ".mlp.experts." in n]
    assert len(experts) == 58 * 256 * 3
    mtp = {s.name for s in model_specs(get_arch("deepseek-v3-mtp"))} - set(specs)
    assert "model.layers.61.eh_proj.weight" in mtp and "model.layers.61.mlp.experts.0.up_proj.weight" in mtp


def test_hf_config_round_trip_and_errors():
    for name, arch in PRESETS.items():
        assert from_hf_config(to_hf_config(arch)) == arch, name
    with pytest.raises(rs.LayoutError, match="unsupported model_type 'gpt2'"):
        from_hf_config({"model_type": "gpt2"})
    with pytest.raises(rs.LayoutError, match="unknown model 'nope'"):
        get_arch("nope")


def test_kimi_k2_config_is_read_as_deepseek_v3():
    cfg = to_hf_config(get_arch("kimi-k2")) | {"model_type": "kimi_k2"}
    arch = from_hf_config(cfg)
    assert arch.family == "deepseek_v3" and arch.experts == 384 and arch.first_dense_layers == 1


def test_categories():
    assert category("model.layers.3.mlp.experts.7.up_proj.weight") == "experts"
    assert category("model.layers.3.mlp.shared_experts.up_proj.weight") == "experts"
    assert category("model.layers.3.mlp.gate.weight") == "router"
    assert category("model.layers.3.mlp.gate_proj.weight") == "dense_mlp"
    assert category("model.layers.3.self_attn.q_norm.weight") == "norms"
    assert category("model.layers.3.self_attn.kv_b_proj.weight") == "attention"
    assert category("lm_head.weight") == "embeddings"
    assert category("model.embed_tokens.weight") == "embeddings"


def test_from_module_reads_named_parameters():
    m = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.LayerNorm(3))
    specs = from_module(m)
    assert [(s.name, s.shape) for s in specs] == [("0.weight", (3, 4)), ("1.weight", (3,)), ("1.bias", (3,))]
