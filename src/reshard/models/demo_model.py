"""The demo's transformer, as pure data: its tensors, a training layout and an inference layout.

The default config is shaped like Qwen3-0.6B with an untied LM head (about 0.75 B
parameters, 1.5 GB in bf16). Tensor names follow Hugging Face checkpoints; weights
are ``[out_features, in_features]`` as ``nn.Linear`` stores them.

Training side (FSDP2): every tensor is ``Shard(0)`` over the M source ranks with the
``"chunk"`` split rule (``torch.chunk``: trailing ranks may get short or empty shards).

Inference side (vLLM-style tensor parallelism, ``dp`` replicas of ``tp`` ranks each,
mesh ``(dp, tp)``, replica ``i`` = ranks ``i*tp .. i*tp+tp-1`` of the destination list)::

    tensor                                    placements on (dp, tp)        kind
    embed_tokens, lm_head                     [Replicate(), Shard(0)]       vocab-parallel rows
    q/k/v_proj, gate/up_proj                  [Replicate(), Shard(0)]       column-parallel
    o_proj, down_proj                         [Replicate(), Shard(1)]       row-parallel
    q_norm, k_norm, *_layernorm, model.norm   [Replicate(), Replicate()]    replicated

TP uses the ``"even"`` split rule, and :func:`check_tp` rejects a ``tp`` that does not
divide the head counts, the intermediate size or the vocabulary, as vLLM would.
Nothing here touches a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch

from ..layout import Layout
from ..placements import Replicate, Shard
from ..tensors import LayoutError, TensorSpec

COLUMN, ROW, REPLICATED = "column", "row", "replicated"


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a Qwen3-style decoder (defaults: Qwen3-0.6B with an untied LM head)."""

    layers: int = 28
    hidden: int = 1024
    intermediate: int = 3072
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151936
    dtype: torch.dtype = torch.bfloat16
    tie_embeddings: bool = False

    def with_overrides(self, **overrides) -> "ModelConfig":
        """A copy with the given fields changed; ``None`` values are ignored."""
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown model config fields {sorted(unknown)}; known: {sorted(known)}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def num_params(self) -> int:
        return sum(s.numel for s in model_specs(self))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in model_specs(self))


QWEN3_0_6B = ModelConfig()


def model_specs(cfg: ModelConfig = QWEN3_0_6B) -> list[TensorSpec]:
    """Every logical tensor of the model, in checkpoint order."""
    h, q, kv, i, dt = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.intermediate, cfg.dtype
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab, h), dt)]
    for n in range(cfg.layers):
        p = f"model.layers.{n}."
        specs += [
            TensorSpec(p + "self_attn.q_proj.weight", (q, h), dt),
            TensorSpec(p + "self_attn.k_proj.weight", (kv, h), dt),
            TensorSpec(p + "self_attn.v_proj.weight", (kv, h), dt),
            TensorSpec(p + "self_attn.o_proj.weight", (h, q), dt),
            TensorSpec(p + "self_attn.q_norm.weight", (cfg.head_dim,), dt),
            TensorSpec(p + "self_attn.k_norm.weight", (cfg.head_dim,), dt),
            TensorSpec(p + "mlp.gate_proj.weight", (i, h), dt),
            TensorSpec(p + "mlp.up_proj.weight", (i, h), dt),
            TensorSpec(p + "mlp.down_proj.weight", (h, i), dt),
            TensorSpec(p + "input_layernorm.weight", (h,), dt),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), dt),
        ]
    specs.append(TensorSpec("model.norm.weight", (h,), dt))
    if not cfg.tie_embeddings:
        specs.append(TensorSpec("lm_head.weight", (cfg.vocab, h), dt))
    return specs


def tp_kind(name: str) -> str:
    """``"column"`` (Shard(0) over TP), ``"row"`` (Shard(1)) or ``"replicated"`` for a tensor name."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return ROW
    if name.endswith(("norm.weight", "layernorm.weight")):
        return REPLICATED
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
                      "embed_tokens.weight", "lm_head.weight")):
        return COLUMN
    raise LayoutError(f"tensor {name!r}: no tensor-parallel rule for it in the demo model")


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise ``LayoutError`` unless ``tp`` divides everything tensor parallelism splits."""
    if tp < 1:
        raise LayoutError(f"tensor parallel size must be >= 1, got {tp}")
    sizes = {"attention heads": cfg.heads, "kv heads": cfg.kv_heads, "intermediate size": cfg.intermediate,
             "vocabulary": cfg.vocab}
    bad = [f"{what} ({n})" for what, n in sizes.items() if n % tp]
    if bad:
        raise LayoutError(f"tensor parallel size {tp} does not divide the model's {', '.join(bad)}; "
                          f"pick a tp that divides all of them")


def training_layout(specs: Sequence[TensorSpec], ranks: Sequence[int], split: str = "chunk",
                    dtype: torch.dtype | None = None) -> Layout:
    """FSDP2-style: every tensor ``Shard(0)`` over ``ranks`` (``split="chunk"`` as FSDP2 does).

    ``dtype`` overrides the buffers' dtype (e.g. fp32 master weights of a bf16 model).
    """
    ranks = list(ranks)
    return Layout.merge(Layout.from_placements(s, ranks, (len(ranks),), [Shard(0)], split, dtype=dtype)
                        for s in specs)


def inference_layout(specs: Sequence[TensorSpec], ranks: Sequence[int], tp: int, dp: int = 1,
                     dtype: torch.dtype | None = None) -> Layout:
    """Tensor parallel over ``tp`` consecutive ranks, ``dp`` replicas (see module doc).

    ``ranks`` lists the ``tp * dp`` destination ranks; ``dtype`` overrides the buffers'
    dtype (e.g. bf16 inference weights from fp32 training weights).
    """
    ranks = list(ranks)
    if len(ranks) != tp * dp:
        raise LayoutError(f"inference layout: {len(ranks)} ranks given for tp={tp} x dp={dp}")
    pl = {COLUMN: [Replicate(), Shard(0)], ROW: [Replicate(), Shard(1)], REPLICATED: [Replicate(), Replicate()]}
    return Layout.merge(Layout.from_placements(s, ranks, (dp, tp), pl[tp_kind(s.name)], "even", dtype=dtype)
                        for s in specs)


@dataclass(frozen=True)
class DemoLayouts:
    specs: list[TensorSpec]
    source: Layout
    destination: Layout
    source_ranks: list[int]
    destination_ranks: list[int]

    @property
    def world_size(self) -> int:
        return max(self.source_ranks + self.destination_ranks) + 1


def demo_layouts(cfg: ModelConfig, sources: int, tp: int, dp: int = 1, *, colocate: bool = False,
                 src_dtype: torch.dtype | None = None) -> DemoLayouts:
    """Training layout on ranks ``0..M-1``, inference layout on ``M..M+N-1`` (N = tp * dp),
    or on ``0..N-1`` with ``colocate=True`` (training and inference share ranks).

    Destination buffers have the model's dtype; ``src_dtype`` gives the source buffers
    another one (the executor casts on the sender).
    """
    if sources < 1 or dp < 1:
        raise LayoutError(f"need at least one source rank and one replica (got sources={sources}, dp={dp})")
    check_tp(cfg, tp)
    specs = model_specs(cfg)
    src_ranks = list(range(sources))
    first = 0 if colocate else sources
    dst_ranks = list(range(first, first + tp * dp))
    return DemoLayouts(specs, training_layout(specs, src_ranks, dtype=src_dtype),
                       inference_layout(specs, dst_ranks, tp, dp), src_ranks, dst_ranks)
