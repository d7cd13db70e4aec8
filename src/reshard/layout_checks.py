"""Checks that a layout is well formed, each failure a :class:`~reshard.tensors.LayoutError` naming
the tensor, rank and box.

:func:`checked_piece` and :func:`checked_buffers` check what a caller hands to
``Layout.from_pieces``; :func:`check_layout` checks a whole layout (``Layout.validate``): every box
inside its tensor, every piece inside a declared buffer of its rank and of the tensor's dtype class,
no two pieces overlapping in one buffer. The layout comes as plain data (specs, piece tables,
buffers by rank), so this module needs no :class:`~reshard.layout.Layout`.

Vectorized: buffer shapes are looked up once per (buffer name, set of ranks), and overlaps are found
by sorting each buffer's pieces along their first dim and comparing only pieces whose first-dim
ranges meet.

Pure data: no process group, no device.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Protocol, Sequence

import numpy as np
import torch

from .tensors import LayoutError, Piece, TensorSpec, box_str, checked_int, checked_ints, dtype_class

BufferDescs = Mapping[int, Mapping[str, tuple[tuple[int, ...], torch.dtype]]]  # {rank: {buffer: (shape, dtype)}}


class Pieces(Protocol):
    """One tensor's pieces as arrays (a :class:`~reshard.layout.PieceTable`)."""

    ranks: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    buffers: Sequence[str]
    buffer_offsets: np.ndarray


def checked_piece(piece: Piece, specs: Mapping[str, TensorSpec]) -> Piece:
    """``piece`` with plain int fields, or :class:`LayoutError` naming the tensor and what is not an
    integer (a float, even 2.0, or a bool), a negative rank, a tensor no spec names, or a box or
    buffer offsets with the wrong number of dims."""
    rank = checked_int(piece.rank, f"tensor {piece.tensor!r}: piece rank", minimum=0)
    where = f"tensor {piece.tensor!r} rank {rank}:"
    piece = Piece(piece.tensor, checked_ints(piece.offsets, f"{where} box offsets"),
                  checked_ints(piece.sizes, f"{where} box sizes"), piece.buffer,
                  checked_ints(piece.buffer_offsets, f"{where} buffer offsets"), rank)
    if piece.tensor not in specs:
        raise LayoutError(
            f"unknown tensor {piece.tensor!r}: rank {piece.rank} holds box {box_str(piece.offsets, piece.sizes)} "
            f"in buffer {piece.buffer!r} but no TensorSpec names it"
        )
    ndim = len(specs[piece.tensor].shape)
    if len(piece.offsets) != ndim or len(piece.sizes) != ndim:
        raise LayoutError(
            f"tensor {piece.tensor!r} rank {piece.rank}: box {box_str(piece.offsets, piece.sizes)} has "
            f"{len(piece.offsets)} dims, tensor has {ndim}"
        )
    if len(piece.buffer_offsets) < ndim:
        raise LayoutError(
            f"tensor {piece.tensor!r} rank {piece.rank}: buffer {piece.buffer!r} offsets {piece.buffer_offsets} "
            f"have fewer dims than the tensor ({ndim})"
        )
    return piece


def checked_buffers(buffers: Mapping | None) -> dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """``{rank: {name: (shape, dtype)}}`` with plain int ranks and shapes, or :class:`LayoutError` for a
    negative or non-integer rank or size, or a dtype that is not a ``torch.dtype``."""
    out: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]] = defaultdict(dict)
    for rank, named in (buffers or {}).items():
        rank = checked_int(rank, "buffers: rank", minimum=0)
        for name, (shape, dtype) in named.items():
            if not isinstance(dtype, torch.dtype):
                raise LayoutError(f"rank {rank} buffer {name!r}: dtype must be a torch.dtype, got {dtype!r}")
            out[rank][name] = (checked_ints(shape, f"rank {rank} buffer {name!r}: shape", minimum=0), dtype)
    return out


def _check_boxes(name: str, spec: TensorSpec, table: Pieces, passed: dict | None = None) -> None:
    """Every piece on a rank >= 0 and its box inside the tensor; ``passed``: a dict kept over one check,
    where tables of the same arrays (tensors alike share them) and shape are checked once (it holds
    the arrays)."""
    if passed is not None:
        key = ("boxes", id(table.ranks), id(table.offsets), id(table.sizes), spec.shape)
        if key in passed:
            return
        _check_boxes(name, spec, table)
        passed[key] = (table.ranks, table.offsets, table.sizes)
        return
    if table.ranks.min() < 0:
        row = int(np.argmin(table.ranks))
        raise LayoutError(f"tensor {name!r} rank {int(table.ranks[row])}: box "
                          f"{box_str(table.offsets[row], table.sizes[row])} is on a negative rank (ranks must be >= 0)")
    shape = np.array(spec.shape, np.int64)
    outside = ((table.offsets < 0) | (table.sizes < 0) | (table.offsets + table.sizes > shape)).any(axis=1)
    bad = np.flatnonzero(outside)
    if len(bad):
        row = int(bad[0])
        raise LayoutError(
            f"tensor {name!r} rank {int(table.ranks[row])}: box {box_str(table.offsets[row], table.sizes[row])} lies "
            f"outside the tensor's shape {spec.shape}"
        )


def _buffer_shapes(buffers: BufferDescs, cache: dict, buffer: str, ranks: np.ndarray, tensor: str):
    """(sorted ranks, their shapes of ``buffer`` [n, ndim], their dtypes), cached."""
    key = (buffer, ranks.tobytes())
    hit = cache.get(key)
    if hit is None:
        distinct = np.unique(ranks)
        descs = []
        for rank in distinct.tolist():
            desc = buffers.get(rank, {}).get(buffer)
            if desc is None:
                raise LayoutError(f"tensor {tensor!r} rank {rank}: buffer {buffer!r} is not declared on that rank")
            descs.append(desc)
        ndims = {len(shape) for shape, _ in descs}
        if len(ndims) > 1:
            raise LayoutError(f"buffer {buffer!r} has different numbers of dims on different ranks")
        shapes = np.array([shape for shape, _ in descs], np.int64).reshape(len(descs), ndims.pop())
        hit = cache[key] = (distinct, shapes, [dtype for _, dtype in descs])
    return hit


class _Extents:
    """The live pieces' buffer extents, grouped by buffer-offset width: for each width (keys: rank and
    buffer code, lows, highs, (table index, count) runs, piece rows)."""

    def __init__(self) -> None:
        self.by_width: dict[int, tuple[list, list, list, list, list]] = defaultdict(lambda: ([], [], [], [], []))
        self.codes: dict[str, int] = {}

    def add(self, table_index: int, table: Pieces, buffer: str, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray
            ) -> None:
        live = rows[(table.sizes[rows] > 0).all(axis=1)]
        keys, los, his, runs, pieces = self.by_width[lo.shape[1]]
        keys.append(table.ranks[live] * (1 << 24) + self.codes.setdefault(buffer, len(self.codes)))
        los.append(lo[live])
        his.append(hi[live])
        runs.append((table_index, len(live)))
        pieces.append(live)


def _check_buffers_of(name: str, spec: TensorSpec, table: Pieces, table_index: int, buffers: BufferDescs,
                      looked_up: dict, extents: _Extents) -> None:
    """Each of ``name``'s buffers declared on its ranks, of the tensor's dtype class, with the pieces'
    number of dims, and holding its pieces; the pieces' extents go to ``extents``."""
    count, buffer_ndim = len(table), table.buffer_offsets.shape[1]
    lo = table.buffer_offsets
    hi = _buffer_ends(table, looked_up)  # tables alike share these arrays: their ends worked out once
    one = table.one_buffer()
    names = [one] if one is not None else list(dict.fromkeys(table.buffers))
    for buffer in names:
        rows = np.arange(count) if len(names) == 1 else np.flatnonzero(np.array(table.buffers, object) == buffer)
        ranks = table.ranks[rows]
        found = _buffer_shapes(buffers, looked_up, buffer, ranks, name)
        distinct, shapes, dtypes = found
        if ("class", id(found), dtype_class(spec.dtype)) not in looked_up:
            for rank, dtype in zip(distinct.tolist(), dtypes):
                if dtype_class(dtype) != dtype_class(spec.dtype):
                    raise LayoutError(f"tensor {name!r} rank {rank}: buffer {buffer!r} has dtype {dtype}, "
                                      f"of another class than the tensor's {spec.dtype}")
            looked_up[("class", id(found), dtype_class(spec.dtype))] = found
        if shapes.shape[1] != buffer_ndim:
            raise LayoutError(f"tensor {name!r} rank {int(distinct[0])}: buffer {buffer!r} has {shapes.shape[1]} "
                              f"dims but the piece's buffer offsets have {buffer_ndim}")
        shape_of_piece = shapes[np.searchsorted(distinct, ranks)]
        fits_key = ("fits", id(lo), id(hi), len(names), shape_of_piece.tobytes())
        if fits_key in looked_up:  # tables alike in buffers of the same shapes: checked already
            extents.add(table_index, table, buffer, rows, lo, hi)
            continue
        out = np.flatnonzero(((lo[rows] < 0) | (hi[rows] > shape_of_piece)).any(axis=1))
        if not len(out) and len(names) == 1:
            looked_up[fits_key] = (lo, hi)
        if len(out):
            row = int(rows[out[0]])
            raise LayoutError(
                f"tensor {name!r} rank {int(table.ranks[row])}: box {box_str(table.offsets[row], table.sizes[row])} "
                f"placed at {tuple(lo[row].tolist())} does not fit buffer {buffer!r} of shape "
                f"{tuple(shape_of_piece[out[0]].tolist())}"
            )
        extents.add(table_index, table, buffer, rows, lo, hi)


def check_layout(specs: Mapping[str, TensorSpec], tables: Mapping[str, Pieces], buffers: BufferDescs) -> None:
    """Raise :class:`LayoutError` for a negative rank, a box outside its tensor, a piece outside its
    buffer, two pieces overlapping in one buffer, or a piece whose buffer has the wrong dtype class.

    A layout that passes is seen in a few numpy passes over all its pieces (:func:`_passes_at_once`);
    one that may not is looked at again tensor by tensor, which names the first fault in table order."""
    negative = [rank for rank in buffers if rank < 0]
    if negative:
        raise LayoutError(f"rank {negative[0]}: ranks must be >= 0 (it declares buffers "
                          f"{', '.join(map(repr, buffers[negative[0]]))})")
    if not _passes_at_once(specs, tables, buffers):
        check_each(specs, tables, buffers)


def check_each(specs: Mapping[str, TensorSpec], tables: Mapping[str, Pieces], buffers: BufferDescs) -> None:
    """:func:`check_layout` tensor by tensor (the first fault in table order, named), without the look at
    all pieces at once (or the check of the buffers' ranks)."""
    looked_up: dict[tuple[str, bytes], tuple] = {}
    extents = _Extents()
    for table_index, (name, table) in enumerate(tables.items()):
        spec = specs.get(name)
        if spec is None:
            raise LayoutError(f"unknown tensor {name!r}: pieces refer to it but no TensorSpec names it")
        if not len(table):
            continue
        _check_boxes(name, spec, table, looked_up)
        _check_buffers_of(name, spec, table, table_index, buffers, looked_up, extents)
    if extents.by_width:
        _check_overlaps(tables, extents.by_width)


def _buffer_ends(table: Pieces, cache: dict) -> np.ndarray:
    """Where each piece ends in its buffer (exclusive; leading buffer dims one element), worked out once
    per arrays that tables alike share (``cache`` holds them)."""
    lo = table.buffer_offsets
    key = ("hi", id(lo), id(table.sizes))
    hit = cache.get(key)
    if hit is None:
        count, ndim = table.sizes.shape
        hi = lo + np.concatenate([np.ones((count, lo.shape[1] - ndim), np.int64), table.sizes], axis=1)
        hit = cache[key] = (lo, table.sizes, hi)
    return hit[2]


class _Columns:
    """Every piece of one buffer-offset width, table after table: ranks, buffer codes, dtype-class codes,
    buffer extents (lists of arrays, joined once)."""

    def __init__(self) -> None:
        self.ranks, self.lo, self.hi = [], [], []
        self.tables, self.counts, self.codes, self.classes = [], [], [], []  # per table (code -1: several)
        self.several: list[tuple[int, np.ndarray]] = []  # (first row, buffer code of each piece)
        self.rows = 0


def _passes_at_once(specs: Mapping[str, TensorSpec], tables: Mapping[str, Pieces], buffers: BufferDescs) -> bool:
    """Whether :func:`check_layout` finds nothing, seen over all pieces at once: each (rank, buffer) of
    any piece looked up once, the pieces' buffer dims, dtype classes and extents compared as arrays,
    overlaps found as :func:`_check_overlaps` finds them. False where anything may be wrong (the caller
    then names it), never where something is."""
    passed: dict = {}
    codes: dict[str, int] = {}
    classes: dict[str, int] = {}
    columns: dict[int, _Columns] = defaultdict(_Columns)
    for table_index, (name, table) in enumerate(tables.items()):
        spec = specs.get(name)
        if spec is None:
            return False
        if not len(table):
            continue
        try:
            _check_boxes(name, spec, table, passed)
        except LayoutError:
            return False
        lo = table.buffer_offsets
        col = columns[lo.shape[1]]
        one = table.one_buffer()
        if one is not None:
            col.codes.append(codes.setdefault(one, len(codes)))
        else:
            col.codes.append(-1)
            col.several.append((col.rows, np.array([codes.setdefault(b, len(codes)) for b in table.buffers],
                                                   np.int64)))
        col.ranks.append(table.ranks)
        col.lo.append(lo)
        col.hi.append(_buffer_ends(table, passed))
        col.tables.append(table_index)
        col.counts.append(len(table))
        col.classes.append(classes.setdefault(dtype_class(spec.dtype), len(classes)))
        col.rows += len(table)
    if len(codes) >= 1 << 24:
        return False
    names = list(codes)
    by_width: dict[int, tuple[list, list, list, list, list]] = {}
    for width, col in columns.items():
        counts = np.array(col.counts, np.int64)
        buffer_code = np.repeat(np.array(col.codes, np.int64), counts)
        for start, per_piece in col.several:
            buffer_code[start:start + len(per_piece)] = per_piece
        ranks = np.concatenate(col.ranks)
        keys = ranks * (1 << 24) + buffer_code
        pairs, inv = np.unique(keys, return_inverse=True)
        pair_ndim = np.zeros(len(pairs), np.int64)
        pair_class = np.zeros(len(pairs), np.int64)
        pair_shape = np.zeros((len(pairs), width), np.int64)
        for i, key in enumerate(pairs.tolist()):
            desc = buffers.get(key >> 24, {}).get(names[key & ((1 << 24) - 1)])
            if desc is None:
                return False
            shape, dtype = desc
            pair_ndim[i] = len(shape)
            pair_class[i] = classes.get(dtype_class(dtype), -1)
            if len(shape) == width:
                pair_shape[i] = shape
        inv = inv.reshape(-1)
        lo, hi = np.concatenate(col.lo), np.concatenate(col.hi)
        if ((pair_ndim[inv] != width).any() or (pair_class[inv] != np.repeat(np.array(col.classes), counts)).any()
                or (lo < 0).any() or (hi > pair_shape[inv]).any()):
            return False
        live = (hi > lo).all(axis=1)  # every size > 0 (the leading buffer dims: one element)
        starts = np.cumsum(counts) - counts
        row_in_table = np.arange(col.rows) - np.repeat(starts, counts)
        live_counts = np.add.reduceat(live.astype(np.int64), starts) if len(starts) else counts
        by_width[width] = ([keys[live]], [lo[live]], [hi[live]], list(zip(col.tables, live_counts.tolist())),
                           [row_in_table[live]])
    return not by_width or _first_overlap(*_sorted_extents(by_width)[:3]) is None


def _sorted_extents(by_width: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(keys, lows, highs, (table, piece) refs) of every live piece, padded to one width and sorted by
    buffer, then first-dim start (a 0-d tensor's pieces: one slot along a pretend dim)."""
    width = max(max(by_width), 1)
    parts = []
    for piece_width, (keys, los, his, runs, pieces) in by_width.items():
        lo, hi = np.concatenate(los), np.concatenate(his)
        refs = np.stack([np.repeat([table for table, _ in runs], [count for _, count in runs]),
                         np.concatenate(pieces)], axis=1)
        parts.append((np.concatenate(keys), np.pad(lo, ((0, 0), (0, width - piece_width))),
                      np.pad(hi, ((0, 0), (0, width - piece_width)), constant_values=1), refs))
    keys = np.concatenate([part[0] for part in parts])
    lo = np.concatenate([part[1] for part in parts])
    hi = np.concatenate([part[2] for part in parts])
    refs = np.concatenate([part[3] for part in parts])
    order = np.lexsort((lo[:, 0], keys))
    return keys[order], lo[order], hi[order], refs[order]


def _first_overlap(keys: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[int, int] | None:
    """The first two of these sorted extents (:func:`_sorted_extents`) that overlap in one buffer, or None."""
    group = np.concatenate([[0], np.cumsum(keys[1:] != keys[:-1])]) << 40
    # pieces after i in its buffer whose first-dim start lies before i's first-dim end
    reach = np.searchsorted(group + lo[:, 0], group + hi[:, 0], "left") - np.arange(len(keys)) - 1
    for step in range(1, int(reach.max(initial=0)) + 1):
        first = np.flatnonzero(reach >= step)
        second = first + step
        hit = first[((lo[first] < hi[second]) & (lo[second] < hi[first])).all(axis=1)]
        if len(hit):
            return int(hit[0]), int(hit[0]) + step
    return None


def _check_overlaps(tables: Mapping[str, Pieces], by_width: dict) -> None:
    """LayoutError naming the first two pieces that overlap in one buffer of one rank."""
    keys, lo, hi, refs = _sorted_extents(by_width)
    found = _first_overlap(keys, lo, hi)
    if found is not None:
        _raise_overlap(tables, refs[found[0]].tolist(), refs[found[1]].tolist())


def _raise_overlap(tables: Mapping[str, Pieces], first: list[int], second: list[int]) -> None:
    names = list(tables)
    (table_1, row_1), (table_2, row_2) = first, second
    name_1, name_2 = names[table_1], names[table_2]
    pieces_1, pieces_2 = tables[name_1], tables[name_2]
    raise LayoutError(
        f"rank {int(pieces_1.ranks[row_1])} buffer {pieces_1.buffers[row_1]!r}: piece of {name_1!r} box "
        f"{box_str(pieces_1.offsets[row_1], pieces_1.sizes[row_1])} at "
        f"{tuple(pieces_1.buffer_offsets[row_1].tolist())} overlaps piece of {name_2!r} box "
        f"{box_str(pieces_2.offsets[row_2], pieces_2.sizes[row_2])} at "
        f"{tuple(pieces_2.buffer_offsets[row_2].tolist())}"
    )


__all__ = ["check_layout", "checked_buffers", "checked_piece"]
