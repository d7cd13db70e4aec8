"""Logical tensors, pieces and layouts: which rank holds which box of which tensor, where.

A *piece* is a box (``offsets``, ``sizes``) of a logical tensor placed at
``buffer_offsets`` inside one local buffer of one rank. A buffer may have more
dimensions than the tensor (a fused MoE buffer ``[experts, rows, cols]`` holds
2-D expert tensors): the piece then fills the trailing dimensions and is one
element thick in the leading ones.

Example: a (4, 6) tensor ``w`` row-sharded over ranks 0 and 1::

    rank  box (offsets, sizes)   buffer  buffer_offsets
    0     (0, 0), (2, 6)         "w"     (0, 0)
    1     (2, 0), (2, 6)         "w"     (0, 0)

>>> import torch
>>> from reshard.placements import Shard
>>> lay = Layout.from_placements(TensorSpec("w", (4, 6), torch.float32), [0, 1], (2,), [Shard(0)])
>>> [(p.rank, p.offsets, p.sizes, p.buffer, p.buffer_offsets) for r in lay.ranks for p in lay.pieces(r)]
[(0, (0, 0), (2, 6), 'w', (0, 0)), (1, (2, 0), (2, 6), 'w', (0, 0))]
>>> lay.buffers(1)
{'w': ((2, 6), torch.float32)}

A layout stores each tensor's pieces as one :class:`~reshard.piece_table.PieceTable` (numpy arrays,
one row per piece); ``PieceTable``, ``Repeated`` and ``BufferDtypes`` are importable from here too.
Everything here is pure data: no process group, no device.
"""


from __future__ import annotations

import hashlib
from collections import defaultdict
from functools import cached_property
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from .layout_checks import check_layout, checked_buffers, checked_piece
from .piece_table import (BufferDtypes, PieceTable, Repeated, concatenated, geometry_bytes, read_only,
                          shared_geometry_key, table_of)
from .placements import Placement, from_torch_placement, local_pieces
from .tensors import LayoutError, Piece, TensorSpec, box_slices, buffer_view

BufferDescs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


class RankBuffers(dict):
    """One rank's buffers ``{name: (shape, dtype)}``, read-only, so that layouts of one side (and
    ranks with equal buffers) share it instead of copying it; its name -> dtype map is worked out once.

    >>> held = RankBuffers({"w": ((2, 6), torch.float32)})
    >>> held.dtypes
    {'w': torch.float32}
    """

    __slots__ = ("_digest", "_dtypes", "_parts")

    def __init__(self, *args, **kwargs) -> None:
        dict.__init__(self, *args, **kwargs)
        self._dtypes: dict[str, torch.dtype] | None = None
        self._parts: tuple[RankBuffers, RankBuffers] | None = None
        self._digest: int | None = None

    @classmethod
    def overlay(cls, base: "RankBuffers", extra: BufferDescs) -> "RankBuffers":
        """``base``'s buffers and then ``extra``'s (a rank's own staging beside buffers many ranks share).
        Where no name is in both, the parts are kept: :meth:`dtype_maps` then gives ``base``'s map, worked
        out once for every rank sharing it, and ``extra``'s.

        >>> base = RankBuffers({"w": ((4,), torch.float32)})
        >>> rank = RankBuffers.overlay(base, {"w@raw/0": ((2,), torch.bfloat16)})
        >>> list(rank), rank.dtype_maps()[0] is base.dtypes
        (['w', 'w@raw/0'], True)
        """
        out = cls(base)
        dict.update(out, extra)
        if len(out) == len(base) + len(extra):  # no name in both: the parts hold what the rank holds
            out._parts = (base, extra if type(extra) is RankBuffers else cls(extra))
        return out

    def digest(self) -> int:
        """What a plan's fingerprint hashes of a rank's buffers: the sum, modulo ``2**256``, of a sha256 of
        each ``(name, (shape, dtype))`` item. A sum depends on the items only, not on their order or on how
        the mapping was built; so an :meth:`overlay`'s shared base is summed once for every rank sharing it,
        and its own buffers added. Kept on the mapping (it is read-only): the plans and phases that share
        it work it out once.

        >>> base = RankBuffers({"a": ((1,), torch.float32), "c": ((2,), torch.float32)})
        >>> rank = RankBuffers.overlay(base, {"b": ((3,), torch.bfloat16)})
        >>> rank.digest() == RankBuffers(dict(rank)).digest() != base.digest()
        True
        """
        if self._digest is None:
            if self._parts is None:
                rendered: dict = {}  # each distinct (shape, dtype) rendered once
                self._digest = sum(int.from_bytes(hashlib.sha256(text).digest(), "little")
                                   for text in _item_texts(self, rendered)) % _DIGEST_MODULUS
            else:
                base, extra = self._parts
                self._digest = (base.digest() + extra.digest()) % _DIGEST_MODULUS
        return self._digest

    def dtype_maps(self) -> list[dict[str, torch.dtype]]:
        """``{name: dtype}`` maps whose union is :attr:`dtypes` (names in one of them only): the parts of an
        :meth:`overlay`, else :attr:`dtypes` alone."""
        return [self.dtypes] if self._parts is None else [part.dtypes for part in self._parts]

    def _read_only(self, *args, **kwargs):
        raise TypeError("a layout's RankBuffers is shared and read-only: copy it with dict(...)")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _read_only

    def __reduce__(self):
        return (RankBuffers, (dict(self),))

    @property
    def dtypes(self) -> dict[str, torch.dtype]:
        """``{name: dtype}`` (treat as read-only)."""
        if self._dtypes is None:
            self._dtypes = {b: dt for b, (_, dt) in self.items()}
        return self._dtypes


_DIGEST_MODULUS = 1 << 256


def _item_texts(named: BufferDescs, rendered: dict) -> list[bytes]:
    """``repr((name, (shape, dtype))).encode()`` of each item of ``named``, each distinct ``(shape, dtype)``
    rendered once (kept in ``rendered``)."""
    out = []
    for name, desc in named.items():
        try:
            shown = rendered.get(desc)
        except TypeError:  # a shape given as a list: not a key
            shown = repr(desc)
        if shown is None:
            shown = rendered[desc] = repr(desc)
        out.append(f"({name!r}, {shown})".encode())
    return out


def shared_buffers(named: BufferDescs) -> RankBuffers:
    """``named`` as a :class:`RankBuffers`: itself, or a copy."""
    return named if type(named) is RankBuffers else RankBuffers(named)


VALIDATE_MAX_PIECES = 100_000
"""``Layout(..., validate=None)`` checks layouts up to this many pieces; bigger ones (whole models at
cluster scale) come from constructors that are correct by construction (the tests validate each
of them on small configurations), and ``Layout.validate()`` can still be called on them (seconds
per million pieces)."""


class Layout:
    """All pieces of a side (source or destination), by rank, plus each rank's buffers.

    Build one with :meth:`from_placements`, :meth:`from_dtensor` or :meth:`from_pieces`,
    combine several with :meth:`merge`. Constructors validate; a bad layout raises
    :class:`LayoutError` naming the tensor, rank and box. ``validate=None`` (what the framework
    constructors pass) validates layouts of up to :data:`VALIDATE_MAX_PIECES` pieces.
    """

    def __init__(
        self,
        specs: Mapping[str, TensorSpec],
        tables: Mapping[str, PieceTable],
        buffers: Mapping[int, BufferDescs],
        *,
        validate: bool | None = True,
    ) -> None:
        self.specs: dict[str, TensorSpec] = dict(specs)
        self.tables: dict[str, PieceTable] = dict(tables)
        shared: dict[int, RankBuffers] = {}  # id of a mapping given for several ranks -> its one copy
        self._buffers: dict[int, RankBuffers] = {}
        for r, b in buffers.items():
            held = shared.get(id(b))
            if held is None:
                held = shared[id(b)] = shared_buffers(b)
            self._buffers[int(r)] = held
        self._by_rank: dict[int, list[tuple[str, int]]] | None = None
        self._dtypes: dict[str, torch.dtype | None] | None = None
        self._uniform_answers: dict[tuple[torch.dtype, int], BufferDtypes] = {}  # shared by tensors alike
        self._dtype_answers: dict[str, tuple[PieceTable, BufferDtypes]] = {}  # name -> (its table, answer)
        if validate is None:
            validate = sum(len(t) for t in self.tables.values()) <= VALIDATE_MAX_PIECES
        if validate:
            self.validate()

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_pieces(
        cls,
        specs: Iterable[TensorSpec],
        pieces: Iterable[Piece],
        buffers: Mapping[int, Mapping[str, tuple[Sequence[int], torch.dtype]]] | None = None,
    ) -> "Layout":
        """A layout from explicit pieces.

        ``buffers`` gives each rank's buffers as ``{rank: {name: (shape, dtype)}}``; buffers
        not listed are inferred: shape = the extent of their pieces, dtype = the tensor's.
        """
        spec_by_name = {}
        for s in specs:
            if s.name in spec_by_name and spec_by_name[s.name] != s:
                raise LayoutError(f"tensor {s.name!r} declared twice with different specs")
            spec_by_name[s.name] = s
        grouped: dict[str, list[Piece]] = defaultdict(list)
        for p in pieces:
            p = checked_piece(p, spec_by_name)
            grouped[p.tensor].append(p)
        bufs = checked_buffers(buffers)
        inferred: dict[tuple[int, str], list[int]] = {}
        inferred_dtype: dict[tuple[int, str], torch.dtype] = {}
        for name, plist in grouped.items():
            for p in plist:
                if p.buffer in bufs.get(p.rank, {}):
                    continue
                key = (p.rank, p.buffer)
                lead = len(p.buffer_offsets) - len(p.sizes)
                ext = [bo + s for bo, s in zip(p.buffer_offsets, (1,) * lead + p.sizes)]
                prev = inferred.get(key)
                if prev is not None and len(prev) != len(ext):
                    raise LayoutError(f"rank {p.rank} buffer {p.buffer!r}: pieces disagree on its number of dims")
                inferred[key] = ext if prev is None else [max(a, b) for a, b in zip(prev, ext)]
                inferred_dtype.setdefault(key, spec_by_name[name].dtype)
        for (r, b), ext in inferred.items():
            bufs[r][b] = (tuple(ext), inferred_dtype[(r, b)])
        tables = {name: table_of(grouped.get(name, []), len(spec.shape)) for name, spec in spec_by_name.items()}
        return cls(spec_by_name, tables, bufs)

    @classmethod
    def from_placements(
        cls,
        spec: TensorSpec,
        ranks: Sequence[int],
        mesh_shape: Sequence[int],
        placements: Sequence[Placement],
        split: str = "chunk",
        *,
        buffer: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> "Layout":
        """DTensor-style layout of one tensor over ``ranks`` arranged row-major as ``mesh_shape``.

        ``placements[i]`` says what mesh dim ``i`` does (``Shard``, ``Replicate``,
        ``StridedShard``); ``split`` is the uneven-split rule (see :mod:`reshard.placements`).
        The buffer is named after the tensor unless ``buffer`` is given; its dtype is the
        tensor's unless ``dtype`` is given (e.g. bf16 inference copies of fp32 weights).
        """
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise LayoutError(f"tensor {spec.name!r}: buffer dtype must be a torch.dtype, got {dtype!r}")
        pieces, buffers = local_pieces(spec, ranks, mesh_shape, placements, split, buffer or spec.name,
                                       dtype or spec.dtype)
        return cls.from_pieces([spec], pieces, buffers)

    @classmethod
    def from_dtensor(cls, name: str, dtensor, *, split: str = "chunk", buffer: str | None = None) -> "Layout":
        """The layout of a live ``torch.distributed.tensor.DTensor`` over its device mesh.

        Every rank of the mesh gets its pieces (computed, not communicated), so any rank
        can call this and get the same layout.
        """
        mesh = dtensor.device_mesh
        spec = TensorSpec(name, tuple(dtensor.shape), dtensor.dtype)
        ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        placements = [from_torch_placement(p) for p in dtensor.placements]
        return cls.from_placements(spec, ranks, tuple(mesh.mesh.shape), placements, split, buffer=buffer)

    @staticmethod
    def merge(layouts: Iterable["Layout"], *, validate: bool | None = True) -> "Layout":
        """One layout holding the tensors of all ``layouts`` (same tensor may appear in several);
        ``validate``: as :class:`Layout` takes it (``None``: only up to :data:`VALIDATE_MAX_PIECES`
        pieces, for parts from constructors correct by construction)."""
        specs: dict[str, TensorSpec] = {}
        pieces: dict[str, list[PieceTable]] = defaultdict(list)
        parts: dict[int, list[RankBuffers]] = defaultdict(list)
        for lay in layouts:
            for name, spec in lay.specs.items():
                if name in specs and specs[name] != spec:
                    raise LayoutError(f"tensor {name!r}: layouts disagree on its spec ({specs[name]} vs {spec})")
                specs[name] = spec
                pieces[name].append(lay.tables[name])
            for r, named in lay._buffers.items():
                parts[r].append(named)
        merged: dict[tuple[int, ...], RankBuffers] = {}  # ranks with the same parts share the result
        bufs: dict[int, RankBuffers] = {}
        for r, held in parts.items():
            key = tuple(id(named) for named in held)
            if key not in merged:
                merged[key] = held[0] if len(set(key)) == 1 else _merged_buffers(r, held)
            bufs[r] = merged[key]
        joined: dict = {}  # parts made of the same arrays are joined once (every input table stays alive)
        tables = {name: tabs[0] if len(tabs) == 1 else concatenated(tabs, len(specs[name].shape), joined)
                  for name, tabs in pieces.items()}
        return Layout(specs, tables, bufs, validate=validate)

    def subset(self, ranks: Iterable[int]) -> "Layout":
        """The pieces and buffers of ``ranks`` only (every tensor's spec kept): one rank's part, to
        exchange with the others (``Layout.merge`` puts the parts back together).

        >>> import torch
        >>> from reshard.placements import Shard
        >>> lay = Layout.from_placements(TensorSpec("w", (4, 6), torch.float32), [0, 1], (2,), [Shard(0)])
        >>> part = lay.subset([1])
        >>> part.ranks, [p.offsets for p in part.pieces(1)]
        ([1], [(2, 0)])
        >>> Layout.merge([lay.subset([0]), part]).pieces(0) == lay.pieces(0)
        True
        """
        keep = np.array(sorted({int(r) for r in ranks}), np.int64)
        tables = {}
        for name, t in self.tables.items():
            rows = np.flatnonzero(np.isin(t.ranks, keep))
            b = t.one_buffer()
            names = Repeated(b, len(rows)) if b is not None else tuple(t.buffers[r] for r in rows.tolist())
            tables[name] = PieceTable(t.ranks[rows], t.offsets[rows], t.sizes[rows], names, t.buffer_offsets[rows])
        return Layout(self.specs, tables, {r: self._buffers[r] for r in keep.tolist() if r in self._buffers},
                      validate=False)

    def with_tables(self, tables: Mapping[str, PieceTable]) -> "Layout":
        """This layout's specs and buffers with other ``tables`` (not validated: the caller makes them
        from this layout's, e.g. subsets of their pieces); what it knows of its buffers' dtypes
        carries over, worked out once for every layout made so.

        >>> import torch
        >>> from reshard.placements import Shard
        >>> lay = Layout.from_placements(TensorSpec("w", (4, 6), torch.float32), [0, 1], (2,), [Shard(0)])
        >>> half = lay.with_tables({"w": lay.tables["w"]})
        >>> half.ranks, half.single_itemsize
        ([0, 1], 4)
        """
        out = Layout(self.specs, tables, {r: self.buffer_map(r) for r in self.ranks}, validate=False)
        out._dtypes = self._dtype_by_name()  # the same buffers: the same answers
        out.__dict__["_single_dtype"] = self._single_dtype
        return out

    # ------------------------------------------------------------------ queries
    @property
    def ranks(self) -> list[int]:
        """Sorted global ranks that hold a piece or a buffer."""
        return list(self._ranks)

    @cached_property
    def _ranks(self) -> tuple[int, ...]:
        rs = set(self._buffers)
        seen: set[int] = set()
        for t in self.tables.values():
            if id(t.ranks) not in seen:  # tables often share one ranks array
                seen.add(id(t.ranks))
                rs.update(t.ranks.tolist())
        return tuple(sorted(rs))

    @property
    def tensors(self) -> list[TensorSpec]:
        return list(self.specs.values())

    def _rank_index(self) -> dict[int, list[tuple[str, int]]]:
        if self._by_rank is None:
            idx: dict[int, list[tuple[str, int]]] = defaultdict(list)
            for name, t in self.tables.items():
                for i, r in enumerate(t.ranks.tolist()):
                    idx[r].append((name, i))
            self._by_rank = dict(idx)
        return self._by_rank

    def pieces(self, rank: int) -> list[Piece]:
        """The pieces ``rank`` holds, in tensor order."""
        out = []
        for name, i in self._rank_index().get(int(rank), []):
            t = self.tables[name]
            out.append(Piece(name, tuple(t.offsets[i].tolist()), tuple(t.sizes[i].tolist()), t.buffers[i],
                             tuple(t.buffer_offsets[i].tolist()), int(rank)))
        return out

    def all_pieces(self) -> Iterable[Piece]:
        for r in self.ranks:
            yield from self.pieces(r)

    def buffers(self, rank: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{buffer_name: (shape, dtype)}`` of ``rank`` (a copy the caller may change; :meth:`buffer_map`
        to build other layouts of the same side)."""
        return dict(self._buffers.get(int(rank), {}))

    def buffer_map(self, rank: int) -> RankBuffers:
        """``rank``'s buffers as the read-only mapping the layout holds (shared, not copied: for
        building other layouts of the same side)."""
        return self._buffers.get(int(rank), _NO_BUFFERS)

    def buffer_spec(self, rank: int, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of one buffer of one rank."""
        try:
            return self._buffers[rank][name]
        except KeyError:
            raise LayoutError(f"rank {rank} has no buffer {name!r}") from None

    def _dtype_by_name(self) -> dict[str, torch.dtype | None]:
        """Each buffer name's dtype when every rank agrees on it, else ``None``."""
        if self._dtypes is None:
            # each distinct map once: ranks share them, and an overlay's base is shared by many ranks
            maps = list({id(m): m for named in self._buffers.values() for m in named.dtype_maps()}.values())
            seen: dict[str, torch.dtype | None] = dict(maps[0]) if maps else {}
            for more in maps[1:]:
                for b, dt in more.items():
                    seen[b] = dt if seen.get(b, dt) == dt else None
            self._dtypes = seen
        return self._dtypes

    @cached_property
    def _single_dtype(self) -> torch.dtype | None:
        """The dtype of every buffer, if they all share one."""
        dtypes = set(self._dtype_by_name().values())
        return next(iter(dtypes)) if len(dtypes) == 1 else None

    @property
    def single_itemsize(self) -> int | None:
        """Bytes per element of every buffer, where all share one dtype; else None."""
        dtype = self._single_dtype
        return None if dtype is None else dtype.itemsize

    def buffer_itemsize(self, name: str) -> int | None:
        """Bytes per element of the buffers every piece of tensor ``name`` lives in, where their names'
        dtypes are ones every rank agrees on, all one; else None (ask :meth:`buffer_dtypes`). A
        look-up per tensor, for callers that need only the element size."""
        dtype = self._one_dtype(self.tables[name])
        return None if dtype is None else dtype.itemsize

    def common_itemsize(self, names: Iterable[str]) -> int | None:
        """Bytes per element of every piece of every tensor in ``names``, where all their buffers have
        dtypes every rank agrees on, of one size; else None. One look-up by buffer names per tensor, no
        dtype per piece (the planner asks this for every geometry of a model). A tensor's pieces may live in
        buffers of several names (staging numbered per rank: ``w@raw/0``, ``w@raw/1``).

        >>> import torch, reshard as rs
        >>> lay = rs.Layout.from_placements(rs.TensorSpec("w", (4,), torch.float32), [0, 1], (2,), [rs.Shard(0)])
        >>> lay.common_itemsize(["w"])
        4
        """
        if self._single_dtype is not None:
            return self._single_dtype.itemsize
        tables, one_dtype = self.tables, self._one_dtype
        found = None
        for name in names:
            dtype = one_dtype(tables[name])
            if dtype is None or (found is not None and dtype.itemsize != found):
                return None
            found = dtype.itemsize
        return found

    def uniform_dtype(self, name: str) -> torch.dtype | None:
        """The dtype every piece of tensor ``name`` lives in, where they agree, else None:
        ``buffer_dtypes(name).uniform``, without working out each piece's where the buffer names
        tell it (a look-up per tensor, for callers that ask of every tensor of a model).

        >>> import torch
        >>> from reshard.placements import Shard
        >>> lay = Layout.from_placements(TensorSpec("w", (4, 6), torch.float32), [0, 1], (2,), [Shard(0)])
        >>> lay.uniform_dtype("w")
        torch.float32
        """
        return self._one_dtype(self.tables[name]) or self.buffer_dtypes(name).uniform

    def _one_dtype(self, table: PieceTable) -> torch.dtype | None:
        """The dtype of every piece of ``table`` known from its buffer names alone: one dtype
        everywhere, or buffer names whose dtypes every rank agrees on, all one; else None."""
        if self._single_dtype is not None:
            return self._single_dtype
        one = table.one_buffer()
        if one is not None:
            return self._dtype_by_name().get(one)
        by_name = self._dtype_by_name()  # several names (staging numbered per rank: w@raw/0, w@raw/1)
        dtypes = {by_name.get(b) for b in set(table.buffers)}
        return dtypes.pop() if len(dtypes) == 1 else None

    def _dtypes_of_pieces(self, table: PieceTable) -> list[torch.dtype]:
        """The dtype of each piece's buffer, by buffer name where every rank agrees on it, else by rank."""
        by_name = self._dtype_by_name()
        if all(by_name.get(b) is not None for b in set(table.buffers)):
            return [by_name[b] for b in table.buffers]
        return [self._buffers[r][b][1] for r, b in zip(table.ranks.tolist(), table.buffers)]

    def buffer_dtypes(self, name: str) -> BufferDtypes:
        """The dtypes of the buffers the pieces of ``name`` live in: per piece, and the one dtype when
        they agree (see :class:`BufferDtypes`).

        >>> from reshard.placements import Shard
        >>> lay = Layout.from_placements(TensorSpec("w", (4, 6), torch.float32), [0, 1], (2,), [Shard(0)],
        ...                              dtype=torch.bfloat16)
        >>> found = lay.buffer_dtypes("w")
        >>> found.uniform, found.itemsize, found.itemsizes.tolist()
        (torch.bfloat16, 2, [2, 2])

        Answers are kept per tensor with the table they were worked out from: a table replaced in
        ``tables`` (builders do that in place) is worked out anew.
        """
        table = self.tables[name]
        hit = self._dtype_answers.get(name)
        if hit is not None and hit[0] is table:
            return hit[1]
        answer = self._buffer_dtypes_of(table)
        self._dtype_answers[name] = (table, answer)
        return answer

    def _buffer_dtypes_of(self, table: PieceTable) -> BufferDtypes:
        fast = self._one_dtype(table)
        if fast is not None:
            key = (fast, len(table.buffers))
            answer = self._uniform_answers.get(key)
            if answer is None:
                answer = self._uniform_answers[key] = BufferDtypes.of(Repeated(fast, key[1]), fast)
            return answer
        per_piece = self._dtypes_of_pieces(table)
        distinct = set(per_piece)
        return BufferDtypes.of(per_piece, distinct.pop() if len(distinct) == 1 else None)

    def empty_buffers(self, rank: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Zero-filled buffers of ``rank`` (e.g. destination parameters before a refit)."""
        return {b: torch.zeros(shape, dtype=dt, device=device) for b, (shape, dt) in self.buffers(rank).items()}

    def materialize(self, rank: int, full: Mapping[str, torch.Tensor], device: torch.device | str | None = None
                    ) -> dict[str, torch.Tensor]:
        """``rank``'s buffers filled from full logical tensors ``{name: Tensor}``."""
        some = next(iter(full.values()), None)
        dev = device if device is not None else (some.device if some is not None else "cpu")
        out = self.empty_buffers(rank, dev)
        for p in self.pieces(rank):
            if p.tensor not in full:
                raise LayoutError(f"materialize: no full tensor given for {p.tensor!r} (rank {rank})")
            src = full[p.tensor][box_slices(p.offsets, p.sizes)]
            buffer_view(out[p.buffer], p.buffer_offsets, p.sizes).copy_(src)
        return out

    def numel(self, rank: int | None = None) -> int:
        """Elements held (all ranks, or one)."""
        total = 0
        for t in self.tables.values():
            vol = t.sizes.prod(axis=1) if len(t) else np.zeros(0, np.int64)
            total += int(vol.sum() if rank is None else vol[t.ranks == rank].sum())
        return total

    def __repr__(self) -> str:
        n = sum(len(t) for t in self.tables.values())
        return f"Layout({len(self.specs)} tensors, {n} pieces, ranks={self.ranks})"

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise :class:`LayoutError` for a box outside its tensor, a piece outside its buffer,
        two pieces overlapping in one buffer, or a piece whose buffer has the wrong dtype class
        (:func:`~reshard.layout_checks.check_layout`)."""
        check_layout(self.specs, self.tables, self._buffers)


_NO_BUFFERS = RankBuffers()


def _merged_buffers(rank: int, parts: list[RankBuffers]) -> RankBuffers:
    """One rank's buffers from several layouts' (a buffer listed twice must agree)."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for named in parts:
        for b, desc in named.items():
            if b in out and out[b] != desc:
                raise LayoutError(f"rank {rank} buffer {b!r}: layouts disagree on shape/dtype ({out[b]} vs {desc})")
            out[b] = desc
    return RankBuffers(out)


__all__ = ["BufferDtypes", "Layout", "PieceTable", "RankBuffers", "Repeated", "VALIDATE_MAX_PIECES", "geometry_bytes",
           "read_only", "shared_buffers", "shared_geometry_key"]
