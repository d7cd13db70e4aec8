"""Block-grid geometry of an FP8 refit: which blocks some source rank holds whole, and which path each takes.

A 2-D tensor quantized in ``block = (bn, bk)`` blocks has a grid of ``ceil(rows / bn) x
ceil(cols / bk)`` blocks (the ``_scale_inv`` shape). Boxes here are either element boxes
(offsets, sizes) or grid boxes (lo, hi: block indices, hi exclusive). :func:`block_geometry`
splits the grid into rectangles a source piece covers with whole blocks (quantized at the source)
and the rest (crossing raw, quantized on the destination), and cuts each destination piece along
them. :class:`Fp8Tensor` is one FP8 tensor of a plan: its format, source dtype, geometry and the
names of its staging buffers.

Pure: no process group, no device.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ..layout import PieceTable, Repeated
from ..quant import MX_SCALE_SUFFIX, SCALE_SUFFIX, grid_shape
from .dtype_policy import FP8Block

FP8_STAGING = "@fp8/"  # source staging: <tensor>@fp8/<k>, <tensor>_scale_inv@fp8/<k>
RAW_SUFFIX = "@raw"  # the wire tensor of blocks crossing in the source's precision; staging <tensor>@raw/<k>


def whole_block_boxes(offsets: np.ndarray, sizes: np.ndarray, shape, block) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) grid boxes of the whole blocks inside element boxes (none: hi == lo). A partial edge
    block counts as whole when the box reaches the tensor's edge."""
    block_size = np.array(block, np.int64)
    extent = np.array(shape, np.int64)
    lo = -(-offsets // block_size)
    end = offsets + sizes
    hi = np.where(end >= extent, -(-extent // block_size), end // block_size)
    hi = np.maximum(hi, lo)
    empty = (sizes <= 0).any(axis=1)
    hi[empty] = lo[empty]
    return lo, hi


def element_boxes(grid_lo: np.ndarray, grid_hi: np.ndarray, shape, block) -> tuple[np.ndarray, np.ndarray]:
    """Element (offsets, sizes) of grid boxes (partial edge blocks clipped to ``shape``)."""
    block_size = np.array(block, np.int64)
    lo = grid_lo * block_size
    return lo, np.minimum(grid_hi * block_size, np.array(shape, np.int64)) - lo


def covered_cells(grid: tuple[int, int], lo: np.ndarray, hi: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """(cuts per dim, covered [cells]): the grid compressed at every box edge, and whether each cell
    of the compressed grid lies in some box (a 2-D difference array, summed)."""
    cuts = [np.unique(np.concatenate([[0, grid[d]], lo[:, d], hi[:, d]])) for d in (0, 1)]
    rows, cols = len(cuts[0]) - 1, len(cuts[1]) - 1
    diff = np.zeros((rows + 1, cols + 1), np.int64)
    row_lo, row_hi = np.searchsorted(cuts[0], lo[:, 0]), np.searchsorted(cuts[0], hi[:, 0])
    col_lo, col_hi = np.searchsorted(cuts[1], lo[:, 1]), np.searchsorted(cuts[1], hi[:, 1])
    np.add.at(diff, (row_lo, col_lo), 1)
    np.add.at(diff, (row_lo, col_hi), -1)
    np.add.at(diff, (row_hi, col_lo), -1)
    np.add.at(diff, (row_hi, col_hi), 1)
    return cuts, diff.cumsum(0).cumsum(1)[:rows, :cols] > 0


def _row_runs(row: np.ndarray) -> tuple[tuple[int, int, bool], ...]:
    """(start, end, covered) of each run of equal cells in one row of the compressed grid."""
    edges = np.flatnonzero(row[1:] != row[:-1]) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(row)]])
    return tuple(zip(starts.tolist(), ends.tolist(), row[starts].tolist()))


def regions(grid: tuple[int, int], lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint rectangles tiling ``grid``: (lo [m, 2], hi [m, 2], covered [m]) where ``covered`` says
    whether the rectangle lies in the union of the boxes ``lo``/``hi`` (by coordinate compression;
    consecutive rows with the same runs form one band)."""
    keep = (hi > lo).all(axis=1)
    cuts, covered = covered_cells(grid, lo[keep], hi[keep])
    rows = len(cuts[0]) - 1
    found: list[tuple[int, int, int, int, bool]] = []
    band_start, band_runs = 0, None
    for i in range(rows + 1):
        runs = _row_runs(covered[i]) if i < rows else None
        if runs == band_runs:
            continue
        if band_runs is not None:
            for start, end, value in band_runs:
                found.append((int(cuts[0][band_start]), int(cuts[1][start]), int(cuts[0][i]), int(cuts[1][end]),
                              bool(value)))
        band_start, band_runs = i, runs
    corners = np.array([rect[:4] for rect in found], np.int64).reshape(len(found), 4)
    return corners[:, :2], corners[:, 2:], np.array([rect[4] for rect in found], bool)


def intersect_boxes(box_lo: np.ndarray, box_hi: np.ndarray, rect_lo: np.ndarray, rect_hi: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Non-empty intersections of boxes with rectangles: (box index, rectangle index, lo, hi)."""
    lo = np.maximum(box_lo[:, None, :], rect_lo[None, :, :])
    hi = np.minimum(box_hi[:, None, :], rect_hi[None, :, :])
    box, rect = np.nonzero((hi > lo).all(axis=2))
    return box, rect, lo[box, rect], hi[box, rect]


class BlockGeometry(NamedTuple):
    """One FP8 tensor's block paths (shared by tensors of one geometry). Rows index piece tables; boxes
    are grid boxes."""

    grid: tuple[int, int]
    whole_rows: np.ndarray  # source piece rows that hold >= 1 whole block
    whole_lo: np.ndarray  # their whole-block grid boxes [k, 2]
    whole_hi: np.ndarray
    rect_lo: np.ndarray  # disjoint rectangles tiling the grid
    rect_hi: np.ndarray
    rect_covered: np.ndarray  # True: quantized at a source
    fp8_rows: np.ndarray  # destination piece of each FP8-path box
    fp8_lo: np.ndarray  # grid boxes [k, 2]
    fp8_hi: np.ndarray
    raw_rows: np.ndarray  # destination piece of each raw-path box
    raw_lo: np.ndarray
    raw_hi: np.ndarray


def block_geometry(shape, block, source: PieceTable, destination: PieceTable, *,
                   at_source: bool = True) -> BlockGeometry:
    """The block paths of one tensor from its source and destination pieces (see :class:`BlockGeometry`);
    ``at_source=False``: every block crosses raw and is quantized at the destination."""
    grid = grid_shape(shape, block)
    source_lo, source_hi = whole_block_boxes(source.offsets, source.sizes, shape, block)
    whole = np.flatnonzero((source_hi > source_lo).all(axis=1) if at_source else np.zeros(len(source_lo), bool))
    rect_lo, rect_hi, covered = regions(grid, source_lo[whole], source_hi[whole])
    block_size = np.array(block, np.int64)
    dest_lo = destination.offsets // block_size
    dest_hi = -(-(destination.offsets + destination.sizes) // block_size)
    live = np.flatnonzero((destination.sizes > 0).all(axis=1))
    piece, rect, lo, hi = intersect_boxes(dest_lo[live], dest_hi[live], rect_lo, rect_hi)
    piece = live[piece]
    fp8, raw = covered[rect], ~covered[rect]
    return BlockGeometry(grid, whole, source_lo[whole], source_hi[whole], rect_lo, rect_hi, covered,
                         piece[fp8], lo[fp8], hi[fp8], piece[raw], lo[raw], hi[raw])


def carried_tensor(wire_name: str) -> str:
    """The destination tensor a wire tensor carries part of: ``w`` for ``w``, ``w_scale_inv``, ``w_scale``
    (MXFP8's scales) and ``w@raw``."""
    for suffix in (RAW_SUFFIX, SCALE_SUFFIX, MX_SCALE_SUFFIX):
        if wire_name.endswith(suffix):
            return wire_name[: -len(suffix)]
    return wire_name


def staging_names(prefix: str, ranks: np.ndarray, cache: dict | None = None) -> tuple | Repeated:
    """``prefix + k`` for the k-th piece of each rank (``Repeated`` when every rank has one); ``cache``:
    a dict kept over many tensors, where the numbering of a ranks array they share is worked out once
    (the cache holds the arrays).

    >>> staging_names("w@raw/", np.array([3, 4, 3])), staging_names("w@raw/", np.array([3, 4]))
    (('w@raw/0', 'w@raw/0', 'w@raw/1'), ('w@raw/0',) * 2)
    """
    if cache is None:
        numbers = _staging_numbers(ranks)
    else:
        hit = cache.get(id(ranks))
        if hit is None:
            hit = cache[id(ranks)] = (ranks, _staging_numbers(ranks))
        numbers = hit[1]
    if numbers is None:
        return Repeated(f"{prefix}0", len(ranks))
    return tuple([f"{prefix}{k}" for k in numbers])


def _staging_numbers(ranks: np.ndarray) -> list[int] | None:
    """Each piece's place among its rank's pieces, None where every rank has one."""
    if len(np.unique(ranks)) == len(ranks):
        return None
    seen: dict[int, int] = defaultdict(int)
    out = []
    for rank in ranks.tolist():
        out.append(seen[rank])
        seen[rank] += 1
    return out


@dataclass
class Fp8Tensor:
    """One FP8 tensor of a :class:`~reshard.planning.precision.PrecisionPlan`: its format, its source
    dtype, block paths and staging buffers."""

    name: str
    precision: FP8Block
    source_dtype: torch.dtype  # the dtype raw blocks cross in, and the reference quantizer reads
    geometry: BlockGeometry
    # destination staging of each raw-path box (raw_ranks: their ranks)
    raw_names: tuple | Repeated = ()
    raw_ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    whole_names: tuple | Repeated = ()  # source staging names (fp8; scales: scale_name(...) of the tensor)
    whole_ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # with assembly (reshard.planning.fp8_assembly): the source pieces plus the assembled boxes, which
    # ``geometry``'s rows index; the boxes; their staging names
    source_table: PieceTable | None = None
    assembly: object | None = None
    assembly_names: tuple | Repeated = ()

    @property
    def block(self) -> tuple[int, int]:
        return self.precision.block

    @classmethod
    def of(cls, name: str, precision: FP8Block, source_dtype: torch.dtype, geometry: BlockGeometry,
           source: PieceTable, destination: PieceTable, shared: dict | None = None) -> "Fp8Tensor":
        """The tensor with its staging named: source staging where some destination box takes the FP8
        path, destination staging for each raw-path box. ``shared``: a dict kept over many tensors,
        where tensors alike (the same geometry and ranks arrays) share their rank arrays (read-only)
        and staging numbering."""
        info = cls(name, precision, source_dtype, geometry)
        if len(geometry.fp8_rows):
            info.whole_ranks = _ranks_of(source.ranks, geometry.whole_rows, shared)
            info.whole_names = staging_names(name + FP8_STAGING, info.whole_ranks, shared)
        if len(geometry.raw_rows):
            info.raw_ranks = _ranks_of(destination.ranks, geometry.raw_rows, shared)
            info.raw_names = staging_names(name + RAW_SUFFIX + "/", info.raw_ranks, shared)
        return info


def _ranks_of(ranks: np.ndarray, rows: np.ndarray, shared: dict | None) -> np.ndarray:
    """``ranks[rows]``, shared (read-only) by the tensors alike that ``shared`` has seen."""
    if shared is None:
        return ranks[rows]
    key = ("ranks", id(ranks), id(rows))
    hit = shared.get(key)
    if hit is None:
        picked = ranks[rows]
        picked.flags.writeable = False
        hit = shared[key] = (ranks, rows, picked)
    return hit[2]


__all__ = ["BlockGeometry", "FP8_STAGING", "Fp8Tensor", "RAW_SUFFIX", "block_geometry", "carried_tensor", "element_boxes",
           "intersect_boxes", "regions", "staging_names", "whole_block_boxes"]
