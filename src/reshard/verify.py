"""Deterministic test values for any box of any tensor, without materialising the model.

Element ``i`` (row-major linear index) of tensor ``name`` has the value ``T[(c + a * i) mod P]``
where ``T`` is a fixed random table of ``P`` entries (a prime, about a million),
and ``a``, ``c`` are derived from a hash of the tensor name and the seed. So:

- any rank computes the values of just the boxes it holds, with two vectorised
  torch ops per slab (an int32 broadcast sum over the box's dims and one table
  gather), a few hundred million elements per second per core;
- a value depends on the tensor and the element's position, so misplaced,
  transposed, swapped or missing data shows up as mismatches (a few
  coincidences are possible: bf16 has only ~32 k values in [-1, 1));
- float values lie in [-1, 1) and are cast from a float32 table to the buffer's
  dtype, so the expected value of a destination element is exactly what a
  sender-side cast of the source value gives.

``fill`` / ``fill_source`` give a rank's buffers filled with these values;
``check_destination`` compares a rank's destination buffers bit for bit.
"""

from __future__ import annotations

import itertools
import math
import zlib
from functools import lru_cache
from typing import Mapping, Sequence

import torch

from .layout import Layout, box_str, buffer_view

P = 1_000_003  # table period (prime)
SLAB = 1 << 20  # elements computed per step (bounds scratch memory)
_MAX_REPORTED = 20


@lru_cache(maxsize=None)
def _table(dtype: torch.dtype, seed: int, ndim: int) -> torch.Tensor:
    """``T`` repeated ``max(ndim, 1)`` times (the per-dim sums stay below ``ndim * P``)."""
    g = torch.Generator().manual_seed(0x5EED_0000 + seed)
    if dtype.is_floating_point or dtype.is_complex:
        base = (torch.rand(P, generator=g, dtype=torch.float64) * 2 - 1).to(torch.float32).to(dtype)
    elif dtype == torch.bool:
        base = torch.randint(0, 2, (P,), generator=g).to(torch.bool)
    else:
        lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
        base = torch.randint(lo, hi, (P,), generator=g).to(dtype)
    return base.repeat(max(ndim, 1))


def _coefficients(name: str, seed: int) -> tuple[int, int]:
    h = zlib.crc32(f"{seed}:{name}".encode())
    h2 = zlib.crc32(f"{name}:{seed}:a".encode())
    return 1 + h2 % (P - 1), h % P


def values(name: str, shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], dtype: torch.dtype,
           seed: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """The test values of box ``offsets/sizes`` of tensor ``name`` (full shape ``shape``) in ``dtype``.

    Written into ``out`` (any view of the box's shape) if given, else a new tensor.
    """
    shape, offsets, sizes = tuple(map(int, shape)), tuple(map(int, offsets)), tuple(map(int, sizes))
    if out is None:
        out = torch.empty(sizes, dtype=dtype)
    if math.prod(sizes) == 0:
        return out
    a, c = _coefficients(name, seed)
    table = _table(dtype, seed, len(shape)).to(out.device)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    per_dim = []
    for d, (o, n, s) in enumerate(zip(offsets, sizes, strides)):
        v = (torch.arange(o, o + n, dtype=torch.int64, device=out.device) * ((a * s) % P)) % P
        if d == 0:
            v = (v + c) % P
        per_dim.append(v.to(torch.int32))
    if not per_dim:  # 0-d tensor: element 0
        out.copy_(table[c])
        return out
    # slabs along the outermost dim whose trailing block fits SLAB elements
    inner = math.prod(sizes)
    split_dim = 0
    for split_dim, n in enumerate(sizes):
        inner //= n
        if inner <= SLAB:
            break
    rows = max(1, SLAB // max(inner, 1))
    for outer in itertools.product(*(range(n) for n in sizes[:split_dim])):
        base = torch.zeros((), dtype=torch.int32, device=out.device)
        for d, i in enumerate(outer):
            base = base + per_dim[d][i]
        target = out[outer] if outer else out
        for start in range(0, sizes[split_dim], rows):
            stop = min(start + rows, sizes[split_dim])
            idx = per_dim[split_dim][start:stop].view((-1,) + (1,) * (len(sizes) - split_dim - 1)) + base
            for k, v in enumerate(per_dim[split_dim + 1:], start=split_dim + 1):
                idx = idx + v.view((-1,) + (1,) * (len(sizes) - k - 1))
            dst = target[start:stop]
            if dst.is_contiguous():
                torch.index_select(table, 0, idx.reshape(-1), out=dst.view(-1))
            else:
                dst.copy_(torch.index_select(table, 0, idx.reshape(-1)).view(dst.shape))
    return out


def fill(layout: Layout, rank: int, device: torch.device | str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """``rank``'s buffers of ``layout`` with every piece holding its test values (in the buffer's dtype).

    Bytes of a buffer that no piece covers stay zero.
    """
    bufs = layout.empty_buffers(rank, device)
    for p in layout.pieces(rank):
        spec = layout.specs[p.tensor]
        view = buffer_view(bufs[p.buffer], p.buffer_offsets, p.sizes)
        values(p.tensor, spec.shape, p.offsets, p.sizes, view.dtype, seed, out=view)
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
                          out=torch.empty(p.sizes, dtype=got.dtype, device=got.device))
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
