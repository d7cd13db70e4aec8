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

from typing import Mapping, Sequence

import torch

from ..layout import Layout
from ..models.arch import Arch, model_specs
from ..placements import Replicate, Shard, StridedShard, check_ranks
from ..tensors import LayoutError, TensorSpec
from .tensor_parallel import dtensor_layout, tp_placement


def fsdp_placements(spec: TensorSpec, *, dp_shard: int, dp_replicate: int = 1, tp: int = 1,
                    tp_plan: Mapping[str, str] | None = None) -> tuple[tuple[int, ...], list]:
    """``(mesh_shape, placements)`` of one parameter, as FSDP2 (over TP) places it.

    >>> import torch
    >>> q = TensorSpec("model.layers.0.self_attn.q_proj.weight", (8, 4), torch.bfloat16)
    >>> fsdp_placements(q, dp_shard=2, tp=2)      # TP splits rows, so FSDP strides over them
    ((2, 2), [StridedShard(dim=0, split_factor=2), Shard(dim=0)])
    >>> fsdp_placements(q, dp_shard=4, dp_replicate=2)
    ((2, 4), [Replicate(), Shard(dim=0)])
    """
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
    ``"replicate"`` (default :data:`~reshard.frameworks.tensor_parallel.DEFAULT_TP_PLAN`).
    ``validate=None`` validates layouts of up to 100 k pieces.
    """
    specs = model_specs(arch_or_specs) if isinstance(arch_or_specs, Arch) else list(arch_or_specs)
    check_ranks(ranks, "fsdp", dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
    for spec in specs:
        if not spec.shape:
            raise LayoutError(f"fsdp: tensor {spec.name!r} is a scalar; FSDP2 shards dim 0")

    def placements_of(spec: TensorSpec):
        return fsdp_placements(spec, dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp, tp_plan=tp_plan)

    return dtensor_layout(specs, ranks, placements_of, dtype=dtype, validate=validate, what="fsdp")


__all__ = ["fsdp_layout", "fsdp_placements"]
