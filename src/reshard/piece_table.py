"""How a layout stores one tensor's pieces: a :class:`PieceTable` of numpy arrays, one row per piece.

A layout of a whole model at cluster scale has millions of pieces; as :class:`~reshard.tensors.Piece`
objects they would not fit, so each tensor's pieces are columns of arrays (ranks, box offsets and
sizes, buffer names, offsets in the buffer). Tables of many tensors alike share their arrays, and
:class:`Repeated` stands for one buffer name on every row without a reference per row.

>>> from reshard.tensors import Piece
>>> table = table_of([Piece("w", (0, 0), (2, 6), "w", (0, 0), 0), Piece("w", (2, 0), (2, 6), "w", (0, 0), 1)], 2)
>>> len(table), table.ranks.tolist(), table.offsets.tolist(), table.one_buffer()
(2, [0, 1], [[0, 0], [2, 0]], 'w')
>>> Repeated("w", 3) == ("w", "w", "w")
True

Pure data: no process group, no device.
"""

from __future__ import annotations

import itertools
from collections import abc
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np
import torch

from .tensors import LayoutError, Piece, itemsize


class Repeated(abc.Sequence):
    """``n`` copies of one buffer name (or dtype) without ``n`` references (a tensor's pieces on many
    ranks usually all live in the buffer of one name): ``Repeated("w", 3) == ("w", "w", "w")``."""

    __slots__ = ("name", "n")

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return (self.name,) * len(range(*i.indices(self.n)))
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.name

    def __iter__(self):
        return itertools.repeat(self.name, self.n)

    def count(self, value) -> int:
        return self.n if value == self.name else 0

    def __eq__(self, other) -> bool:
        if isinstance(other, (tuple, Repeated)):
            return len(other) == self.n and all(x == self.name for x in other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other):
        return tuple(self) + tuple(other)

    def __radd__(self, other):
        return tuple(other) + tuple(self)

    def __repr__(self) -> str:
        return f"({self.name!r},) * {self.n}"

    def __reduce__(self):
        return (Repeated, (self.name, self.n))


def read_only(arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """``arrays``, marked read-only: piece arrays that the tables of many tensors share."""
    for a in arrays:
        a.flags.writeable = False
    return arrays


@dataclass(eq=False, slots=True)
class PieceTable:
    """All pieces of one tensor in one layout, as numpy arrays (row i = piece i); treat as read-only
    (tables of many tensors share arrays)."""

    ranks: np.ndarray  # int64 [k]
    offsets: np.ndarray  # int64 [k, ndim]
    sizes: np.ndarray  # int64 [k, ndim]
    buffers: Sequence[str]  # k buffer names (a tuple, or Repeated when all are one)
    buffer_offsets: np.ndarray  # int64 [k, buffer_ndim]
    _geometry: bytes | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.ranks)

    def one_buffer(self) -> str | None:
        """The buffer name every piece lives in, if they all share one."""
        b = self.buffers
        if type(b) is Repeated:
            return b.name if b.n else None
        return b[0] if b and b.count(b[0]) == len(b) else None

    def box_copies(self, cache: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(index of each piece's distinct box, how many pieces hold each distinct box): replicas.

        ``cache``: a dict kept over one pass through many tables; tables with the same boxes (on any
        ranks) then share one answer, worked out once (treat it as read-only)."""
        if cache is not None:
            key = (self.offsets.shape, self.offsets.tobytes(), self.sizes.tobytes())
            hit = cache.get(key)
            if hit is None:
                hit = cache[key] = self.box_copies()
            return hit
        if not len(self):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        _, inv, counts = np.unique(np.concatenate([self.offsets, self.sizes], axis=1), axis=0,
                                   return_inverse=True, return_counts=True)
        return inv.reshape(-1), counts

    def geometry_key(self, cache: dict | None = None) -> bytes:
        """Bytes identifying ranks and boxes (not buffers): equal keys plan alike.

        ``cache``: a dict kept over one pass through many tables; tables sharing their ranks, offsets
        and sizes arrays then share one key, worked out once (:func:`shared_geometry_key`)."""
        key = self._geometry
        if key is None:
            key = (geometry_bytes(self.ranks, self.offsets, self.sizes) if cache is None
                   else shared_geometry_key(self.ranks, self.offsets, self.sizes, cache))
            object.__setattr__(self, "_geometry", key)
        return key


def geometry_bytes(ranks: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> bytes:
    """:meth:`PieceTable.geometry_key` of a table with these arrays."""
    n, d = offsets.shape
    return b"".join([np.array([n, d], np.int64).tobytes(), ranks.tobytes(), offsets.tobytes(), sizes.tobytes()])


def shared_geometry_key(ranks: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, cache: dict) -> bytes:
    """:func:`geometry_bytes` of these arrays, worked out once per arrays that tables share: ``cache`` is a
    dict kept over one pass (it holds the arrays, so their ids stay unique while it lives).

    >>> a, b = np.zeros(2, np.int64), np.zeros((2, 1), np.int64)
    >>> cache = {}
    >>> shared_geometry_key(a, b, b, cache) is shared_geometry_key(a, b, b, cache) == geometry_bytes(a, b, b)
    True
    """
    key = ("geometry", id(ranks), id(offsets), id(sizes))
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = (ranks, offsets, sizes, geometry_bytes(ranks, offsets, sizes))
    return hit[3]


def table_of(pieces: Sequence[Piece], ndim: int) -> PieceTable:
    """The table of one tensor's ``pieces`` (its shape has ``ndim`` dims)."""
    k = len(pieces)
    bnd = max((len(p.buffer_offsets) for p in pieces), default=ndim)
    offsets = np.zeros((k, ndim), np.int64)
    sizes = np.zeros((k, ndim), np.int64)
    boffs = np.zeros((k, bnd), np.int64)
    for i, p in enumerate(pieces):
        offsets[i] = p.offsets
        sizes[i] = p.sizes
        boffs[i] = p.buffer_offsets
    ranks = np.array([p.rank for p in pieces], np.int64)
    return PieceTable(ranks, offsets, sizes, tuple(p.buffer for p in pieces), boffs)


def concatenated(tables: Sequence[PieceTable], ndim: int, cache: dict | None = None) -> PieceTable:
    """One table holding the rows of ``tables`` in turn (one tensor's pieces from several layouts).

    ``cache``: a dict kept over one merge of many tensors, whose tables stay alive meanwhile; parts
    made of the same arrays (tensors alike share them) are then joined once, and the results shared
    (read-only, as every table's arrays are)."""
    def joined(field: str, parts: list, join):
        if cache is None:
            return join(parts)
        # by identity (every part stays alive meanwhile); a Repeated name by value (made per tensor)
        key = (field, *((p.name, p.n) if type(p) is Repeated else id(p) for p in parts))
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = join(parts)
            if isinstance(hit, np.ndarray):
                hit.flags.writeable = False
        return hit

    return PieceTable(
        joined("ranks", [t.ranks for t in tables], np.concatenate),
        joined("offsets", [t.offsets for t in tables], np.concatenate),
        joined("sizes", [t.sizes for t in tables], np.concatenate),
        joined("buffers", [t.buffers for t in tables], lambda parts: sum(parts, ())),
        joined("buffer_offsets", [t.buffer_offsets for t in tables], lambda parts: _concat_ragged(parts, ndim)),
    )


def _concat_ragged(arrays: list[np.ndarray], ndim: int) -> np.ndarray:
    """Buffer offsets of one tensor's pieces from several layouts (an empty part has no buffer to
    say how many dims it has: it takes the others')."""
    full = [a for a in arrays if len(a)] or arrays[:1]
    width = max(a.shape[1] for a in full)
    if any(a.shape[1] != width for a in full):
        raise LayoutError("pieces of one tensor are placed in buffers with different numbers of dims")
    return np.concatenate([a.reshape(len(a), width) if not len(a) else a for a in arrays])


class BufferDtypes(NamedTuple):
    """The dtypes of the buffers one tensor's pieces live in (:meth:`Layout.buffer_dtypes
    <reshard.layout.Layout.buffer_dtypes>`)."""

    per_piece: Sequence[torch.dtype]  # one per piece, in table order
    uniform: torch.dtype | None  # the one dtype of every piece's buffer, None when they differ
    itemsize: int | None  # bytes per element when every piece's buffer has one (dtypes may still differ)

    @classmethod
    def of(cls, per_piece: Sequence[torch.dtype], uniform: torch.dtype | None) -> "BufferDtypes":
        """The answer with its itemsize worked out."""
        if uniform is not None:
            return cls(per_piece, uniform, uniform.itemsize)
        sizes = {itemsize(dtype) for dtype in per_piece}
        return cls(per_piece, None, sizes.pop() if len(sizes) == 1 else None)

    @property
    def itemsizes(self) -> np.ndarray:
        """Bytes per element of each piece's buffer (int64 [k])."""
        if self.uniform is not None:
            return np.full(len(self.per_piece), self.uniform.itemsize, np.int64)
        return np.array([itemsize(dtype) for dtype in self.per_piece], np.int64)


__all__ = ["BufferDtypes", "PieceTable", "Repeated", "concatenated", "geometry_bytes", "read_only",
           "shared_geometry_key", "table_of"]
