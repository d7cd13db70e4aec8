"""What each rank quantizes in an FP8 refit, before and after the transfer: plain-data tasks.

A :class:`QuantTask` quantizes one box of whole blocks from one buffer into an FP8 buffer and a
scale buffer. :func:`rank_quantization` gives a rank's :class:`RankQuantization`: ``source``
tasks (run before the wire plan's first phase: the whole blocks this rank sends, from its buffers
into its FP8 and scale staging) and ``destination`` tasks (run after the last phase: the raw
blocks this rank received, from its raw staging into the engine's FP8 weights and scales). An
executor runs them as they are (:mod:`reshard.execution.precision`).

Pure: no process group, no device.
"""

from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple

import numpy as np

from ..layout import Layout
from ..quant import MX_SCALE_SUFFIX, SCALE_SUFFIX, grid_shape
from .fp8_blocks import FP8_STAGING, Fp8Tensor, element_boxes
from .plan import RankPlan
from .schedule import Copy


class QuantTask(NamedTuple):
    """Quantize one box of whole blocks: read ``sizes`` elements at ``src_offsets`` of ``src_buffer``,
    write FP8 values at ``q_offsets`` of ``q_buffer`` and scales at ``s_offsets`` of ``s_buffer``."""

    tensor: str
    src_buffer: str
    src_offsets: tuple[int, ...]
    sizes: tuple[int, int]
    q_buffer: str
    q_offsets: tuple[int, ...]
    s_buffer: str
    s_offsets: tuple[int, ...]
    block: tuple[int, int]
    ue8m0: bool
    mx: bool = False  # MXFP8: E8M0 (uint8) scales by the OCP MX rule (reshard.quant.quantize_mx)

    @property
    def blocks(self) -> int:
        return int(np.prod(grid_shape(self.sizes, self.block)))


class RankQuantization(NamedTuple):
    """One rank's quantization: ``source`` before the transfer, ``destination`` after it."""

    source: tuple[QuantTask, ...] = ()
    destination: tuple[QuantTask, ...] = ()


def first_phase_reads(part: RankPlan) -> list[Copy]:
    """The copies of a rank's part of a phase that read its buffers: its sends and local copies."""
    return [copy for message in part.sends for copy in message.copies] + list(part.local)


def staged_tensor(fp8: Mapping[str, Fp8Tensor], base: str) -> tuple[str, bool] | None:
    """(FP8 tensor, whether scales) of a source staging buffer's base name, or None (not FP8 staging)."""
    if base in fp8:
        return base, False
    for suffix in (SCALE_SUFFIX, MX_SCALE_SUFFIX):
        name = base[: -len(suffix)]
        if base.endswith(suffix) and name in fp8 and fp8[name].precision.scale_suffix == suffix:
            return name, True
    return None


def _read_boxes(fp8: Mapping[str, Fp8Tensor], reads: Iterable[Copy]) -> dict[str, list]:
    """``{values staging name: [lo, hi]}``: the element box each FP8 staging buffer's reads span, values
    and scales alike (a scale read spans its blocks' elements)."""
    boxes: dict[str, list] = {}
    for copy in reads:
        base, sep, index = copy.src_buffer.rpartition(FP8_STAGING)
        staged = staged_tensor(fp8, base) if sep else None
        if staged is None:
            continue
        name, scale = staged
        block = fp8[name].block
        lo = [offset * (block[d] if scale else 1) for d, offset in enumerate(copy.src_offsets)]
        hi = [(offset + size) * (block[d] if scale else 1)
              for d, (offset, size) in enumerate(zip(copy.src_offsets, copy.sizes))]
        key = name + FP8_STAGING + index
        seen = boxes.get(key)
        boxes[key] = [lo, hi] if seen is None else [[min(a, x) for a, x in zip(seen[0], lo)],
                                                  [max(a, x) for a, x in zip(seen[1], hi)]]
    return boxes


def _staging_origin(source: Layout, info: Fp8Tensor, rank: int, key: str
                    ) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """(source buffer, buffer offsets of the staging box's first element, staging shape) of staging ``key``."""
    rows = np.flatnonzero(info.whole_ranks == rank)
    names = [info.whole_names[i] for i in rows.tolist()]
    row = int(rows[names.index(key)])
    geometry = info.geometry
    table = info.source_table if info.source_table is not None else source.tables[info.name]
    piece = int(geometry.whole_rows[row])
    lo, size = element_boxes(geometry.whole_lo[row:row + 1], geometry.whole_hi[row:row + 1],
                             source.specs[info.name].shape, info.block)
    origin = table.buffer_offsets[piece].copy()
    origin[-2:] += lo[0] - table.offsets[piece]
    return table.buffers[piece], tuple(origin.tolist()), tuple(size[0].tolist())


def source_tasks(fp8: Mapping[str, Fp8Tensor], source: Layout, rank: int, reads: Iterable[Copy]) -> list[QuantTask]:
    """What ``rank`` quantizes before the transfer: for each of its source staging buffers that the
    copies ``reads`` (its first phase's sends and local copies) read, the smallest box of whole blocks
    that covers what they read, values and scales alike (so each block is quantized once here)."""
    out = []
    for key, (lo, hi) in _read_boxes(fp8, reads).items():
        name, _, index = key.rpartition(FP8_STAGING)
        info = fp8[name]
        block = info.block
        src_buffer, origin, extent = _staging_origin(source, info, rank, key)
        lo = [x - x % size for x, size in zip(lo, block)]
        hi = [min(-(-x // size) * size, end) for x, size, end in zip(hi, block, extent)]
        sizes = (hi[0] - lo[0], hi[1] - lo[1])
        src_offsets = tuple(origin[:-2]) + tuple(o + x for o, x in zip(origin[-2:], lo))
        out.append(QuantTask(name, src_buffer, src_offsets, sizes, key, tuple(lo),
                             info.precision.scale_name(name) + FP8_STAGING + index,
                             (lo[0] // block[0], lo[1] // block[1]), block, info.precision.ue8m0, info.precision.mx))
    return out


def destination_tasks(fp8: Mapping[str, Fp8Tensor], destination: Layout, rank: int) -> list[QuantTask]:
    """What ``rank`` quantizes after the transfer: each raw staging buffer it received, into its FP8
    buffer and scale buffer (``destination``: the layout under the policy)."""
    out = []
    for name, info in fp8.items():
        rows = np.flatnonzero(info.raw_ranks == rank)
        if not len(rows):
            continue
        geometry = info.geometry
        values = destination.tables[name]
        scales = destination.tables[info.precision.scale_name(name)]
        pieces = geometry.raw_rows[rows]
        lo_all, size_all = element_boxes(geometry.raw_lo[rows], geometry.raw_hi[rows],
                                         destination.specs[name].shape, info.block)
        for row, piece, lo, size, grid_lo in zip(rows.tolist(), pieces.tolist(), lo_all.tolist(), size_all.tolist(),
                                                 geometry.raw_lo[rows].tolist()):
            q_offsets = values.buffer_offsets[piece].copy()
            q_offsets[-2:] += np.array(lo) - values.offsets[piece]
            s_offsets = scales.buffer_offsets[piece].copy()
            s_offsets[-2:] += np.array(grid_lo) - scales.offsets[piece]
            out.append(QuantTask(name, info.raw_names[row], (0, 0), tuple(size), values.buffers[piece],
                                 tuple(q_offsets.tolist()), scales.buffers[piece], tuple(s_offsets.tolist()),
                                 info.block, info.precision.ue8m0, info.precision.mx))
    return out


def rank_quantization(fp8: Mapping[str, Fp8Tensor], source: Layout, destination: Layout, rank: int,
                      reads: Iterable[Copy]) -> RankQuantization:
    """``rank``'s quantization tasks; ``reads``: the wire plan's copies that read its source buffers
    (each whole block they read is quantized once, before them)."""
    return RankQuantization(tuple(source_tasks(fp8, source, rank, reads)),
                            tuple(destination_tasks(fp8, destination, rank)))


__all__ = ["QuantTask", "RankQuantization", "destination_tasks", "first_phase_reads", "rank_quantization", "staged_tensor",
           "source_tasks"]
