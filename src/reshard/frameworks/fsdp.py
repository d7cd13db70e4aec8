"""FSDP2 training layouts (``torch.distributed.fsdp.fully_shard``), with HSDP and tensor parallelism.

:func:`fsdp_layout` lays every parameter out as torch's DTensor does after ``fully_shard``; the
buffers are the parameters' local shards (``param.to_local()``), named by the parameter's
(Hugging Face) name. Ranks are taken row-major over the mesh ``(dp_replicate, dp_shard, tp)``,
as ``init_device_mesh`` numbers them::

    config                          mesh                      placements per parameter
    FSDP                            (dp_shard,)               [Shard(0)]
    HSDP                            (dp_replicate, dp_shard)  [Replicate(), Shard(0)]
    FSDP + TP, TP shards dim 0      (dp_shard, tp)            [_StridedShard(0, split_factor=tp), Shard(0)]
    FSDP + TP, otherwise            (dp_shard, tp)            [Shard(0), <tp placement>]
    HSDP + TP                       (dp_replicate, dp_shard, tp)  [Replicate(), <as FSDP + TP>]

Every split follows ``torch.chunk`` (trailing ranks may hold short or empty shards). FSDP2 over a
TP-sharded dim 0 shards each rank's TP shard, so a rank holds rows of every TP shard's chunk:
with tp=2, dp_shard=2 and 8 rows, rank (dp 0, tp 1) holds rows 4:6 (torch's ``_StridedShard``;
see :mod:`reshard.placements`).

The TP placements follow a tensor-parallel plan over module names (:data:`DEFAULT_TP_PLAN`,
torchtitan's and Hugging Face's ``tp_plan`` choices): ``colwise`` (``ColwiseParallel``) shards a
linear weight's rows, ``Shard(0)``, and an embedding's columns, ``Shard(1)``; ``rowwise``
(``RowwiseParallel``) shards a linear weight's columns, ``Shard(1)``, and an embedding's rows
(the vocabulary), ``Shard(0)``; everything else (norms, routers, MLA's down projections) is
replicated over TP.
"""

from __future__ import annotations

import fnmatch
from typing import Mapping, Sequence

import numpy as np
import torch

from ..gc_pause import without_gc
from ..layout import Layout, PieceTable, read_only
from ..models.arch import Arch, model_specs
from ..placements import Replicate, Shard, StridedShard
from ..tensors import LayoutError, TensorSpec
from . import framework_layout

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


def fsdp_placements(spec: TensorSpec, *, dp_shard: int, dp_replicate: int = 1, tp: int = 1,
                    tp_plan: Mapping[str, str] | None = None) -> tuple[tuple[int, ...], list]:
    """``(mesh_shape, placements)`` of one parameter, as FSDP2 (over TP) places it."""
    if tp == 1:
        fsdp = [Shard(0)]
        mesh = (dp_shard,)
    else:
        tpp = tp_placement(spec.name, len(spec.shape), tp_plan)
        dp_p = StridedShard(0, tp) if tpp == Shard(0) else Shard(0)
        fsdp = [dp_p, tpp]
        mesh = (dp_shard, tp)
    if dp_replicate > 1:
        return (dp_replicate,) + mesh, [Replicate()] + fsdp
    return mesh, fsdp


@without_gc
def fsdp_layout(
    arch_or_specs: Arch | Sequence[TensorSpec],
    ranks: Sequence[int],
    *,
    dp_shard: int,
    dp_replicate: int = 1,
    tp: int = 1,
    dtype: torch.dtype | None = None,
    tp_plan: Mapping[str, str] | None = None,
    validate: bool | None = None,
) -> Layout:
    """The FSDP2 / HSDP (over TP) layout of a model's parameters over ``ranks``.

    ``ranks`` lists the ``dp_replicate * dp_shard * tp`` training ranks row-major over the mesh
    ``(dp_replicate, dp_shard, tp)``. ``dtype`` overrides the buffers' dtype (fp32 master
    weights, say). ``tp_plan`` maps module-name patterns to ``"colwise"`` / ``"rowwise"`` /
    ``"replicate"`` (default :data:`DEFAULT_TP_PLAN`). ``validate=None`` validates layouts of
    up to 100 k pieces. Tensors with the same shape and placements share their piece arrays, so
    big models build fast.
    """
    specs = model_specs(arch_or_specs) if isinstance(arch_or_specs, Arch) else list(arch_or_specs)
    ranks = [int(r) for r in ranks]
    for what, v in (("dp_shard", dp_shard), ("dp_replicate", dp_replicate), ("tp", tp)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise LayoutError(f"fsdp: {what} must be a positive integer, got {v!r}")
    world = dp_replicate * dp_shard * tp
    if len(ranks) != world:
        raise LayoutError(f"fsdp: {len(ranks)} ranks given, but dp_replicate*dp_shard*tp = "
                          f"{dp_replicate}*{dp_shard}*{tp} = {world}")
    if len(set(ranks)) != len(ranks):
        raise LayoutError(f"fsdp: ranks repeat a rank: {ranks}")
    templates: dict[tuple, tuple[PieceTable, dict[int, tuple[int, ...]]]] = {}
    tables: dict[str, PieceTable] = {}
    buffers: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {r: {} for r in ranks}
    by_name: dict[str, TensorSpec] = {}
    for spec in specs:
        if spec.name in by_name:
            raise LayoutError(f"fsdp: tensor {spec.name!r} is listed twice")
        by_name[spec.name] = spec
        if not spec.shape:
            raise LayoutError(f"fsdp: tensor {spec.name!r} is a scalar; FSDP2 shards dim 0")
        mesh, placements = fsdp_placements(spec, dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp,
                                           tp_plan=tp_plan)
        key = (spec.shape, tuple(placements))
        tpl = templates.get(key)
        if tpl is None:
            probe = TensorSpec("_", spec.shape, spec.dtype)
            lay = Layout.from_placements(probe, ranks, mesh, placements, "chunk")
            t = lay.tables["_"]
            read_only((t.ranks, t.offsets, t.sizes, t.buffer_offsets))
            tpl = templates[key] = (t, {r: lay.buffers(r)["_"][0] for r in ranks})
        t, shapes = tpl
        tables[spec.name] = PieceTable(t.ranks, t.offsets, t.sizes, (spec.name,) * len(t), t.buffer_offsets)
        bdtype = dtype or spec.dtype
        for r in ranks:
            buffers[r][spec.name] = (shapes[r], bdtype)
    return framework_layout(by_name, tables, buffers, validate)


__all__ = ["COLWISE", "DEFAULT_TP_PLAN", "REPLICATE", "ROWWISE", "fsdp_layout", "fsdp_placements", "tp_placement"]
