"""Blocks assembled before they cross: where no source rank holds a block whole, one domain's ranks hand it to one of them.

FSDP cuts every weight into row pieces, often under a block's 128 rows, so no source rank holds a
whole 128 x 128 block and every block would cross the network in BF16 (and be quantized on each
destination). Where the source ranks of one NVLink domain together hold a block row (every element
of it), :func:`assembly_boxes` picks one of them, the *assembler*, to receive the others' rows
first (a local phase of the plan, intra-domain); the assembler then holds the block whole, quantizes
it and sends FP8 plus scales, like a source that held it from the start. FSDP over 8 ranks of one
domain, 32 rows each, 256 rows (two block rows of 128)::

    rank   rows      block row 0 [0:128)          block row 1 [128:256)
    0      0:32      sends rows 0:32 to rank 1    -
    1      32:64     assembler: holds 0:128       -
    2..3   64:128    send their rows to rank 1    -
    4      128:160   -                            assembler (the least loaded of 4..7)
    ...

A block row that only ranks of several domains cover together is not assembled (it crosses raw,
quantized at the destination, as before). The assembler of a block row is the rank of the covering
domain that holds part of it with the fewest assembled bytes so far (ties: the most of the row, then
the lowest rank), so assembly staging spreads over the domain's ranks: about a rank's own share of
the tensor. Element boxes throughout (offsets, sizes).

Pure: no process group, no device.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import numpy as np

from ..layout import PieceTable
from ..quant import grid_shape
from .fp8_blocks import covered_cells, regions, whole_block_boxes

ASM_SUFFIX = "@asm"  # the wire tensor of the assembly phase; assembler staging <tensor>@asm/<k>


class AssemblyBoxes(NamedTuple):
    """The block rows one tensor's sources assemble: one element box each, with its assembler and domain."""

    ranks: np.ndarray  # assembler of each box [k]
    domains: np.ndarray  # its domain [k]
    offsets: np.ndarray  # element boxes [k, 2]
    sizes: np.ndarray

    @classmethod
    def empty(cls) -> "AssemblyBoxes":
        z = np.zeros((0, 2), np.int64)
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), z, z.copy())


def _covers(lo: np.ndarray, hi: np.ndarray, size: tuple[int, int]) -> bool:
    """Whether the boxes (lo, hi: relative to a box of ``size``, clipped to it) cover all of it."""
    if not len(lo):
        return False
    cuts, covered = covered_cells(size, lo, hi)
    return bool(covered.all()) and cuts[0][0] == 0 and cuts[1][0] == 0


def assembly_boxes(shape, block, source: PieceTable, domain_of: Mapping[int, int]) -> AssemblyBoxes:
    """The block rows of a tensor (``shape``, ``block``) that no source piece holds whole but the pieces
    of one domain cover (``domain_of``: source rank -> domain; ranks missing from it assemble nothing),
    one box per block row of each uncovered grid rectangle, with its assembler (see module doc).

    >>> import torch, reshard as rs
    >>> spec = rs.TensorSpec("w", (256, 128), torch.bfloat16)
    >>> src = rs.Layout.from_placements(spec, list(range(8)), (8,), [rs.Shard(0)])   # 32 rows a rank
    >>> a = assembly_boxes(spec.shape, (128, 128), src.tables["w"], {r: r // 8 for r in range(8)})
    >>> a.ranks.tolist(), a.offsets.tolist(), a.sizes.tolist()
    ([0, 4], [[0, 0], [128, 0]], [[128, 128], [128, 128]])
    >>> assembly_boxes(spec.shape, (128, 128), src.tables["w"], {r: r // 2 for r in range(8)}).ranks.tolist()
    []
    """
    if not len(source) or source.buffer_offsets.shape[1] != 2 or len(shape) != 2:
        return AssemblyBoxes.empty()  # pieces in buffers of other ranks than 2 are not assembled
    grid = grid_shape(shape, block)
    lo, hi = whole_block_boxes(source.offsets, source.sizes, shape, block)
    whole = (hi > lo).all(axis=1)
    rect_lo, rect_hi, covered = regions(grid, lo[whole], hi[whole])
    ranks = source.ranks.astype(np.int64)
    domains = np.array([domain_of.get(int(r), -1) for r in ranks.tolist()], np.int64)
    p_lo, p_hi = source.offsets, source.offsets + source.sizes
    extent = np.array(shape, np.int64)
    bn, bk = block
    load: dict[int, int] = {}
    out_ranks, out_domains, out_lo, out_size = [], [], [], []
    for r_lo, r_hi in zip(rect_lo[~covered].tolist(), rect_hi[~covered].tolist()):
        c0, c1 = r_lo[1] * bk, min(r_hi[1] * bk, int(extent[1]))
        for i in range(r_lo[0], r_hi[0]):
            b_lo = np.array([i * bn, c0], np.int64)
            b_hi = np.array([min((i + 1) * bn, int(extent[0])), c1], np.int64)
            size = tuple((b_hi - b_lo).tolist())
            lo_c, hi_c = np.maximum(p_lo, b_lo), np.minimum(p_hi, b_hi)
            hit = np.flatnonzero((hi_c > lo_c).all(axis=1) & (domains >= 0))
            if not len(hit):
                continue
            for d in np.unique(domains[hit]).tolist():
                mine = hit[domains[hit] == d]
                if not _covers(lo_c[mine] - b_lo, hi_c[mine] - b_lo, size):
                    continue
                held: dict[int, int] = {}
                for k in mine.tolist():
                    r = int(ranks[k])
                    held[r] = held.get(r, 0) + int(np.prod(hi_c[k] - lo_c[k]))
                rank = min(held, key=lambda r: (load.get(r, 0), -held[r], r))
                load[rank] = load.get(rank, 0) + size[0] * size[1]
                out_ranks.append(rank)
                out_domains.append(d)
                out_lo.append(b_lo)
                out_size.append(b_hi - b_lo)
                break
    if not out_ranks:
        return AssemblyBoxes.empty()
    return AssemblyBoxes(np.array(out_ranks, np.int64), np.array(out_domains, np.int64),
                         np.array(out_lo, np.int64).reshape(-1, 2), np.array(out_size, np.int64).reshape(-1, 2))


__all__ = ["ASM_SUFFIX", "AssemblyBoxes", "assembly_boxes"]
