"""Deterministic test values for any box of any tensor, without materialising the model.

The value of element ``(i0, i1, ...)`` of tensor ``name`` is built from its bits::

    bits = ((T0[i0] ^ T1[i1] ^ ...) & KEEP) | SET   # one random table per (tensor, dim, seed)
    value = bits viewed as the tensor's dtype       # e.g. bf16

``Td`` is a table of ``shape[d]`` random integers of the dtype's width, seeded by a
hash of the tensor name, the dim and the seed. For floats ``KEEP`` keeps the sign,
the mantissa and the two low exponent bits and ``SET`` fixes the others, so every
value is a normal number with 2^-7 <= |x| < 2^-3, like a weight (integers lie in
0..127, bools are 0/1). Hence:

- any rank computes just the boxes it holds: slices of the tables and one
  broadcast XOR per dim, written straight into the buffer's view (hundreds of
  millions of elements per second per core, no model-sized scratch);
- a value depends on the tensor and on every coordinate, so misplaced,
  transposed, shifted or swapped data shows up as mismatches; zero is never a
  value, so elements left unwritten always do. A single element replaced by
  another value of the same set (1024 of them in bf16) escapes with odds of
  about 1 in 1000; a wrong row or box does not;
- values are defined in the tensor's logical dtype and cast to the buffer's
  (``Tensor.to``), so the expected value of a destination element is exactly what
  a sender-side cast of the source value gives (fp32 source -> bf16 destination).

``fill`` / ``fill_source`` give a rank's buffers filled with these values;
``check_destination`` compares a rank's destination buffers bit for bit, slab by
slab, without a second copy of them.
"""

from __future__ import annotations

import math
import zlib
from functools import lru_cache
from typing import Mapping, Sequence

import torch

from .layout import Layout
from .tensors import box_str, buffer_view

SLAB = 1 << 22  # elements per step where scratch memory is needed (casts, checking)
_MAX_REPORTED = 20
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# (mantissa bits, exponent bits, exponent bias) of the float formats
_FLOAT_FORMATS = {torch.bfloat16: (7, 8, 127), torch.float16: (10, 5, 15), torch.float32: (23, 8, 127),
                  torch.float64: (52, 11, 1023)}


def _bits_format(dtype: torch.dtype) -> tuple[torch.dtype, int, int]:
    """(integer dtype the values are built in, KEEP, SET) for a logical dtype (see module doc)."""
    if dtype in _FLOAT_FORMATS:
        mant, exp, bias = _FLOAT_FORMATS[dtype]
        sign = 1 << (mant + exp)
        keep = sign | (3 << mant) | ((1 << mant) - 1)  # sign, 2 low exponent bits, mantissa
        return _INT_OF_WIDTH[dtype.itemsize], keep, (bias - 7) << mant  # exponent in bias-7 .. bias-4
    if dtype.is_floating_point or dtype.is_complex:
        raise TypeError(f"reshard.verify: no test values for dtype {dtype}")
    if dtype == torch.bool:
        return torch.uint8, 1, 0
    return dtype, 0x7F, 0


def _signed(value: int, width_bytes: int) -> int:
    bits = 8 * width_bytes
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


@lru_cache(maxsize=4096)
def _dim_table(name: str, dim: int, n: int, seed: int, int_dtype: torch.dtype, keep: int, set_bits: int
               ) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}\0{name}\0{dim}".encode()))
    width = int_dtype.itemsize
    if int_dtype == torch.uint8:
        t = torch.randint(0, 256, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
    else:
        lo = -(1 << (8 * width - 1))
        t = torch.randint(lo, -lo - 1, (n,), generator=g, dtype=torch.int64).to(int_dtype)
    if int_dtype == torch.uint8:
        return (t & keep) | set_bits
    return (t & _signed(keep, width)) | _signed(set_bits, width)


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
    int_dtype, keep, set_bits = _bits_format(logical)
    dev = out.device
    # SET goes into dim 0's table only: the others have zeros there, so the XOR keeps it
    tables = [_dim_table(name, d, n, seed, int_dtype, keep, set_bits if d == 0 else 0)[o:o + k].to(dev)
              for d, (n, o, k) in enumerate(zip(shape, offsets, sizes))]
    if not tables:  # 0-d tensor
        tables = [_dim_table(name, 0, 1, seed, int_dtype, keep, set_bits).to(dev).view(())]

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
    return t.view(_INT_OF_WIDTH[t.element_size()]) if t.is_floating_point() else t


def check_destination(layout: Layout, rank: int, buffers: Mapping[str, torch.Tensor], seed: int = 0
                      ) -> list[str]:
    """Mismatches between ``rank``'s destination ``buffers`` and the test values, bit for bit.

    Returns one description per piece that differs (tensor name, rank, box, how many
    elements, the box that holds them, the first wrong value), ``[]`` when every piece
    is right. Expected values are computed slab by slab into one small scratch tensor,
    so checking needs no second copy of the buffers.
    """
    out: list[str] = []
    scratch: dict[torch.dtype, torch.Tensor] = {}
    for p in layout.pieces(rank):
        spec = layout.specs[p.tensor]
        buf = buffers.get(p.buffer)
        if buf is None:
            out.append(f"tensor {p.tensor!r} rank {rank}: box {box_str(p.offsets, p.sizes)}: buffer {p.buffer!r} "
                       f"was not given")
            continue
        got = buffer_view(buf, p.buffer_offsets, p.sizes)
        bad = _compare_piece(p, spec, got, seed, scratch)
        if bad is None:
            continue
        count, lo, hi, first, got_v, want_v = bad
        glob = tuple(o + i for o, i in zip(p.offsets, first))
        sub = box_str([o + a for o, a in zip(p.offsets, lo)], [b - a + 1 for a, b in zip(lo, hi)])
        out.append(
            f"tensor {p.tensor!r} rank {rank}: box {box_str(p.offsets, p.sizes)} (buffer {p.buffer!r}): "
            f"{count} of {got.numel()} elements differ, within {sub}; first at {glob}: "
            f"got {got_v!r}, expected {want_v!r}"
        )
        if len(out) >= _MAX_REPORTED:
            out.append(f"rank {rank}: stopped after {_MAX_REPORTED} mismatching pieces")
            break
    return out


def _compare_piece(p, spec, got: torch.Tensor, seed: int, scratch: dict):
    """``None`` if the piece holds its test values, else (count, lo, hi, first, got, expected)."""
    sizes = tuple(p.sizes)
    if got.numel() == 0:
        return None
    inner = math.prod(sizes[1:])
    rows = max(1, SLAB // max(inner, 1)) if sizes else 1
    count, lo, hi, first, pair = 0, None, None, None, None
    for start in range(0, sizes[0] if sizes else 1, rows):
        stop = min(start + rows, sizes[0]) if sizes else 1
        shape = ((stop - start,) + sizes[1:]) if sizes else ()
        n = math.prod(shape)
        buf = scratch.get(got.dtype)
        if buf is None or buf.numel() < n:
            buf = scratch[got.dtype] = torch.empty(max(n, SLAB), dtype=got.dtype, device=got.device)
        want = buf[:n].view(shape)
        offs = tuple(p.offsets)
        if sizes:
            offs = (offs[0] + start,) + offs[1:]
        values(p.tensor, spec.shape, offs, shape, got.dtype, seed, out=want, logical_dtype=spec.dtype)
        part = got[start:stop] if sizes else got
        gb, wb = _bits(part), _bits(want)
        if torch.equal(gb, wb):
            continue
        where = (gb != wb).nonzero()
        if sizes:
            where[:, 0] += start
        count += len(where)
        wlo, whi = where.min(dim=0).values.tolist(), where.max(dim=0).values.tolist()
        lo = wlo if lo is None else [min(a, b) for a, b in zip(lo, wlo)]
        hi = whi if hi is None else [max(a, b) for a, b in zip(hi, whi)]
        if first is None:
            first = tuple(where[0].tolist())
            local = ((first[0] - start,) + first[1:]) if sizes else ()
            pair = (part[local].item(), want[local].item())
    if count == 0:
        return None
    return count, lo, hi, first, pair[0], pair[1]
