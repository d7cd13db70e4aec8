"""Hugging Face transformers tensor parallelism (``tp_plan="auto"``) as reshard layouts.

``hf_layout(arch, ranks, tp, dp)`` is the destination layout of a refit into ``dp``
transformers models loaded with ``from_pretrained(path, tp_plan="auto")`` (in
transformers 5: ``distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp)``)
over ``tp`` ranks each: ``ranks[d * tp + t]`` is TP rank ``t`` (mesh coordinate ``t``
of the ``tp`` device mesh) of replica ``d``. Logical tensors keep their checkpoint
names (:func:`reshard.models.model_specs`); buffers are the model's parameters, by
``named_parameters`` name, shaped as each rank's local shard (``DTensor.to_local()``),
so a refit writes straight into them.

What transformers does (5.19.0; ``tests/test_hf_layouts.py`` loads small random models
over gloo and compares every local shard): the model's ``tp_plan`` (the config's
``base_model_tp_plan`` under ``model.``, plus ``{"lm_head": "colwise_gather_output"}``)
maps module name patterns to styles, and each style turns a planned parameter into a
DTensor on the 1-D ``tp`` mesh, split by ``torch.chunk`` rules. Parameters no rule
names stay plain tensors, whole on every rank::

    parameter                               style                  placement     rank t holds
    self_attn.{q,k,v}_proj.weight [O, H]    colwise                Shard(0)      rows chunk t of O
    self_attn.o_proj.weight, mlp.down_proj  rowwise                Shard(1)      columns chunk t
    mlp.{gate,up}_proj.weight (dense and    colwise                Shard(0)      rows chunk t
      DeepSeek shared_experts)
    mlp.experts.gate_up_proj [E, 2I, H]     packed_colwise         _StridedShard [gate_t ; up_t] of every
      (fused; expert e = [gate_e ; up_e])                          (1, sf=2)     expert: rows chunk t of I, twice
    mlp.experts.down_proj    [E, H, I]      rowwise                Shard(2)      columns chunk t of every expert
    lm_head.weight [V, H]                   colwise_gather_output  Shard(0)      rows t (V % tp == 0 required)
    model.embed_tokens.weight               none: plain, whole on every rank
      with tied embeddings (one parameter,  embedding_rowwise      Shard(0)      rows t (V % tp == 0 required,
      lm_head's too; one buffer)                                                 as for lm_head)
    norms, q_norm/k_norm, mlp.gate (router), DeepSeek MLA attention: plain, whole on every rank

Experts: transformers 5 fuses a checkpoint's per-expert ``experts.{e}.gate_proj.weight``
``[I, H]`` / ``up_proj`` / ``down_proj`` ``[H, I]`` into 3-D parameters at load time
(``conversion_mapping``: ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``), keeping
each expert's ``[out, in]`` orientation, so every logical expert tensor is a box of the
fused parameter at ``(e, row, 0)``: no transposition. A fused parameter stored transposed
(``[E, H, 2I]``, as transformers 5.19's Llama-4 and GPT-OSS experts are, families this module
does not lay out) cannot be expressed by pieces (a piece is copied box to box, never transposed):
:func:`check_hf_parameters` raises :class:`LayoutError` for it; pass the real shapes to
``hf_layout(..., param_shapes=...)`` to have it checked.

DeepSeek-V3's ``mlp.gate.e_score_correction_bias`` is a module buffer, not a parameter;
it is a buffer of the layout under its state-dict name, replicated and always float32
(``_keep_in_fp32_modules_strict``). Its multi-token-prediction layers are not part of
transformers' model (it ignores them when loading), so they are not in the layout.

Heads: ``colwise`` splits q/k/v rows by ``torch.chunk`` and transformers never replicates
KV heads, so with ``tp`` not dividing the heads or KV heads ranks hold fractions of a head:
the model loads but its attention cannot run; :func:`hf_layout` refuses that unless
``partial_heads=True``. Replicas: transformers' mesh is its whole world (``world_size ==
tp`` without FSDP/PP), so the ``dp`` replicas are separate deployments; here they are
numbered consecutively in the refit group.

Example: Qwen3-MoE, 4 experts, I = 24, tp=2: ``mlp.experts.gate_up_proj`` is
``[4, 24, H]`` on each rank; rank 1 holds rows 12:24 of every expert's ``gate_proj`` at
rows 0:12 and rows 12:24 of its ``up_proj`` at rows 12:24.

Everything here is pure data: no transformers import, no process group.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Mapping, NamedTuple, Sequence

import numpy as np
import torch

from ..gc_pause import without_gc
from ..layout import Layout, PieceTable
from ..models.arch import Arch, Segment, get_arch, model_specs
from ..placements import Placement, Replicate, Shard, StridedShard, check_ranks, local_runs
from ..tensors import LayoutError, TensorSpec

TRANSFORMERS_VERSION = "5.19.0"  # the version whose plans and parameter forms this module follows
# model.tp_plan of the causal-LM classes in transformers 5.19.0: the config's base_model_tp_plan
# prefixed with "model." and the *ForCausalLM class's _tp_plan. The slow test checks them against
# the installed transformers.
_DENSE = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}
_QK_NORM = {
    "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}
_EXPERTS = {
    "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "model.layers.*.mlp.experts.down_proj": "rowwise",
    "model.layers.*.mlp.experts": "moe_tp_experts",
}
TP_PLANS: dict[str, dict[str, str]] = {
    "llama": dict(_DENSE),
    "qwen3": {**_DENSE, **_QK_NORM},
    "qwen3_moe": {**_DENSE, **_QK_NORM, **_EXPERTS},
    "deepseek_v3": {
        **_EXPERTS,
        "model.layers.*.mlp.shared_experts.gate_proj": "colwise",
        "model.layers.*.mlp.shared_experts.up_proj": "colwise",
        "model.layers.*.mlp.shared_experts.down_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "colwise_gather_output",
    },
}

_COLWISE = frozenset({"colwise", "colwise_rep", "colwise_gather_output"})
_GATHERS_OUTPUT = frozenset({"colwise_rep", "colwise_gather_output"})
_ROWWISE = frozenset({"rowwise", "rowwise_rep", "rowwise_split_input", "embedding_rowwise"})
# styles that install forward hooks only: the parameters stay whole on every rank
_UNSHARDED = frozenset({"replicated_with_grad_allreduce", "moe_tp_experts", "all_reduce", "sequence_parallel",
                        "moe_identity_expert", "mla_kv_a_proj", "ep_router", "megamoe_router"})
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class HFParam(NamedTuple):
    """One parameter (or module buffer) of the transformers model, at its full (global) shape."""

    name: str  # named_parameters name (state-dict name for module buffers)
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]  # the logical tensors it holds
    plan_name: str  # the name the tp_plan is matched against
    embedding: bool  # held by an nn.Embedding (colwise/rowwise split other dims)
    dtype: torch.dtype | None = None  # fixed dtype whatever the model's (DeepSeek's fp32 router bias)


def hf_tp_plan(arch: Arch | str) -> dict[str, str]:
    """``model.tp_plan`` of ``arch``'s causal-LM model: :data:`TP_PLANS` of its family, plus
    ``{"model.embed_tokens": "embedding_rowwise"}`` with tied embeddings (transformers'
    ``PreTrainedConfig`` adds it), so the one shared parameter is split by vocab rows."""
    a = get_arch(arch)
    if a.family not in TP_PLANS:
        raise LayoutError(f"Hugging Face layout: no tensor-parallel plan for family {a.family!r}; "
                          f"supported: {', '.join(TP_PLANS)}")
    plan = dict(TP_PLANS[a.family])
    if a.tie_embeddings:
        plan["model.embed_tokens"] = "embedding_rowwise"
    return plan


def hf_parameters(arch: Arch | str) -> list[HFParam]:
    """The parameters of ``arch``'s transformers causal-LM model, full shapes, with the logical
    tensors each one holds (``named_parameters`` names; fused experts per layer)."""
    a = get_arch(arch)
    hf_tp_plan(a)  # a family transformers has a plan for
    params: dict[str, HFParam] = {}
    fused: dict[str, list[Segment]] = {}
    for spec in model_specs(a):
        name = spec.name
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= a.layers:
            continue  # DeepSeek multi-token-prediction layers: not part of transformers' model
        m = _EXPERT_RE.match(name)
        if m:
            prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
            inter = spec.shape[1] if which == "down_proj" else spec.shape[0]
            if which == "down_proj":
                pname, shape, off = f"{prefix}.down_proj", (a.experts, a.hidden, inter), (0, 0)
            else:
                pname, shape = f"{prefix}.gate_up_proj", (a.experts, 2 * inter, a.hidden)
                off = (0, 0) if which == "gate_proj" else (inter, 0)
            if pname not in params:
                params[pname] = HFParam(pname, shape, (), pname, False)
                fused[pname] = []
            fused[pname].append(Segment(name, (e,), off))
            continue
        dtype = torch.float32 if name.endswith(".e_score_correction_bias") else None
        params[name] = HFParam(name, spec.shape, (Segment(name, (), (0,) * len(spec.shape)),), name,
                               name.endswith("embed_tokens.weight"), dtype)
    return [p._replace(segments=tuple(fused[p.name])) if p.name in fused else p for p in params.values()]


def check_hf_parameters(arch: Arch | str, param_shapes: Mapping[str, Sequence[int]]) -> None:
    """Check a real model's full parameter shapes (``{name: p.shape for name, p in
    model.named_parameters()}``) against :func:`hf_parameters`; raise :class:`LayoutError` for a
    missing or unknown parameter, another shape, and, precisely, for a fused expert parameter
    stored transposed (``[E, H, 2I]``), which pieces cannot express. (When ``H == 2I`` a
    transposed form has the same shape and only a value check, as the tests do, tells.)"""
    mine = {p.name: p for p in hf_parameters(arch)}
    real = {n: tuple(int(s) for s in shape) for n, shape in param_shapes.items()}
    for name, shape in real.items():
        p = mine.get(name)
        if p is None:
            raise LayoutError(f"Hugging Face layout: the model has parameter {name!r} {shape} that the layout of "
                              f"this {get_arch(arch).family} architecture does not describe")
        if shape == p.shape:
            continue
        if len(shape) == 3 and shape == (p.shape[0], p.shape[2], p.shape[1]):
            raise LayoutError(
                f"Hugging Face layout: parameter {name!r} stores its experts transposed, {shape} instead of "
                f"{p.shape} ([experts, out, in]); a piece is copied without transposition, so this layout "
                f"cannot be expressed")
        raise LayoutError(f"Hugging Face layout: parameter {name!r} has shape {shape}, the layout expects {p.shape}")
    missing = [n for n, p in mine.items() if n not in real and p.dtype is None]  # module buffers are not parameters
    if missing:
        raise LayoutError(f"Hugging Face layout: the model lacks parameter(s) {missing[:3]}"
                          f"{' ...' if len(missing) > 3 else ''} that the layout expects")


def tp_style(plan: Mapping[str, str], name: str) -> str | None:
    """The style ``plan`` gives parameter ``name``: transformers' ``_get_parameter_plan`` (layer
    numbers become ``*``; the parameter's own name first, then its module's)."""
    generic = re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)
    if generic in plan:
        return plan[generic]
    if "." in generic and (module := generic.rsplit(".", 1)[0]) in plan:
        return plan[module]
    return None


def tp_placement(param: HFParam, style: str | None, tp: int) -> Placement:
    """The DTensor placement a style gives a parameter on the 1-D ``tp`` mesh (transformers'
    ``shard_param`` of each ``TensorParallelLayer``); raises for what transformers refuses."""
    n = len(param.shape)
    if tp == 1 or style is None or style in _UNSHARDED:
        return Replicate()  # with tp_size 1 transformers applies no plan at all
    if style in _COLWISE:
        dim = 1 if param.embedding else (n - 2) % n
        if style in _GATHERS_OUTPUT and param.shape[dim] % tp:
            raise LayoutError(f"Hugging Face layout: {param.plan_name.rsplit('.', 1)[0]!r} ({style}) needs its "
                              f"output size {param.shape[dim]} divisible by tp={tp} (transformers refuses it)")
        return Shard(dim)
    if style in _ROWWISE:
        if param.embedding:
            return Shard(0)
        return Replicate() if param.name.endswith(".bias") else Shard(n - 1)
    if style == "packed_colwise":
        return Shard(0) if n == 1 else StridedShard(n - 2, 2)
    if style == "packed_rowwise":
        return Replicate() if n == 1 else StridedShard(n - 1, 2)
    raise LayoutError(f"Hugging Face layout: parameter {param.name!r} has tensor-parallel style {style!r}, "
                      f"which this module does not know")


class _Geometry(NamedTuple):
    local_shapes: tuple[tuple[int, ...], ...]  # per mesh coordinate
    # per segment: mesh coordinates [k], offsets [k, nd], sizes [k, nd], buffer offsets [k, nb]
    pieces: tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]


@lru_cache(maxsize=1024)
def _geometry(shape: tuple[int, ...], placement: Placement, tp: int,
              segments: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]) -> _Geometry:
    """Pieces of each segment ``(lead, offsets, seg_shape)`` of a parameter of ``shape`` on each
    of ``tp`` mesh coordinates under ``placement`` (torch.chunk rules)."""
    runs_by_coord = local_runs(shape, (tp,), (placement,), "chunk")
    local_shapes = []
    per_seg: list[list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]] = [[] for _ in segments]
    for t in range(tp):
        runs = runs_by_coord[(t,)]
        local_shapes.append(tuple(sum(e - s for s, e in r) for r in runs))
        # per dim: (global start, end, local start) of each run
        located = []
        for r in runs:
            pos, items = 0, []
            for s, e in r:
                items.append((s, e, pos))
                pos += e - s
            located.append(items)
        for i, (lead, off, seg_shape) in enumerate(segments):
            nl = len(lead)
            lead_local = []
            for d, idx in enumerate(lead):
                hit = [ls + idx - s for s, e, ls in located[d] if s <= idx < e]
                if not hit:
                    break
                lead_local.append(hit[0])
            else:
                parts = [[]]
                for d, (o, size) in enumerate(zip(off, seg_shape)):
                    opts = []
                    for s, e, ls in located[nl + d]:
                        lo, hi = max(s, o), min(e, o + size)
                        if lo < hi:
                            opts.append((lo - o, hi - lo, ls + lo - s))
                    parts = [p + [c] for p in parts for c in opts]
                for combo in parts:
                    per_seg[i].append((t, tuple(c[0] for c in combo), tuple(c[1] for c in combo),
                                       tuple(lead_local) + tuple(c[2] for c in combo)))
    pieces = []
    for (lead, off, seg_shape), items in zip(segments, per_seg):
        nd, nb = len(seg_shape), len(lead) + len(seg_shape)
        pieces.append((np.array([c[0] for c in items], np.int64),
                       np.array([c[1] for c in items], np.int64).reshape(len(items), nd),
                       np.array([c[2] for c in items], np.int64).reshape(len(items), nd),
                       np.array([c[3] for c in items], np.int64).reshape(len(items), nb)))
    return _Geometry(tuple(local_shapes), tuple(pieces))


@without_gc
def hf_layout(arch: Arch | str, ranks: Sequence[int], tp: int, dp: int = 1, *, dtype: torch.dtype | None = None,
              param_shapes: Mapping[str, Sequence[int]] | None = None, partial_heads: bool = False,
              validate: bool | None = None) -> Layout:
    """The layout of ``arch``'s weights in ``dp`` transformers models loaded with
    ``tp_plan="auto"`` over ``tp`` ranks each (see module doc).

    ``ranks``: the inference side's global ranks, replica by replica (``len == tp * dp``);
    ``ranks[d * tp + t]`` is mesh coordinate ``t`` of replica ``d``.
    ``dtype``: the model's dtype (buffers; default the checkpoint's, ``arch.dtype``).
    ``param_shapes``: the real model's full parameter shapes, to check with
    :func:`check_hf_parameters` first (e.g. a transposed fused expert parameter).
    ``partial_heads``: allow ``tp`` not dividing the attention or KV heads. transformers
    loads such a model (``colwise`` splits rows by ``torch.chunk``, it never replicates KV
    heads), so ranks hold fractions of heads, but its attention cannot run (the forward
    fails reshaping ``k_proj``'s output); off by default, as a one-line error.
    ``validate``: run :meth:`Layout.validate` (default: only up to 100 k pieces).

    Raises :class:`LayoutError` for a family without a plan, a wrong number of ranks, or
    what transformers refuses (``lm_head``'s vocab not divisible by ``tp``).
    """
    a = get_arch(arch)
    ranks_arr = check_ranks(ranks, "Hugging Face layout", tp=tp, dp=dp)
    if param_shapes is not None:
        check_hf_parameters(a, param_shapes)
    plan = hf_tp_plan(a)
    if tp > 1 and plan.get("lm_head") in _GATHERS_OUTPUT and a.vocab % tp:
        # checked on lm_head's parameter, which with tied embeddings is model.embed_tokens.weight
        raise LayoutError(f"Hugging Face layout: 'lm_head' ({plan['lm_head']}) needs its output size {a.vocab} "
                          f"divisible by tp={tp} (transformers refuses it)")
    if tp > 1 and not partial_heads and not a.is_mla and (a.heads % tp or a.kv_heads % tp):
        raise LayoutError(f"Hugging Face layout: tp={tp} does not divide the {a.heads} attention heads and "
                          f"{a.kv_heads} KV heads; transformers would split heads across ranks (it does not "
                          f"replicate KV heads) and its attention cannot run (partial_heads=True to lay it out)")
    params = hf_parameters(a)
    spec_by_name = {s.name: s for s in model_specs(a)}
    grid = ranks_arr.reshape(dp, tp)
    model_dtype = dtype or a.dtype
    specs: dict[str, TensorSpec] = {}
    tables: dict[str, PieceTable] = {}
    per_coord: list[dict[str, tuple[tuple[int, ...], torch.dtype]]] = [{} for _ in range(tp)]
    for p in params:
        placement = tp_placement(p, tp_style(plan, p.plan_name), tp)
        seg_key = tuple((s.lead, s.offsets, spec_by_name[s.tensor].shape) for s in p.segments)
        geo = _geometry(p.shape, placement, tp, seg_key)
        buf_dtype = p.dtype or model_dtype
        for t in range(tp):
            per_coord[t][p.name] = (geo.local_shapes[t], buf_dtype)
        for seg, (coords, offs, sizes, boffs) in zip(p.segments, geo.pieces):
            specs[seg.tensor] = spec_by_name[seg.tensor]
            tables[seg.tensor] = PieceTable(grid[:, coords].reshape(-1), np.tile(offs, (dp, 1)),
                                            np.tile(sizes, (dp, 1)), (p.name,) * (len(coords) * dp),
                                            np.tile(boffs, (dp, 1)))
    buffers = {int(r): dict(per_coord[t]) for d in range(dp) for t, r in enumerate(grid[d].tolist())}
    return Layout(specs, tables, buffers, validate=validate)
