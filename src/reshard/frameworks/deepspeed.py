"""DeepSpeed ZeRO-3 training layouts: each rank holds one flat chunk of every parameter.

ZeRO-3 flattens a parameter of ``numel`` elements (row-major) and gives rank ``r`` of its
partition group of ``world`` ranks the chunk ``flat[r*ps : min((r+1)*ps, numel)]``, with
``ps = ceil(numel / world)``; the last ranks' chunks are zero-padded to ``ps`` (DeepSpeed's
``p.ds_tensor``), and a rank past the end holds padding only. A run of consecutive row-major
elements is a union of boxes each contiguous in memory: a partial first row, whole rows, a
partial last row (in n-D, the same at every level: at most ``2*ndim - 1`` boxes). Each box is one
piece in a buffer of its own, a view of the chunk shaped like the box; padding is in no piece.

A ``[3, 4]`` weight over 2 ranks (``ps = 6``) and over 5 (``ps = 3``)::

    world  rank  flat range  boxes (rows, cols)
    2      0     0:6         [0:1, 0:4]  [1:2, 0:2]
    2      1     6:12        [1:2, 2:4]  [2:3, 0:4]
    5      3     9:12        [2:3, 1:4]
    5      4     12:12       (none: padding only)

Buffers are named ``"<parameter>[<first>:<end>]"`` by the flat range of the parameter they hold.
transformers 5's fused experts (``mlp.experts.gate_up_proj``) are parameters like any other: a
box of one is cut into the checkpoint-named experts it crosses
(:func:`~reshard.models.arch.parameter_segments`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from ..layout import Layout
from ..models.arch import Arch, model_specs, parameter_segments
from ..tensors import LayoutError, Piece, TensorSpec, checked_int


def zero3_chunk(numel: int, world: int, index: int) -> tuple[int, int]:
    """The flat range ``(start, stop)`` of a ``numel``-element parameter that partition rank ``index``
    of ``world`` holds (``stop - start`` may be short, or 0: the rest of its chunk is padding).

    >>> [zero3_chunk(10, 4, r) for r in range(4)]
    [(0, 3), (3, 6), (6, 9), (9, 10)]
    >>> zero3_chunk(2, 4, 3)
    (2, 2)
    """
    numel = checked_int(numel, "zero3: numel", minimum=0)
    world = checked_int(world, "zero3: world size", minimum=1)
    index = checked_int(index, "zero3: partition rank", minimum=0)
    if index >= world:
        raise LayoutError(f"zero3: partition rank {index} is not below the world size {world}")
    ps = -(-numel // world)
    return min(index * ps, numel), min((index + 1) * ps, numel)


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The boxes ``[(offsets, sizes, first)]`` that elements ``start:stop`` (row-major) of a tensor of
    ``shape`` make, in order, each contiguous in memory from flat element ``first``: leading dims of
    size 1, one partial dim, whole trailing dims.

    >>> flat_boxes((3, 4), 2, 11)      # the end of row 0, row 1, the start of row 2
    [((0, 2), (1, 2), 2), ((1, 0), (1, 4), 4), ((2, 0), (1, 3), 8)]
    >>> flat_boxes((2, 3, 4), 5, 24)   # n-D: the same at every level
    [((0, 1, 1), (1, 1, 3), 5), ((0, 2, 0), (1, 1, 4), 8), ((1, 0, 0), (1, 3, 4), 12)]
    >>> flat_boxes((3, 4), 5, 5)
    []
    """
    shape = tuple(int(n) for n in shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise LayoutError(f"zero3: flat range {start}:{stop} is outside a tensor of shape {shape} ({numel} elements)")
    if start == stop:
        return []
    n = len(shape)
    if n == 0:
        return [((), (), 0)]
    stride = [math.prod(shape[j + 1:]) for j in range(n)]  # elements per index step of dim j
    out = []

    def emit(a: int, j: int, k: int) -> None:
        offsets = tuple(int(x) for x in np.unravel_index(a, shape))
        out.append((offsets, (1,) * j + (k,) + shape[j + 1:], a))

    a, j = start, n - 1
    while j > 0:  # climb: fill up to the next boundary of dim j - 1, while that stays within stop
        up = -(-a // stride[j - 1]) * stride[j - 1]
        if up > stop:
            break
        if up > a:
            emit(a, j, (up - a) // stride[j])
        a, j = up, j - 1
    for j in range(j, n):  # descend: whole steps of dim j, then finer
        k = (stop - a) // stride[j]
        if k:
            emit(a, j, k)
            a += k * stride[j]
    assert a == stop, (shape, start, stop)
    return out


def zero3_pieces(name: str, shape: Sequence[int], dtype: torch.dtype, start: int, stop: int, rank: int, *,
                 checkpoint_names: bool = True):
    """``(pieces, specs, buffers)`` of a rank that holds elements ``start:stop`` of parameter ``name``:
    one buffer per box of :func:`flat_boxes`, ``{buffer: (box sizes, dtype, first flat element)}``,
    and the pieces of the logical tensors in it (fused experts split by checkpoint name).

    >>> pieces, specs, buffers = zero3_pieces("w", (3, 4), torch.float32, 6, 12, rank=1)
    >>> buffers
    {'w[6:8]': ((1, 2), torch.float32, 6), 'w[8:12]': ((1, 4), torch.float32, 8)}
    >>> [(p.offsets, p.sizes, p.buffer) for p in pieces]
    [((1, 2), (1, 2), 'w[6:8]'), ((2, 0), (1, 4), 'w[8:12]')]
    """
    shape = tuple(int(n) for n in shape)
    segments = parameter_segments(name, shape, dtype, checkpoint_names=checkpoint_names)
    specs = {spec.name: spec for spec, _ in segments}
    pieces: list[Piece] = []
    buffers: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {}
    for offsets, sizes, first in flat_boxes(shape, start, stop):
        buffer = f"{name}[{first}:{first + math.prod(sizes)}]"
        buffers[buffer] = (sizes, dtype, first)
        box_lo = np.array(offsets, np.int64)
        box_hi = box_lo + np.array(sizes, np.int64)
        for spec, seg in segments:
            lead = len(seg.lead)
            lo = np.array(seg.lead + seg.offsets, np.int64)
            hi = lo + np.array((1,) * lead + spec.shape, np.int64)
            a, b = np.maximum(lo, box_lo), np.minimum(hi, box_hi)
            if (b <= a).any():
                continue
            pieces.append(Piece(spec.name, tuple((a - lo)[lead:].tolist()), tuple((b - a)[lead:].tolist()), buffer,
                                tuple((a - box_lo).tolist()), rank))
    return pieces, specs, buffers


def zero3_layout(specs_or_arch: Arch | Sequence[TensorSpec], ranks: Sequence[int], *,
                 dtype: torch.dtype | None = None, checkpoint_names: bool = True) -> Layout:
    """The ZeRO-3 layout of a model's parameters over ``ranks`` (its partition group, in order).

    ``specs_or_arch`` lists the parameters as ZeRO-3 partitions them (an :class:`Arch` gives its
    checkpoint tensors, one parameter each; for a transformers 5 model with fused experts pass
    ``reshard.models.from_module(model, checkpoint_names=False)``: each fused parameter is then
    partitioned whole and its pieces carry the experts' checkpoint names). ``dtype`` overrides the
    buffers' dtype (the model's dtype under mixed precision, say).

    >>> lay = zero3_layout([TensorSpec("w", (3, 4), torch.float32)], [0, 1])
    >>> [(p.rank, p.offsets, p.sizes) for r in (0, 1) for p in lay.pieces(r)]
    [(0, (0, 0), (1, 4)), (0, (1, 0), (1, 2)), (1, (1, 2), (1, 2)), (1, (2, 0), (1, 4))]
    """
    params = model_specs(specs_or_arch) if isinstance(specs_or_arch, Arch) else list(specs_or_arch)
    ranks = [checked_int(r, "zero3: rank", minimum=0) for r in ranks]
    if not ranks or len(set(ranks)) != len(ranks):
        raise LayoutError(f"zero3: ranks must be distinct and at least one, got {ranks}")
    pieces: list[Piece] = []
    specs: dict[str, TensorSpec] = {}
    buffers: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {r: {} for r in ranks}
    seen: set[str] = set()
    for param in params:
        if param.name in seen:
            raise LayoutError(f"zero3: parameter {param.name!r} is listed twice")
        seen.add(param.name)
        numel = math.prod(param.shape)
        for index, rank in enumerate(ranks):
            start, stop = zero3_chunk(numel, len(ranks), index)
            got, named, bufs = zero3_pieces(param.name, param.shape, param.dtype, start, stop, rank,
                                            checkpoint_names=checkpoint_names)
            pieces += got
            specs.update(named)
            buffers[rank].update((b, (sizes, dtype or bdtype)) for b, (sizes, bdtype, _) in bufs.items())
    return Layout.from_pieces(specs.values(), pieces, buffers)


__all__ = ["flat_boxes", "zero3_chunk", "zero3_layout", "zero3_pieces"]
