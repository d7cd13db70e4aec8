"""A live DeepSpeed ZeRO-3 model as a refit source: :func:`zero3_side`.

Each rank sends straight from its ZeRO-3 partitions (``p.ds_tensor``): no gather, no copy. The
side's buffers are views of the partitions shaped like the boxes they hold
(:mod:`reshard.frameworks.deepspeed`), rebuilt from the current ``ds_tensor`` at every refit, so a
refit always reads the weights of the last optimizer step. Names are the Hugging Face
``state_dict`` names (transformers 5's fused experts split into checkpoint names). Rank ``r``
of a parameter's partition group ``p.ds_process_group`` holds::

    rank in p.ds_process_group   flat elements of p (ps = p.ds_tensor.numel())
    r                            r*ps : min((r+1)*ps, p.ds_numel), then zero padding

Refused when the side is built (at connect, before any byte moves), naming the option:

    what                                   why
    zero_optimization.stage 0 / 1 / 2      no partitioned parameters (no ``ds_tensor``): pass the module
                                           itself, whose parameters are whole replicas
    zero_hpz_partition_size > 1 (ZeRO++)   secondary partitions over a sub-group; not read here
    mics_shard_size (MiCS)                 parameters partitioned over a shard group other than
                                           ``ds_process_group`` (DeepSpeed 0.19 itself refuses it)
    a parameter in another state           no ``ds_tensor``, a gather in flight, swapped out to NVMe,
                                           quantized, or a partition of an unexpected size

DeepSpeed is imported only when a model is read (and not even then unless it is a ZeRO-3 model).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from ..frameworks.deepspeed import zero3_pieces
from ..layout import Layout
from ..models.arch import named_tensors, parameter_segments
from ..refit.sides import Side
from ..tensors import LayoutError, Piece, TensorSpec


def is_deepspeed_engine(obj) -> bool:
    """A ``DeepSpeedEngine`` (by its type's name and its ``module``: no import of deepspeed)."""
    return any(c.__name__ == "DeepSpeedEngine" for c in type(obj).__mro__) and hasattr(obj, "module")


def is_zero3_model(module) -> bool:
    """True for a ZeRO-3 engine or a module with ZeRO-3 partitioned parameters (``ds_tensor``)."""
    if is_deepspeed_engine(module):
        return True
    return isinstance(module, torch.nn.Module) and any(hasattr(p, "ds_tensor") for p in module.parameters())


def _check_engine(engine) -> None:
    stage = engine.zero_optimization_stage()
    if stage != 3:
        raise LayoutError(f"deepspeed: zero_optimization.stage is {stage}, not 3: only ZeRO-3 partitions parameters "
                          f"(ds_tensor); under stage {stage} every rank holds whole parameters, so pass the module "
                          f"itself (engine.module) as a source of replicas")
    hpz = getattr(engine, "zero_hpz_partition_size", lambda: 1)()
    if hpz and hpz > 1:
        raise LayoutError(f"deepspeed: zero_optimization.zero_hpz_partition_size is {hpz}: hpZ (ZeRO++) secondary "
                          f"partitions are not supported as a refit source; set it to 1")


def _check_param(name: str, p: torch.Tensor, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of parameter ``p``'s elements this rank's partition holds, after checking it is
    a ZeRO-3 parameter in the state this module reads."""
    import torch.distributed as dist

    where = f"rank {rank}: deepspeed parameter {name!r}"
    if not hasattr(p, "ds_tensor") or p.ds_tensor is None:
        raise LayoutError(f"{where} has no ds_tensor: it is not partitioned by ZeRO-3 (built outside "
                          f"deepspeed.zero.Init and not converted by deepspeed.initialize?)")
    comm = getattr(p, "comm", None)
    if comm is not None and hasattr(comm, "param_shard_group"):
        raise LayoutError(f"{where} is partitioned by MiCS (mics_shard_size): MiCS shard groups are not supported "
                          f"as a refit source; drop zero_optimization.mics_shard_size")
    if getattr(p, "ds_zero_param_process_group", None) is not None or getattr(p, "ds_secondary_tensor", None) is not None:
        raise LayoutError(f"{where} has hpZ secondary partitions (zero_hpz_partition_size > 1): not supported as a "
                          f"refit source; set zero_optimization.zero_hpz_partition_size to 1")
    status = getattr(getattr(p, "ds_status", None), "name", None)
    if status == "INFLIGHT":
        raise LayoutError(f"{where} is being gathered (ds_status INFLIGHT): build the source outside a forward pass "
                          f"or GatheredParameters")
    part = p.ds_tensor
    if getattr(getattr(part, "status", None), "name", "AVAILABLE") != "AVAILABLE" or \
            getattr(part, "final_location", None) is not None:
        raise LayoutError(f"{where}: its partition is swapped out (offload_param to nvme); keep partitions in memory "
                          f"(offload_param.device 'cpu' or 'none')")
    if hasattr(part, "ds_quant_scale"):
        raise LayoutError(f"{where}: its partition is quantized (zero_quantized_nontrainable_weights); not supported")
    group = p.ds_process_group
    world, index = dist.get_world_size(group=group), dist.get_rank(group=group)
    numel = int(p.ds_numel)
    if math.prod(p.ds_shape) != numel:
        raise LayoutError(f"{where}: ds_shape {tuple(p.ds_shape)} does not hold ds_numel {numel} elements")
    ps = int(part.numel())
    if part.dim() != 1 or not part.is_contiguous() or ps != -(-numel // world) or part.dtype != p.dtype:
        raise LayoutError(f"{where}: its partition is {tuple(part.shape)} {part.dtype}, expected a contiguous "
                          f"({-(-numel // world)},) {p.dtype} chunk of {numel} elements over {world} ranks")
    return min(index * ps, numel), min((index + 1) * ps, numel)


class Zero3Side(Side):
    """A :class:`Side` over ZeRO-3 partitions: its buffers are views of ``p.ds_tensor``, re-made at each
    :meth:`read` (DeepSpeed may point a partition at new storage: offload, reload)."""

    def __init__(self, rank: int, layout: Layout, tensors, where: Mapping[str, tuple[torch.nn.Parameter, int, int]]):
        super().__init__(rank, layout, tensors)
        self._where = dict(where)  # buffer -> (parameter, first element of the box in the partition, box shape)

    def read(self) -> dict[str, torch.Tensor]:
        out = {}
        for buffer, (param, offset, shape) in self._where.items():
            out[buffer] = param.ds_tensor.detach().narrow(0, offset, math.prod(shape)).view(shape)
        return {**self.tensors, **out}


def zero3_side(module_or_engine, rank: int, *, rank_of: Mapping[int, int] | None = None) -> Side:
    """This rank's source side of a live ZeRO-3 model (a ``DeepSpeedEngine`` or its ``module``).

    ``rank`` is this process's rank in the refit group; ``rank_of`` maps default-group ranks to refit
    ranks (checked: ``rank_of[dist.get_rank()] == rank``). Persistent buffers that ZeRO does not
    partition are whole replicas, as :meth:`Side.from_module` reads them. Bad configurations raise
    :class:`~reshard.tensors.LayoutError` naming the option (see module doc).
    """
    import torch.distributed as dist

    if is_deepspeed_engine(module_or_engine):
        _check_engine(module_or_engine)
        module = module_or_engine.module
    else:
        module = module_or_engine
    if rank_of is not None and dist.is_initialized() and int(rank_of[dist.get_rank()]) != rank:
        raise LayoutError(f"rank {rank}: default-group rank {dist.get_rank()} is refit rank "
                          f"{rank_of[dist.get_rank()]} by rank_of")
    params = dict(module.named_parameters())
    if not any(hasattr(p, "ds_tensor") for p in params.values()):
        raise LayoutError(f"rank {rank}: no parameter of the {type(module).__name__} has a ds_tensor: it is not a "
                          f"ZeRO-3 model (zero_optimization.stage 0/1/2 keeps whole parameters; pass the module "
                          f"itself as a source of replicas)")
    pieces: list[Piece] = []
    specs: dict[str, TensorSpec] = {}
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, tuple[torch.nn.Parameter, int, tuple[int, ...]]] = {}
    for name, t in named_tensors(module):
        if name not in params or not isinstance(t, torch.nn.Parameter):  # a persistent buffer: a replica
            for spec, _ in parameter_segments(name, tuple(t.shape), t.dtype):
                specs[spec.name] = spec
                pieces.append(Piece(spec.name, (0,) * t.dim(), tuple(t.shape), name, (0,) * t.dim(), rank))
            shapes[name] = (tuple(t.shape), t.dtype)
            tensors[name] = t.detach()
            continue
        start, stop = _check_param(name, t, rank)
        got, named, buffers = zero3_pieces(name, tuple(t.ds_shape), t.dtype, start, stop, rank)
        specs.update(named)
        pieces += got
        for buffer, (sizes, dtype, first) in buffers.items():
            shapes[buffer] = (sizes, dtype)
            where[buffer] = (t, first - start, sizes)
    layout = Layout.from_pieces(specs.values(), pieces, {rank: shapes})
    side = Zero3Side(rank, layout, tensors, where)
    side.tensors = side.read()  # the live views (read() re-makes them for every refit)
    return side


def gathered_tensors(module_or_engine):
    """``(checkpoint name, full tensor)`` of every parameter of a ZeRO-3 model, one parameter at a time
    under ``deepspeed.zero.GatheredParameters`` (a collective: every rank of the partition group
    iterates, in the same order; each full tensor is a copy, so at most one gathered parameter
    is alive at once beyond what the caller keeps). The gather-and-broadcast baseline's source
    (what TRL does before it broadcasts); fused experts split into checkpoint names."""
    import deepspeed

    module = module_or_engine.module if is_deepspeed_engine(module_or_engine) else module_or_engine
    for name, t in named_tensors(module):
        if hasattr(t, "ds_tensor"):
            with deepspeed.zero.GatheredParameters([t]):
                full = t.data.detach().clone()
        else:
            full = t.detach()
        for spec, seg in parameter_segments(name, tuple(full.shape), full.dtype):
            box = full[seg.lead] if seg.lead else full
            yield spec.name, box[tuple(slice(o, o + n) for o, n in zip(seg.offsets, spec.shape))]


__all__ = ["Zero3Side", "gathered_tensors", "is_deepspeed_engine", "is_zero3_model", "zero3_side"]
