"""DTensor-style placements and the uneven-split rules, as plain data.

Mesh dim ``i`` of shape ``m_i`` either replicates the tensor or splits one tensor dim.
Placements apply left to right: a later mesh dim splits what an earlier one left
on the rank (the DTensor rule). Example, 10 rows over 4 ranks, ``Shard(0)``::

    split      rank 0   rank 1   rank 2   rank 3
    "chunk"    0:3      3:6      6:9      9:10     (torch.chunk: ceil(10/4) = 3)
    "balanced" 0:3      3:6      6:8      8:10     (first 10 % 4 ranks get one more)
    "even"     error: 10 rows do not divide by 4

``StridedShard(0, split_factor=2)`` over 2 ranks, 8 rows: the rows are first cut
into 2 parts (0:4, 4:8), each part into 2, and rank ``r`` takes the ``r``-th of each:
rank 0 holds rows 0:2 and 4:6 (two pieces), rank 1 holds 2:4 and 6:8. This is
torch's ``_StridedShard`` (the "right-to-left" sharding FSDP2 uses over a
tensor-parallel dim), including its nested rule for uneven sizes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from .tensors import LayoutError, Piece, TensorSpec, checked_ints, is_int

SPLITS = ("chunk", "balanced", "even")


@dataclass(frozen=True)
class Shard:
    """Split tensor dim ``dim`` across this mesh dim."""

    dim: int

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank along this mesh dim holds the same data."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class StridedShard:
    """Cut tensor dim ``dim`` into ``split_factor`` parts and each part into ``mesh_size``;
    rank ``r`` takes the ``r``-th sub-part of every part (torch's ``_StridedShard``)."""

    dim: int
    split_factor: int

    def __repr__(self) -> str:
        return f"StridedShard(dim={self.dim}, split_factor={self.split_factor})"


Placement = Shard | Replicate | StridedShard


def split_sizes(n: int, parts: int, split: str, what: str = "dim") -> list[int]:
    """Sizes of ``parts`` consecutive parts of ``n`` items under rule ``split``.

    >>> split_sizes(10, 4, "chunk"), split_sizes(10, 4, "balanced")
    ([3, 3, 3, 1], [3, 3, 2, 2])
    """
    return list(_split_sizes(n, parts, split, what))


@lru_cache(maxsize=65536)
def _split_sizes(n: int, parts: int, split: str, what: str) -> tuple[int, ...]:
    if parts <= 0:
        raise LayoutError(f"{what}: cannot split into {parts} parts")
    if split == "chunk":
        c = -(-n // parts) if n else 0
        return tuple(max(0, min(c, n - i * c)) for i in range(parts))
    if split == "balanced":
        q, rem = divmod(n, parts)
        return tuple(q + (1 if i < rem else 0) for i in range(parts))
    if split == "even":
        if n % parts:
            raise LayoutError(f"{what}: size {n} does not divide evenly into {parts} parts (split='even')")
        return (n // parts,) * parts
    raise LayoutError(f"unknown split rule {split!r}; choose one of {SPLITS}")


Intervals = tuple[tuple[int, int], ...]  # global (start, end) runs, in local order


def _take(runs: Intervals, a: int, b: int) -> Intervals:
    """Local positions [a, b) of the concatenation of ``runs``, as global runs."""
    out = []
    pos = 0
    for s, e in runs:
        n = e - s
        lo, hi = max(a, pos), min(b, pos + n)
        if lo < hi:
            out.append((s + lo - pos, s + hi - pos))
        pos += n
    return tuple(out)


@lru_cache(maxsize=4096)
def local_runs(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, split: str
               ) -> dict[tuple[int, ...], tuple[Intervals, ...]]:
    """For each mesh coordinate, per tensor dim, the global runs it holds (in local order)."""
    out = {}
    for coord in itertools.product(*(range(m) for m in mesh_shape)):
        runs: list[Intervals] = [((0, n),) for n in shape]
        for i, (p, c) in enumerate(zip(placements, coord)):
            if isinstance(p, Replicate):
                continue
            local = sum(e - s for s, e in runs[p.dim])
            what = f"dim {p.dim} (mesh dim {i})"
            if isinstance(p, Shard):
                sizes = _split_sizes(local, mesh_shape[i], split, what)
                a = sum(sizes[:c])
                runs[p.dim] = _take(runs[p.dim], a, a + sizes[c])
            else:  # cut into split_factor parts, each part into mesh-size parts; take part c of each
                taken: list[tuple[int, int]] = []
                a = 0
                for part in _split_sizes(local, p.split_factor, split, what):
                    sub = _split_sizes(part, mesh_shape[i], split, what)
                    lo = a + sum(sub[:c])
                    taken.extend(_take(runs[p.dim], lo, lo + sub[c]))
                    a += part
                runs[p.dim] = _merge_adjacent(taken)
        out[coord] = tuple(runs)
    return out


def _merge_adjacent(runs: list[tuple[int, int]]) -> Intervals:
    out: list[tuple[int, int]] = []
    for s, e in runs:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return tuple(out)


def check_sizes(what: str, **sizes) -> None:
    """Raise :class:`LayoutError` unless every parallel size is an integer >= 1.

    >>> check_sizes("vLLM", tp=2, dp=0)
    Traceback (most recent call last):
    ...
    reshard.tensors.LayoutError: vLLM: dp must be a positive integer, got 0
    """
    for key, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise LayoutError(f"{what}: {key} must be a positive integer, got {v!r}")


def check_ranks(ranks: Sequence[int], what: str, mesh: Sequence[int] | None = None, **sizes: int) -> np.ndarray:
    """``ranks`` as an int64 array, checked to be as many distinct ranks as the named ``sizes`` (or the
    ``mesh`` shape) multiply to.

    >>> check_ranks([4, 5, 6, 7], "vLLM", tp=2, dp=2).tolist()
    [4, 5, 6, 7]
    >>> check_ranks([4, 5, 6], "vLLM", tp=2, dp=2)
    Traceback (most recent call last):
    ...
    reshard.tensors.LayoutError: vLLM: 3 ranks given, but tp*dp = 2*2 = 4
    >>> check_ranks([0, 1, 2], "tensor 'w'", mesh=(2, 2))
    Traceback (most recent call last):
    ...
    reshard.tensors.LayoutError: tensor 'w': 3 ranks given, but mesh shape (2, 2) holds 4
    """
    if mesh is not None:
        sizes = {f"mesh dim {i}": m for i, m in enumerate(mesh)}
    check_sizes(what, **sizes)
    out = np.array(checked_ints(ranks, f"{what}: ranks", minimum=0), np.int64)
    need = math.prod(int(v) for v in sizes.values())
    if len(out) != need:
        expected = (f"mesh shape {tuple(mesh)} holds" if mesh is not None else
                    f"{'*'.join(sizes)} = {'*'.join(str(v) for v in sizes.values())} =")
        raise LayoutError(f"{what}: {len(out)} ranks given, but {expected} {need}")
    if len(np.unique(out)) != len(out):
        raise LayoutError(f"{what}: ranks repeat a rank: {out.tolist()}")
    return out


def _check(spec: TensorSpec, ranks: Sequence[int], mesh_shape: Sequence[int], placements: Sequence) -> None:
    if not isinstance(spec, TensorSpec):
        raise LayoutError(f"expected a TensorSpec, got {spec!r}")
    check_ranks(ranks, f"tensor {spec.name!r}", mesh=mesh_shape)
    if len(placements) != len(mesh_shape):
        raise LayoutError(f"tensor {spec.name!r}: {len(placements)} placements for a {len(mesh_shape)}-dim mesh")
    for p in placements:
        if not isinstance(p, (Shard, Replicate, StridedShard)):
            raise LayoutError(f"tensor {spec.name!r}: unsupported placement {p!r}")
        if isinstance(p, (Shard, StridedShard)) and not is_int(p.dim):
            raise LayoutError(f"tensor {spec.name!r}: {p!r} needs an integer dim")
        if isinstance(p, (Shard, StridedShard)) and not 0 <= p.dim < len(spec.shape):
            raise LayoutError(f"tensor {spec.name!r}: {p!r} but the tensor has {len(spec.shape)} dims")
        if isinstance(p, StridedShard) and not (is_int(p.split_factor) and p.split_factor >= 1):
            raise LayoutError(f"tensor {spec.name!r}: {p!r} needs an integer split_factor >= 1")


def local_pieces(spec: TensorSpec, ranks: Sequence[int], mesh_shape: Sequence[int], placements: Sequence,
                 split: str, buffer: str, dtype: torch.dtype):
    """Pieces and buffers of one tensor laid out by ``placements`` (see module doc)."""
    _check(spec, ranks, mesh_shape, placements)
    try:
        runs_by_coord = local_runs(spec.shape, tuple(mesh_shape), tuple(placements), split)
    except LayoutError as e:
        raise LayoutError(f"tensor {spec.name!r} {e}") from None
    pieces = []
    buffers = {}
    for rank, coord in zip(ranks, itertools.product(*(range(m) for m in mesh_shape))):
        runs = runs_by_coord[coord]
        local_shape = tuple(sum(e - s for s, e in r) for r in runs)
        buffers[int(rank)] = {buffer: (local_shape, dtype)}
        per_dim = []
        for r in runs:
            pos, items = 0, []
            for s, e in r:
                items.append((s, e - s, pos))
                pos += e - s
            per_dim.append(items)
        for combo in itertools.product(*per_dim):
            sizes = tuple(c[1] for c in combo)
            if 0 in sizes:
                continue
            pieces.append(Piece(spec.name, tuple(c[0] for c in combo), sizes, buffer, tuple(c[2] for c in combo),
                                int(rank)))
    return pieces, buffers


def from_torch_placement(p) -> Placement:
    """Our twin of a torch DTensor placement (``Shard``, ``Replicate``, ``_StridedShard``)."""
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - older torch
        _StridedShard = ()
    if _StridedShard and isinstance(p, _StridedShard):
        return StridedShard(p.dim, p.split_factor)
    if isinstance(p, TShard):
        return Shard(p.dim)
    if isinstance(p, TReplicate):
        return Replicate()
    raise LayoutError(f"unsupported DTensor placement {p!r} (Partial sums cannot be resharded)")
