"""Architectures of the model families reshard knows, and their logical tensors.

An :class:`Arch` holds the handful of config values that decide every weight's
name and shape; :func:`model_specs` lists the tensors as Hugging Face checkpoints
name them (``[out_features, in_features]`` for linear layers). Presets are built
from the published ``config.json`` values; nothing is downloaded.

Families and what differs::

    family        attention           MLP                                   extras
    llama         GQA q/k/v/o         gate/up/down
    qwen3         GQA + q/k norms     gate/up/down
    qwen3_moe     GQA + q/k norms     router + E experts (gate/up/down)
    deepseek_v3   MLA (low-rank q,kv) first k layers dense, then router      MTP layers
                                      (+ score bias) + E experts + shared
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass, replace
from typing import Mapping, NamedTuple

import torch

from ..gc_pause import without_gc
from ..tensors import LayoutError, TensorSpec

FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3")


@dataclass(frozen=True)
class Arch:
    """Config values that decide a model's tensors (names follow HF ``config.json``)."""

    family: str
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tie_embeddings: bool = False
    dtype: torch.dtype = torch.bfloat16
    # mixture of experts
    experts: int = 0
    moe_intermediate: int = 0
    shared_experts: int = 0
    first_dense_layers: int = 0
    # multi-head latent attention (DeepSeek-V3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise LayoutError(f"unknown model family {self.family!r}; known: {', '.join(FAMILIES)}")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_mla(self) -> bool:
        return self.family == "deepseek_v3"

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_dense_layers

    def with_overrides(self, **kw) -> "Arch":
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    @property
    def num_params(self) -> int:
        return sum(s.numel for s in model_specs(self))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in model_specs(self))


def _deepseek(**kw) -> Arch:
    base = dict(family="deepseek_v3", hidden=7168, layers=61, vocab=129280, heads=128, kv_heads=128, head_dim=192,
                intermediate=18432, experts=256, moe_intermediate=2048, shared_experts=1, first_dense_layers=3,
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    base.update(kw)
    return Arch(**base)


PRESETS: dict[str, Arch] = {
    "qwen3-0.6b": Arch("qwen3", 1024, 28, 151936, 16, 8, 128, 3072, tie_embeddings=True),
    # Qwen3-0.6B with an untied LM head (0.75 B parameters, 1.5 GB in bf16): the model of `reshard demo`
    "qwen3-0.6b-untied": Arch("qwen3", 1024, 28, 151936, 16, 8, 128, 3072),
    "qwen3-8b": Arch("qwen3", 4096, 36, 151936, 32, 8, 128, 12288),
    "qwen3-32b": Arch("qwen3", 5120, 64, 151936, 64, 8, 128, 25600),
    "qwen3-30b-a3b": Arch("qwen3_moe", 2048, 48, 151936, 32, 4, 128, 6144, experts=128, moe_intermediate=768),
    "qwen3-235b-a22b": Arch("qwen3_moe", 4096, 94, 151936, 64, 4, 128, 12288, experts=128, moe_intermediate=1536),
    "deepseek-v3": _deepseek(),
    "deepseek-v3-mtp": _deepseek(mtp_layers=1),
    "kimi-k2": _deepseek(heads=64, kv_heads=64, vocab=163840, experts=384, first_dense_layers=1),
    # not a published model: Kimi-K2's architecture with 1024 experts of 1792, sized to the 2.4 T-parameter
    # BF16 MoE whose refit at 1024 + 1024 GPUs has been reported (the scale-up row of `reshard simulate`)
    "moe-2.4t": _deepseek(heads=64, kv_heads=64, vocab=163840, experts=1024, moe_intermediate=1792,
                          first_dense_layers=1),
    "llama-3-8b": Arch("llama", 4096, 32, 128256, 32, 8, 128, 14336),
    "llama-3-70b": Arch("llama", 8192, 80, 128256, 64, 8, 128, 28672),
}


DEMO_MODEL = "qwen3-0.6b-untied"
"""The preset ``reshard demo`` refits unless given ``--model``."""


def get_arch(name: str | Arch) -> Arch:
    """A preset by name (``deepseek-v3``, ``qwen3-30b-a3b``, ...); an :class:`Arch` is returned as is."""
    if isinstance(name, Arch):
        return name
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise LayoutError(f"unknown model {name!r}; known: {', '.join(PRESETS)}") from None


def tiny_arch(a: Arch | str) -> Arch:
    """A small random model of ``a``'s family that refits in seconds on a laptop.

    Keeps what decides the layouts' structure: the family (GQA with q/k norms, MoE with a
    router and experts, DeepSeek's MLA with low-rank q/kv, dense first layers, shared
    experts, MTP layers), tied or untied embeddings, the dtype. Sizes are chosen so that
    TP, EP and ETP up to 4 divide what they split (8 heads, 4 KV heads, 8 experts) and the
    vocabulary (1000) is padded by both Megatron and vLLM.

    >>> t = tiny_arch("deepseek-v3")
    >>> t.family, t.hidden, t.layers, t.experts, t.first_dense_layers
    ('deepseek_v3', 64, 3, 8, 1)
    """
    a = get_arch(a)
    kw: dict = dict(hidden=64, layers=2, vocab=1000, heads=8, kv_heads=4, head_dim=16, intermediate=128)
    if a.is_moe:
        kw.update(experts=8, moe_intermediate=32, shared_experts=min(a.shared_experts, 1),
                  first_dense_layers=min(a.first_dense_layers, 1))
        kw["layers"] = 2 + kw["first_dense_layers"]
    if a.is_mla:
        kw.update(kv_heads=8, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=24, v_head_dim=16,
                  kv_lora_rank=32, q_lora_rank=None if a.q_lora_rank is None else 32)
    return replace(a, **kw)


_MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3",
                "kimi_k2": "deepseek_v3"}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def from_hf_config(config: Mapping) -> Arch:
    """An :class:`Arch` from a Hugging Face ``config.json`` dict of a known family."""
    cfg = dict(config)
    model_type = cfg.get("model_type")
    family = _MODEL_TYPES.get(model_type)
    if family is None:
        raise LayoutError(f"unsupported model_type {model_type!r}; supported: {', '.join(_MODEL_TYPES)}")
    heads = cfg["num_attention_heads"]
    kw = dict(
        family=family, hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], vocab=cfg["vocab_size"],
        heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, intermediate=cfg.get("intermediate_size", 0),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), torch.bfloat16),
    )
    if family == "qwen3_moe":
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise LayoutError("qwen3_moe configs with mlp_only_layers or decoder_sparse_step != 1 are not supported")
        # transformers 5 writes num_local_experts; Qwen3-MoE checkpoints on the Hub say num_experts
        kw.update(experts=cfg.get("num_experts") or cfg["num_local_experts"], moe_intermediate=cfg["moe_intermediate_size"])
    if family == "deepseek_v3":
        kw.update(
            experts=cfg["n_routed_experts"], moe_intermediate=cfg["moe_intermediate_size"],
            shared_experts=cfg.get("n_shared_experts") or 0, first_dense_layers=cfg.get("first_k_dense_replace", 0),
            q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"], mtp_layers=cfg.get("num_nextn_predict_layers", 0) or 0,
            head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
        )
    return Arch(**kw)


def to_hf_config(arch: Arch) -> dict:
    """The ``config.json`` fields of ``arch`` (enough for :func:`from_hf_config` and for building
    small random models with transformers)."""
    d = asdict(arch)
    cfg = {
        "model_type": arch.family, "hidden_size": arch.hidden, "num_hidden_layers": arch.layers,
        "vocab_size": arch.vocab, "num_attention_heads": arch.heads, "num_key_value_heads": arch.kv_heads,
        "head_dim": arch.head_dim, "intermediate_size": arch.intermediate,
        "tie_word_embeddings": arch.tie_embeddings, "torch_dtype": str(d["dtype"]).removeprefix("torch."),
    }
    if arch.family == "qwen3_moe":  # routing top-k does not change tensors; keep it valid for tiny models
        cfg.update(num_experts=arch.experts, moe_intermediate_size=arch.moe_intermediate,
                   num_experts_per_tok=min(8, arch.experts))
    if arch.family == "deepseek_v3":  # transformers reads head_dim as the rotary part of a q/k head
        cfg.update(head_dim=arch.qk_rope_head_dim, num_experts_per_tok=min(8, arch.experts),
                   n_group=1, topk_group=1, n_routed_experts=arch.experts, moe_intermediate_size=arch.moe_intermediate,
                   n_shared_experts=arch.shared_experts, first_k_dense_replace=arch.first_dense_layers,
                   q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank,
                   qk_nope_head_dim=arch.qk_nope_head_dim, qk_rope_head_dim=arch.qk_rope_head_dim,
                   v_head_dim=arch.v_head_dim, num_nextn_predict_layers=arch.mtp_layers)
    return cfg


def _attention(a: Arch, p: str) -> list[tuple[str, tuple[int, ...]]]:
    if a.is_mla:
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        out = []
        if a.q_lora_rank:
            out += [(p + "self_attn.q_a_proj.weight", (a.q_lora_rank, a.hidden)),
                    (p + "self_attn.q_a_layernorm.weight", (a.q_lora_rank,)),
                    (p + "self_attn.q_b_proj.weight", (a.heads * qk, a.q_lora_rank))]
        else:
            out += [(p + "self_attn.q_proj.weight", (a.heads * qk, a.hidden))]
        return out + [
            (p + "self_attn.kv_a_proj_with_mqa.weight", (a.kv_lora_rank + a.qk_rope_head_dim, a.hidden)),
            (p + "self_attn.kv_a_layernorm.weight", (a.kv_lora_rank,)),
            (p + "self_attn.kv_b_proj.weight", (a.heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)),
            (p + "self_attn.o_proj.weight", (a.hidden, a.heads * a.v_head_dim)),
        ]
    out = [
        (p + "self_attn.q_proj.weight", (a.heads * a.head_dim, a.hidden)),
        (p + "self_attn.k_proj.weight", (a.kv_heads * a.head_dim, a.hidden)),
        (p + "self_attn.v_proj.weight", (a.kv_heads * a.head_dim, a.hidden)),
        (p + "self_attn.o_proj.weight", (a.hidden, a.heads * a.head_dim)),
    ]
    if a.family in ("qwen3", "qwen3_moe"):
        out += [(p + "self_attn.q_norm.weight", (a.head_dim,)), (p + "self_attn.k_norm.weight", (a.head_dim,))]
    return out


def _mlp(prefix: str, hidden: int, inter: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(prefix + "gate_proj.weight", (inter, hidden)), (prefix + "up_proj.weight", (inter, hidden)),
            (prefix + "down_proj.weight", (hidden, inter))]


def _layer(a: Arch, i: int) -> list[tuple[str, tuple[int, ...]]]:
    p = f"model.layers.{i}."
    out = [(p + "input_layernorm.weight", (a.hidden,))] + _attention(a, p)
    out.append((p + "post_attention_layernorm.weight", (a.hidden,)))
    if not a.is_moe_layer(i):
        return out + _mlp(p + "mlp.", a.hidden, a.intermediate)
    out.append((p + "mlp.gate.weight", (a.experts, a.hidden)))
    if a.is_mla:
        out.append((p + "mlp.gate.e_score_correction_bias", (a.experts,)))
    for e in range(a.experts):
        out += _mlp(f"{p}mlp.experts.{e}.", a.hidden, a.moe_intermediate)
    if a.shared_experts:
        out += _mlp(p + "mlp.shared_experts.", a.hidden, a.shared_experts * a.moe_intermediate)
    return out


def model_specs(a: Arch) -> list[TensorSpec]:
    """Every logical tensor of ``a``, in checkpoint order (embedding, layers, norm, head, MTP)."""
    return list(_specs(a))


@functools.lru_cache(maxsize=4)
@without_gc
def _specs(a: Arch) -> tuple[TensorSpec, ...]:
    """Cached: a training and an inference layout of one model share the ~60 k specs."""
    named = [("model.embed_tokens.weight", (a.vocab, a.hidden))]
    for i in range(a.layers):
        named += _layer(a, i)
    named.append(("model.norm.weight", (a.hidden,)))
    if not a.tie_embeddings:
        named.append(("lm_head.weight", (a.vocab, a.hidden)))
    for j in range(a.mtp_layers):  # DeepSeek-V3 multi-token prediction: an extra decoder layer and its heads
        i = a.layers + j
        p = f"model.layers.{i}."
        named += [(p + "enorm.weight", (a.hidden,)), (p + "hnorm.weight", (a.hidden,)),
                  (p + "eh_proj.weight", (a.hidden, 2 * a.hidden)), (p + "embed_tokens.weight", (a.vocab, a.hidden)),
                  (p + "shared_head.norm.weight", (a.hidden,)), (p + "shared_head.head.weight", (a.vocab, a.hidden))]
        named += _layer(a, i)
    fp32 = (".e_score_correction_bias",)
    checked: dict[tuple, TensorSpec] = {}  # (shape, dtype) -> the first spec of it, checked when made

    def spec(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorSpec:
        first = checked.get((shape, dtype))
        if first is None:
            first = checked[(shape, dtype)] = TensorSpec(name, shape, dtype)
            return first
        return first.renamed(name)

    return tuple(spec(n, s, torch.float32 if n.endswith(fp32) else a.dtype) for n, s in named)


CATEGORIES = ("attention", "dense_mlp", "experts", "embeddings", "norms", "router")


def category(name: str) -> str:
    """Which part of the model a tensor belongs to, for byte accounting."""
    if ".experts." in name or ".shared_experts." in name:
        return "experts"
    if name.endswith(("norm.weight", "layernorm.weight")) or ".enorm." in name or ".hnorm." in name:
        return "norms"
    if ".mlp.gate." in name:
        return "router"
    if "embed_tokens" in name or name.endswith("head.weight"):
        return "embeddings"
    if ".self_attn." in name or ".eh_proj." in name:
        return "attention"
    return "dense_mlp"


_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")


class Segment(NamedTuple):
    """Where a logical tensor sits in a (full) parameter: element ``lead`` of the leading dims,
    starting at ``offsets`` in the trailing dims, which it fills with its shape."""

    tensor: str
    lead: tuple[int, ...]
    offsets: tuple[int, ...]


def named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and persistent buffers (DeepSeek's ``e_score_correction_bias``), by
    ``state_dict`` name."""
    persistent = set(module.state_dict().keys())
    return list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers() if n in persistent]


def parameter_segments(name: str, shape: tuple[int, ...], dtype: torch.dtype, *, checkpoint_names: bool = True
                       ) -> list[tuple[TensorSpec, Segment]]:
    """The logical tensors a parameter of full ``shape`` holds, and where.

    transformers 5 fuses each layer's experts into ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate
    rows, then up) and ``mlp.experts.down_proj [E, H, I]``; with ``checkpoint_names`` they are
    split back into the checkpoint's ``mlp.experts.{e}.gate_proj.weight [I, H]`` and so on, the
    names :func:`model_specs` and every layout use. Any other parameter holds itself.

    >>> import torch
    >>> [(s.name, s.shape, g.lead, g.offsets) for s, g in parameter_segments(
    ...     "model.layers.0.mlp.experts.gate_up_proj", (2, 6, 4), torch.float32)][:2]
    [('model.layers.0.mlp.experts.0.gate_proj.weight', (3, 4), (0,), (0, 0)), \
('model.layers.0.mlp.experts.0.up_proj.weight', (3, 4), (0,), (3, 0))]
    """
    shape = tuple(int(n) for n in shape)
    m = _FUSED_EXPERTS.fullmatch(name) if checkpoint_names and len(shape) == 3 else None
    if m is None:
        return [(TensorSpec(name, shape, dtype), Segment(name, (), (0,) * len(shape)))]
    base, kind = m.groups()
    out = []
    for e in range(shape[0]):
        if kind == "gate_up_proj":
            rows = shape[1] // 2
            for j, proj in enumerate(("gate_proj", "up_proj")):
                spec = TensorSpec(f"{base}.{e}.{proj}.weight", (rows, shape[2]), dtype)
                out.append((spec, Segment(spec.name, (e,), (j * rows, 0))))
        else:
            spec = TensorSpec(f"{base}.{e}.down_proj.weight", shape[1:], dtype)
            out.append((spec, Segment(spec.name, (e,), (0, 0))))
    return out


def from_module(module: torch.nn.Module, *, checkpoint_names: bool = True) -> list[TensorSpec]:
    """The logical tensors of a live module: its parameters (full shapes of DTensors) and persistent
    buffers, by ``state_dict`` name, fused experts split back into checkpoint names (see
    :func:`parameter_segments`)."""
    return [spec for name, t in named_tensors(module)
            for spec, _ in parameter_segments(name, tuple(t.shape), t.dtype, checkpoint_names=checkpoint_names)]
