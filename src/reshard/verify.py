"""Deterministic test values for any box of any tensor, without materialising the model.

The value of element ``(i0, i1, ...)`` of tensor ``name`` is built from its bits::

    bits = (T0[i0] ^ T1[i1] ^ ...) & MASK        # one random table per (tensor, dim, seed)
    value = bits viewed as the tensor's dtype    # e.g. bf16 in (-1, 1)

``Td`` is a table of ``shape[d]`` random integers of the dtype's width, seeded by a
hash of the tensor name, the dim and the seed, and ``MASK`` keeps the sign and
mantissa and caps the exponent, so float values are finite and lie in (-1, 1)
(integers in 0..127, bools 0/1). Hence:

- any rank computes just the boxes it holds: slices of the tables and one
  broadcast XOR per dim, written straight into the buffer's view (hundreds of
  millions of elements per second per core, no model-sized scratch);
- a value depends on the tensor and on every coordinate, so misplaced,
  transposed, shifted, swapped or missing data shows up as mismatches (rare
  coincidences are possible: bf16 has ~32 k values in (-1, 1));
- values are defined in the tensor's logical dtype and cast to the buffer's
  (``Tensor.to``), so the expected value of a destination element is exactly what
  a sender-side cast of the source value gives (fp32 source -> bf16 destination).

``fill`` / ``fill_source`` give a rank's buffers filled with these values;
``check_destination`` compares a rank's destination buffers bit for bit.
"""

from __future__ import annotations

import math
import zlib
from functools import lru_cache
from typing import Mapping, Sequence

import torch

from .layout import Layout, box_str, buffer_view

SLAB = 1 << 22  # elements per step when a cast needs scratch memory
_MAX_REPORTED = 20
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# sign | exponent <= bias - 1 | mantissa: finite, |x| < 1
_FLOAT_MASKS = {torch.bfloat16: 0xBF7F, torch.float16: 0xBBFF, torch.float32: 0xBF7FFFFF,
                torch.float64: 0xBFEFFFFFFFFFFFFF}


def _bits_format(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(integer dtype the values are built in, mask) for a logical dtype."""
    if dtype in _FLOAT_MASKS:
        return _INT_OF_WIDTH[dtype.itemsize], _FLOAT_MASKS[dtype]
    if dtype.is_floating_point or dtype.is_complex:
        raise TypeError(f"reshard.verify: no test values for dtype {dtype}")
    if dtype == torch.bool:
        return torch.uint8, 1
    return (dtype if dtype != torch.uint8 else torch.uint8), 0x7F


def _signed(value: int, width_bytes: int) -> int:
    bits = 8 * width_bytes
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


@lru_cache(maxsize=4096)
def _dim_table(name: str, dim: int, n: int, seed: int, int_dtype: torch.dtype, mask: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}\0{name}\0{dim}".encode()))
    width = int_dtype.itemsize
    if int_dtype == torch.uint8:
        t = torch.randint(0, 256, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
    else:
        lo = -(1 << (8 * width - 1))
        t = torch.randint(lo, -lo - 1, (n,), generator=g, dtype=torch.int64).to(int_dtype)
    return t & _signed(mask, width) if int_dtype != torch.uint8 else t & mask


def _write_bits(tables: list[torch.Tensor], out_bits: torch.Tensor) -> None:
    """``out_bits[i0, i1, ...] = tables[0][i0] ^ tables[1][i1] ^ ...`` (broadcast, in place)."""
    nd = len(tables)
    if nd == 1:
        out_bits.copy_(tables[0])
        return
    shaped = [t.view((-1,) + (1,) * (nd - 1 - d)) for d, t in enumerate(tables)]
    if nd == 2:
        torch.bitwise_xor(shaped[0], shaped[1], out=out_bits)
        return
    out_bits.copy_(shaped[0].expand_as(out_bits))
    for t in shaped[1:]:
        out_bits.bitwise_xor_(t)


def values(name: str, shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], dtype: torch.dtype,
           seed: int = 0, out: torch.Tensor | None = None, *, logical_dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    """The test values of box ``offsets/sizes`` of tensor ``name`` (full shape ``shape``), in ``dtype``.

    ``logical_dtype`` is the tensor's own dtype (default ``dtype``): values are defined
    in it and cast to ``dtype``. Written into ``out`` (any view of the box's shape) if
    given, else into a new tensor.
    """
    shape, offsets, sizes = tuple(map(int, shape)), tuple(map(int, offsets)), tuple(map(int, sizes))
    logical = logical_dtype or dtype
    if out is None:
        out = torch.empty(sizes, dtype=dtype)
    if math.prod(sizes) == 0:
        return out
    int_dtype, mask = _bits_format(logical)
    dev = out.device
    tables = [_dim_table(name, d, n, seed, int_dtype, mask)[o:o + k].to(dev)
              for d, (n, o, k) in enumerate(zip(shape, offsets, sizes))]
    if not tables:  # 0-d tensor
        tables = [_dim_table(name, 0, 1, seed, int_dtype, mask).to(dev).view(())]

    def as_logical(bits: torch.Tensor) -> torch.Tensor:
        return bits.view(logical) if logical != torch.bool else bits != 0

    if out.dtype == logical and logical != torch.bool and (logical.is_floating_point or logical == int_dtype):
        _write_bits(tables, out.view(int_dtype) if logical != int_dtype else out)
        return out
    if len(sizes) == 0:
        out.copy_(as_logical(tables[0]))
        return out
    inner = math.prod(sizes[1:])
    rows = max(1, SLAB // max(inner, 1))
    for start in range(0, sizes[0], rows):
        stop = min(start + rows, sizes[0])
        scratch = torch.empty((stop - start,) + sizes[1:], dtype=int_dtype, device=dev)
        _write_bits([tables[0][start:stop]] + tables[1:], scratch)
        out[start:stop].copy_(as_logical(scratch))
    return out


def fill(layout: Layout, rank: int, device: torch.device | str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """``rank``'s buffers of ``layout`` with every piece holding its test values (in the buffer's dtype).

    Bytes of a buffer that no piece covers stay zero.
    """
    bufs = layout.empty_buffers(rank, device)
    for p in layout.pieces(rank):
        spec = layout.specs[p.tensor]
        view = buffer_view(bufs[p.buffer], p.buffer_offsets, p.sizes)
        values(p.tensor, spec.shape, p.offsets, p.sizes, view.dtype, seed, out=view, logical_dtype=spec.dtype)
    return bufs


def fill_source(layout: Layout, rank: int, device: torch.device | str = "cpu", seed: int = 0
                ) -> dict[str, torch.Tensor]:
    """Source buffers of ``rank`` ready for a refit: every piece filled (see :func:`fill`)."""
    return fill(layout, rank, device, seed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of the same width, so comparisons are bit-exact (NaN, -0.0)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(ints[t.element_size()]) if t.is_floating_point() else t


def check_destination(layout: Layout, rank: int, buffers: Mapping[str, torch.Tensor], seed: int = 0,
                      expected: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """Mismatches between ``rank``'s destination ``buffers`` and the test values, bit for bit.

    Returns one description per piece that differs (tensor name, rank, box, how many
    elements, where, first wrong value), ``[]`` when every piece is right.
    ``expected`` (from :func:`fill` on ``layout``) saves recomputing the values when
    checking the same rank several times.
    """
    out: list[str] = []
    for p in layout.pieces(rank):
        spec = layout.specs[p.tensor]
        buf = buffers.get(p.buffer)
        if buf is None:
            out.append(f"tensor {p.tensor!r} rank {rank}: box {box_str(p.offsets, p.sizes)}: buffer {p.buffer!r} "
                       f"missing")
            continue
        got = buffer_view(buf, p.buffer_offsets, p.sizes)
        if expected is not None:
            want = buffer_view(expected[p.buffer], p.buffer_offsets, p.sizes)
        else:
            want = values(p.tensor, spec.shape, p.offsets, p.sizes, got.dtype, seed,
                          out=torch.empty(p.sizes, dtype=got.dtype, device=got.device), logical_dtype=spec.dtype)
        gb, wb = _bits(got), _bits(want)
        if torch.equal(gb, wb):
            continue
        bad = gb != wb
        if bad.dim() > len(p.sizes):  # complex: real/imag pair
            bad = bad.any(dim=-1)
        where = bad.nonzero()
        lo = where.min(dim=0).values.tolist()
        hi = where.max(dim=0).values.tolist()
        first = tuple(where[0].tolist())
        glob = tuple(o + i for o, i in zip(p.offsets, first))
        sub = box_str([o + a for o, a in zip(p.offsets, lo)], [b - a + 1 for a, b in zip(lo, hi)])
        out.append(
            f"tensor {p.tensor!r} rank {rank}: box {box_str(p.offsets, p.sizes)} (buffer {p.buffer!r}): "
            f"{len(where)} of {got.numel()} elements differ, within {sub}; first at {glob}: "
            f"got {got[first].item()!r}, expected {want[first].item()!r}"
        )
        if len(out) >= _MAX_REPORTED:
            out.append(f"rank {rank}: stopped after {_MAX_REPORTED} mismatching pieces")
            break
    return out
