"""Torch DTensor tensor parallelism as layouts: ``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel`` per module, in ``dp`` replicas; and the builder every DTensor-placed framework uses.

:func:`tensor_parallel_layout` lays a model out as torch tensor parallelism does over a ``tp``-rank
mesh, repeated for ``dp`` replicas (mesh ``(dp, tp)``, replica ``d`` = ranks ``d*tp .. d*tp+tp-1``)::

    parameter                                  TP style (DEFAULT_TP_PLAN)   placements on (dp, tp)
    q/k/v_proj, gate/up_proj, lm_head          colwise                      [Replicate(), Shard(0)]
    o_proj, down_proj                          rowwise                      [Replicate(), Shard(1)]
    embed_tokens (vocabulary rows)             rowwise (embedding)          [Replicate(), Shard(0)]
    norms, routers, anything unnamed           replicated                   [Replicate(), Replicate()]

It splits evenly and refuses a ``tp`` that does not divide the heads, KV heads, intermediate size
or vocabulary (the attention could not run). It is the demo's inference side, and FSDP2 over TP
(:mod:`reshard.frameworks.fsdp`) uses the same TP plan.

:func:`dtensor_layout` builds the layout of many parameters from a rule giving each one's mesh and
placements; parameters with the same shape and placements share their piece arrays, so whole
models build fast.

>>> import torch
>>> from reshard.models import get_arch, tiny_arch
>>> lay = tensor_parallel_layout(tiny_arch(get_arch("qwen3-8b")), ranks=[4, 5, 6, 7], tp=2, dp=2)
>>> [(p.offsets, p.sizes) for p in lay.pieces(5) if p.tensor == "model.layers.0.self_attn.o_proj.weight"]
[((0, 64), (64, 64))]
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Mapping, Sequence

import torch

from ..gc_pause import without_gc
from ..layout import Layout, PieceTable, RankBuffers, read_only
from ..models.arch import Arch, model_specs
from ..placements import Placement, Replicate, Shard, check_ranks, check_sizes
from ..tensors import LayoutError, TensorSpec

COLWISE, ROWWISE, REPLICATE = "colwise", "rowwise", "replicate"

#: module-name pattern -> TP style (fnmatch; first match wins; no match: replicated)
DEFAULT_TP_PLAN: dict[str, str] = {
    "*embed_tokens": ROWWISE,  # nn.Embedding, vocabulary rows
    "*.q_proj": COLWISE,
    "*.k_proj": COLWISE,
    "*.v_proj": COLWISE,
    "*.q_b_proj": COLWISE,
    "*.kv_b_proj": COLWISE,
    "*.o_proj": ROWWISE,
    "*.gate_proj": COLWISE,
    "*.up_proj": COLWISE,
    "*.down_proj": ROWWISE,
    "lm_head": COLWISE,
    "*.shared_head.head": COLWISE,
}


def tp_placement(name: str, ndim: int, tp_plan: Mapping[str, str] | None = None):
    """The TP placement of parameter ``name`` under ``tp_plan`` (``Shard(0)``, ``Shard(1)`` or ``Replicate()``)."""
    plan = DEFAULT_TP_PLAN if tp_plan is None else tp_plan
    module, _, leaf = name.rpartition(".")
    style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(module, pat)), REPLICATE)
    if style not in (COLWISE, ROWWISE, REPLICATE):
        raise LayoutError(f"tensor {name!r}: unknown TP style {style!r}; use {COLWISE!r}, {ROWWISE!r} or {REPLICATE!r}")
    if style == REPLICATE:
        return Replicate()
    if leaf == "bias":  # a column-parallel bias is split with the rows, a row-parallel one replicated
        return Shard(0) if style == COLWISE else Replicate()
    if ndim != 2:
        raise LayoutError(f"tensor {name!r}: {style} needs a 2-D weight, this one has {ndim} dims")
    embedding = module.endswith("embed_tokens")
    return Shard(0) if (style == COLWISE) != embedding else Shard(1)


@without_gc
def dtensor_layout(specs: Sequence[TensorSpec], ranks: Sequence[int],
                   placements_of: Callable[[TensorSpec], tuple[tuple[int, ...], Sequence[Placement]]], *,
                   split: str = "chunk", dtype: torch.dtype | None = None, validate: bool | None = None,
                   what: str = "dtensor") -> Layout:
    """The layout of ``specs`` as DTensors over ``ranks`` (row-major over each tensor's mesh), each
    tensor's ``(mesh_shape, placements)`` given by ``placements_of(spec)``; every buffer is named
    after its tensor, with dtype ``dtype`` (default the tensor's). Tensors with equal shapes and
    placements share one piece table's arrays."""
    ranks = [int(r) for r in ranks]
    templates: dict[tuple, tuple[PieceTable, int]] = {}  # -> (its table, its index in shapes)
    shapes: list[list[tuple[int, ...]]] = []  # per template: the buffer's shape on each rank, in ranks order
    tables: dict[str, PieceTable] = {}
    entries: list[tuple[str, int, torch.dtype]] = []  # per tensor: buffer name, template, dtype
    by_name: dict[str, TensorSpec] = {}
    for spec in specs:
        if spec.name in by_name:
            raise LayoutError(f"{what}: tensor {spec.name!r} is listed twice")
        by_name[spec.name] = spec
        mesh, placements = placements_of(spec)
        key = (spec.shape, tuple(mesh), tuple(placements))
        tpl = templates.get(key)
        if tpl is None:
            probe = TensorSpec("_", spec.shape, spec.dtype)
            lay = Layout.from_placements(probe, ranks, mesh, placements, split)
            t = lay.tables["_"]
            read_only((t.ranks, t.offsets, t.sizes, t.buffer_offsets))
            tpl = templates[key] = (t, len(shapes))
            shapes.append([lay.buffer_map(r)["_"][0] for r in ranks])
        t, k = tpl
        tables[spec.name] = PieceTable(t.ranks, t.offsets, t.sizes, (spec.name,) * len(t), t.buffer_offsets)
        entries.append((spec.name, k, dtype or spec.dtype))
    return Layout(by_name, tables, _rank_buffers(ranks, shapes, entries), validate=validate)


def _rank_buffers(ranks: list[int], shapes: list[list[tuple[int, ...]]],
                  entries: list[tuple[str, int, torch.dtype]]) -> dict[int, RankBuffers]:
    """Every rank's buffers, one :class:`RankBuffers` shared by the ranks whose buffers have the same
    shapes (every tensor's buffer on every rank, its shape from its template)."""
    by_shapes: dict[tuple, RankBuffers] = {}
    out = {}
    for i, r in enumerate(ranks):
        key = tuple(per_rank[i] for per_rank in shapes)
        held = by_shapes.get(key)
        if held is None:
            held = by_shapes[key] = RankBuffers({name: (key[k], dt) for name, k, dt in entries})
        out[r] = held
    return out


def check_tp(arch: Arch, tp: int) -> None:
    """Raise :class:`LayoutError` unless ``tp`` divides everything tensor parallelism splits."""
    check_sizes("tensor parallel", tp=tp)
    sizes = {"attention heads": arch.heads, "kv heads": arch.kv_heads, "intermediate size": arch.intermediate,
             "vocabulary": arch.vocab}
    bad = [f"{what} ({n})" for what, n in sizes.items() if n % tp]
    if bad:
        raise LayoutError(f"tensor parallel size {tp} does not divide the model's {', '.join(bad)}; "
                          f"pick a tp that divides all of them")


def tensor_parallel_layout(arch_or_specs: Arch | Sequence[TensorSpec], ranks: Sequence[int], tp: int, dp: int = 1, *,
                           dtype: torch.dtype | None = None, tp_plan: Mapping[str, str] | None = None,
                           validate: bool | None = None) -> Layout:
    """Tensor parallel over ``tp`` consecutive ranks, ``dp`` replicas (see module doc).

    ``ranks`` lists the ``tp * dp`` ranks replica by replica; ``dtype`` overrides the buffers'
    dtype (bf16 inference weights from fp32 training weights, say).
    """
    check_ranks(ranks, "tensor parallel", tp=tp, dp=dp)
    if isinstance(arch_or_specs, Arch):
        check_tp(arch_or_specs, tp)
        specs = model_specs(arch_or_specs)
    else:
        specs = list(arch_or_specs)

    def placements_of(spec: TensorSpec):
        return (dp, tp), [Replicate(), tp_placement(spec.name, len(spec.shape), tp_plan)]

    return dtensor_layout(specs, ranks, placements_of, split="even", dtype=dtype, validate=validate,
                          what="tensor parallel")


__all__ = ["COLWISE", "DEFAULT_TP_PLAN", "REPLICATE", "ROWWISE", "check_tp", "dtensor_layout",
           "tensor_parallel_layout", "tp_placement"]
