"""The destination as an engine holds it under a dtype policy: FP8 weights and their ``_scale_inv`` layouts.

On the destination an FP8 tensor ``w`` is two logical tensors, each with its own layout
(:func:`precision_layout`): ``w`` in float8_e4m3fn, in the same buffers (now FP8), and
``w_scale_inv`` (float32, ``ceil(rows / bn) x ceil(cols / bk)``) in buffers named
``<buffer>_scale_inv``, block row ``i`` of a piece at buffer row ``r`` going to scale row ``r / bn``:
vLLM's block-FP8 ``weight`` / ``weight_scale_inv`` (fused QKV, gate-up and FusedMoE's w13 / w2
included). A destination piece that does not hold whole blocks (a TP split through a block,
a fused partner starting inside one) is a :class:`~reshard.tensors.LayoutError` naming the tensor,
as vLLM refuses such splits (:func:`check_whole_blocks`). Cast tensors' buffers take the cast
dtype; kept tensors stay as they are.

Pure: no process group, no device.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from ..gc_pause import without_gc
from ..layout import Layout, PieceTable, Repeated
from ..quant import FP8_DTYPE, MX_SCALE_SUFFIX, SCALE_SUFFIX, grid_shape
from ..tensors import LayoutError, TensorSpec, box_str, dtype_name
from .dtype_policy import KEEP, Cast, DtypePolicy, FP8Block, Precision, layout_precisions

BufferDescs = dict[str, tuple[tuple[int, ...], torch.dtype]]  # {buffer: (shape, dtype)} of one rank


def check_whole_blocks(name: str, table: PieceTable, shape, block) -> None:
    """Raise :class:`LayoutError` naming ``name`` unless every piece of ``table`` holds whole blocks at a
    block boundary of its buffer (what block-FP8 destinations need; vLLM refuses other TP splits)."""
    if not len(table):
        return
    block_size = np.array(block, np.int64)
    extent = np.array(shape, np.int64)
    end = table.offsets + table.sizes
    buffer_offsets = table.buffer_offsets[:, -2:]
    bad_start = table.offsets % block_size != 0
    bad_end = (end % block_size != 0) & (end != extent)
    bad_buffer = buffer_offsets % block_size != 0
    live = (table.sizes > 0).all(axis=1)[:, None]
    bad = (bad_start | bad_end | bad_buffer) & live
    if not bad.any():
        return
    row, dim = (int(x) for x in np.argwhere(bad)[0])
    what = ("row", "column")[dim]
    box = box_str(table.offsets[row], table.sizes[row])
    if bad_start[row, dim]:
        where = f"its split at {what} {int(table.offsets[row, dim])}"
    elif bad_end[row, dim]:
        where = f"its split at {what} {int(end[row, dim])}"
    else:
        where = f"its place at {what} {int(buffer_offsets[row, dim])} of buffer {table.buffers[row]!r}"
    raise LayoutError(
        f"tensor {name!r}: destination rank {int(table.ranks[row])} holds box {box}, and {where} cuts through "
        f"{block[0]}x{block[1]} blocks; block FP8 needs every destination piece to hold whole blocks at block "
        f"boundaries of its buffer (vLLM's block-FP8 layers refuse such tensor-parallel splits too)")


def scale_table(table: PieceTable, block, suffix: str = SCALE_SUFFIX) -> PieceTable:
    """The ``_scale_inv`` pieces (``suffix``: ``_scale`` for MXFP8) of an FP8 tensor's (whole-block)
    destination pieces."""
    block_size = np.array(block, np.int64)
    grid_lo = table.offsets // block_size
    grid_hi = -(-(table.offsets + table.sizes) // block_size)
    buffer_offsets = table.buffer_offsets.copy()
    buffer_offsets[:, -2:] //= block_size
    return PieceTable(table.ranks, grid_lo, grid_hi - grid_lo, _scale_names(table, suffix), buffer_offsets)


def _scale_names(table: PieceTable, suffix: str):
    """The buffer names of ``table``'s scale pieces: each piece's buffer name plus ``suffix``."""
    one = table.one_buffer()
    return Repeated(one + suffix, len(table)) if one is not None else tuple(buffer + suffix for buffer in table.buffers)


def _check_precisions(destination: Layout, precisions: Mapping[str, Precision]) -> None:
    """LayoutError for a precision a tensor cannot take: FP8 of a non-2-D or integer tensor, or whose
    scale name is taken; a cast across dtype classes."""
    for name, precision in precisions.items():
        spec = destination.specs[name]
        if isinstance(precision, FP8Block):
            if len(spec.shape) != 2 or not spec.dtype.is_floating_point:
                raise LayoutError(f"tensor {name!r}: block FP8 takes 2-D floating tensors, this one is "
                                  f"{dtype_name(spec.dtype)} of shape {spec.shape} (keep or cast it instead)")
            if precision.scale_name(name) in destination.specs:
                raise LayoutError(f"tensor {name!r}: its scale tensor {precision.scale_name(name)!r} is a destination tensor "
                                  f"already")
        elif isinstance(precision, Cast) and (precision.dtype.is_floating_point != spec.dtype.is_floating_point):
            raise LayoutError(f"tensor {name!r}: cannot cast {dtype_name(spec.dtype)} to {dtype_name(precision.dtype)}")


def _buffer_precisions(destination: Layout, precisions: Mapping[str, Precision]) -> dict[str, Precision]:
    """Each destination buffer name's precision, or LayoutError naming two tensors that disagree."""
    by_buffer: dict[str, tuple[Precision, str]] = {}
    for name, table in destination.tables.items():
        if not len(table):
            continue
        precision = precisions[name]
        one = table.one_buffer()
        for buffer in ((one,) if one is not None else dict.fromkeys(table.buffers)):
            seen = by_buffer.get(buffer)
            if seen is None:
                by_buffer[buffer] = (precision, name)
            elif seen[0] != precision:
                _raise_precision_conflict(destination, buffer, seen[1], name, seen[0], precision)
    return {buffer: precision for buffer, (precision, _) in by_buffer.items()}


def _raise_precision_conflict(destination: Layout, buffer: str, first: str, second: str, first_precision,
                              second_precision) -> None:
    """Raise for tensors of two precisions in ``buffer`` of one rank (buffers of one name on other
    ranks may differ: then the name is ambiguous, also an error)."""
    def ranks(name):
        table = destination.tables[name]
        return {int(rank) for rank, held in zip(table.ranks.tolist(), table.buffers) if held == buffer}

    common = sorted(ranks(first) & ranks(second))
    where = f"rank {common[0]}" if common else "ranks of one buffer name"
    raise LayoutError(f"{where} buffer {buffer!r}: holds tensor {first!r} ({first_precision}) and tensor "
                      f"{second!r} ({second_precision}); one buffer has one precision: give the tensors of a "
                      f"fused buffer the same precision")


def _engine_tensors(destination: Layout, precisions: Mapping[str, Precision]
                    ) -> tuple[dict[str, TensorSpec], dict[str, PieceTable]]:
    """Specs and piece tables under the policy: FP8 tensors in float8_e4m3fn (whole blocks checked)
    followed by their ``_scale_inv`` tensors; the others unchanged."""
    specs, tables = {}, {}
    # tables sharing piece arrays (tables stay alive while this runs: ids are unique) hold whole blocks
    # alike, and share their scale tables' arrays; only the buffer names are each tensor's own
    whole: set[tuple] = set()
    scale_arrays: dict[tuple, PieceTable] = {}
    for name, spec in destination.specs.items():
        precision, table = precisions[name], destination.tables[name]
        if not isinstance(precision, FP8Block):
            specs[name], tables[name] = spec, table
            continue
        boxes = (id(table.offsets), id(table.sizes), id(table.buffer_offsets), spec.shape, precision.block)
        if boxes not in whole:
            check_whole_blocks(name, table, spec.shape, precision.block)
            whole.add(boxes)
        specs[name], tables[name] = TensorSpec(name, spec.shape, FP8_DTYPE), table
        key = (id(table.ranks),) + boxes + (precision.scale_suffix,)
        first = scale_arrays.get(key)
        if first is None:
            scales = scale_arrays[key] = scale_table(table, precision.block, precision.scale_suffix)
        else:  # the first one's arrays (and geometry key) under this tensor's buffer names
            scales = PieceTable(first.ranks, first.offsets, first.sizes, _scale_names(table, precision.scale_suffix),
                                first.buffer_offsets, first.geometry_key())
        scale = precision.scale_name(name)
        specs[scale] = TensorSpec(scale, grid_shape(spec.shape, precision.block), precision.scale_dtype)
        tables[scale] = scales
    return specs, tables


def _engine_buffers_of_rank(rank: int, named: BufferDescs, by_buffer: Mapping[str, Precision]) -> BufferDescs:
    """One rank's buffers under the policy: cast buffers in their dtype, FP8 buffers in float8_e4m3fn
    plus a ``<buffer>_scale_inv`` buffer each."""
    out: BufferDescs = {}
    for buffer, (shape, dtype) in named.items():
        precision = by_buffer.get(buffer, KEEP)
        if isinstance(precision, Cast):
            out[buffer] = (shape, precision.dtype)
        elif isinstance(precision, FP8Block):
            if len(shape) < 2:
                raise LayoutError(f"rank {rank} buffer {buffer!r}: block FP8 needs buffers of 2 or more dims, "
                                  f"this one has shape {shape}")
            out[buffer] = (shape, FP8_DTYPE)
            out[precision.scale_name(buffer)] = (tuple(shape[:-2]) + grid_shape(shape[-2:], precision.block),
                                                 precision.scale_dtype)
        else:
            out[buffer] = (shape, dtype)
    clash = [buffer for buffer in out if buffer.endswith((SCALE_SUFFIX, MX_SCALE_SUFFIX)) and buffer in named
             and out[buffer] != named[buffer]]
    if clash:
        raise LayoutError(f"rank {rank} buffer {clash[0]!r}: the name of an FP8 buffer's scales is taken by "
                          f"another buffer")
    return out


def _engine_buffers(destination: Layout, by_buffer: Mapping[str, Precision]) -> dict[int, BufferDescs]:
    """Every rank's buffers under the policy (ranks with equal buffers share the result)."""
    buffers: dict[int, BufferDescs] = {}
    by_id: dict[int, BufferDescs] = {}  # a rank's shared mapping (by id) -> its conversion
    converted: dict[tuple, BufferDescs] = {}  # equal mappings held apart share one conversion too
    for rank in destination.ranks:
        named = destination.buffer_map(rank)
        hit = by_id.get(id(named))
        if hit is None:
            key = tuple(named.items())
            hit = converted.get(key)
            if hit is None:
                hit = converted[key] = _engine_buffers_of_rank(rank, named, by_buffer)
            by_id[id(named)] = hit
        buffers[rank] = hit
    return buffers


@without_gc
def precision_layout(destination: Layout, policy: DtypePolicy | str | None = None) -> Layout:
    """The destination as the engine holds it under ``policy`` (default :meth:`DtypePolicy.fp8`): kept
    tensors as they are, cast tensors' buffers in their dtype, FP8 tensors in float8_e4m3fn buffers
    plus their ``<name>_scale_inv`` tensors in ``<buffer>_scale_inv`` buffers (see module doc).

    >>> import reshard as rs
    >>> spec = rs.TensorSpec("w", (256, 384), torch.bfloat16)
    >>> eng = precision_layout(rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(0)]),
    ...                        DtypePolicy([("w", FP8Block())]))
    >>> eng.buffers(1)
    {'w': ((128, 384), torch.float8_e4m3fn), 'w_scale_inv': ((1, 3), torch.float32)}
    >>> [(p.tensor, p.offsets, p.sizes) for p in eng.pieces(1)]
    [('w', (128, 0), (128, 384)), ('w_scale_inv', (1, 0), (1, 3))]
    >>> precision_layout(rs.Layout.from_placements(spec, [0, 1, 2], (3,), [rs.Shard(0)]),
    ...                  DtypePolicy([("w", FP8Block())]))
    Traceback (most recent call last):
    ...
    reshard.tensors.LayoutError: tensor 'w': destination rank 0 holds box [0:86, 0:384], and its split at row 86 cuts through 128x128 blocks; block FP8 needs every destination piece to hold whole blocks at block boundaries of its buffer (vLLM's block-FP8 layers refuse such tensor-parallel splits too)
    """
    if not isinstance(destination, Layout):
        raise LayoutError(f"precision_layout: the destination must be a Layout, got {type(destination).__name__}")
    precisions = layout_precisions(destination, policy)
    _check_precisions(destination, precisions)
    by_buffer = _buffer_precisions(destination, precisions)
    specs, tables = _engine_tensors(destination, precisions)
    return Layout(specs, tables, _engine_buffers(destination, by_buffer), validate=None)


__all__ = ["check_whole_blocks", "precision_layout", "scale_table"]
