"""Tiny architectures of every family, shared by the vLLM layout and loader tests."""

import torch

from reshard.models import Arch

_BASE = {
    "llama": dict(hidden=32, layers=2, vocab=130, heads=4, kv_heads=2, head_dim=8, intermediate=48),
    "qwen3": dict(hidden=32, layers=2, vocab=130, heads=4, kv_heads=2, head_dim=8, intermediate=48),
    "qwen3_moe": dict(hidden=32, layers=2, vocab=130, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                      experts=5, moe_intermediate=24),
    "deepseek_v3": dict(hidden=32, layers=3, vocab=130, heads=4, kv_heads=4, head_dim=12, intermediate=48,
                        experts=5, moe_intermediate=16, shared_experts=1, first_dense_layers=1, q_lora_rank=24,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
}


def tiny(family: str, **kw) -> Arch:
    """A few-kilobyte model of ``family`` (float32 unless ``dtype`` is given); ``kw`` overrides sizes."""
    base = dict(_BASE[family])
    base.update(kw)
    base.setdefault("dtype", torch.float32)
    return Arch(family, **base)
