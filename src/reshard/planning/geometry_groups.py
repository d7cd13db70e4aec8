"""Tensors that plan alike, grouped: the planner's unit of work.

Tensors sharing a geometry (same shape, same boxes on the same ranks: every layer's
``q_proj``) are one :class:`GeometryGroup`, intersected once and stamped out for each
of its tensors (its *instances*). Geometries that differ only in their rank numbers (the
expert-parallel groups of every pipeline stage, each expert into its own inference GPU) share
one intersection too (:func:`items_key`). Planning cost thus grows with the number of distinct geometries,
not with the number of pieces.

A group's remote items with one candidate replica have their source fixed here; those
with several are chosen per instance later, by :func:`reshard.planning.sources.choose_sources`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..layout import Layout, PieceTable, read_only
from .intersect import FANOUT, REMOTE, TensorItems, tensor_items


@dataclass(eq=False)
class GeometryGroup:
    """Tensors sharing one geometry (instances) and their copies (items).

    ``piece``/``rank`` give each item's source piece and rank (fan-out: the primary
    destination piece); remote items with several candidate replicas are chosen per
    instance, in ``choice_piece``/``choice_rank`` (columns ``choice_cols``).
    """

    items: TensorItems
    tensors: list[str]
    tensor_index: np.ndarray  # int64 [n_inst]: position in Plan.tensors
    piece: np.ndarray  # int64 [n_items]
    rank: np.ndarray  # int64 [n_items]
    dst_rank: np.ndarray  # int64 [n_items]
    nbytes: np.ndarray  # int64 [n_inst, n_items] (often a broadcast view)
    choice_cols: np.ndarray  # int64 [m]
    choice_piece: np.ndarray  # int64 [n_inst, m]
    choice_rank: np.ndarray  # int64 [n_inst, m]

    @cached_property
    def total_bytes(self) -> np.ndarray:
        """Bytes of each item summed over instances."""
        return self.nbytes.sum(axis=0)

    @cached_property
    def choice_of(self) -> np.ndarray:
        """Per item, its column among the choice columns (-1: its source is fixed)."""
        out = np.full(len(self.items), -1, np.int64)
        out[self.choice_cols] = np.arange(len(self.choice_cols))
        return out

    def source_of(self, instance: int, item: int) -> tuple[int, int]:
        """(source piece, source rank) of item ``item`` of instance ``instance``."""
        column = self.choice_of[item]
        if column < 0:
            return int(self.piece[item]), int(self.rank[item])
        return int(self.choice_piece[instance, column]), int(self.choice_rank[instance, column])


def fixed_items(group: GeometryGroup, kind: int, cache: dict) -> np.ndarray:
    """The items of ``kind`` whose source needs no choice (every local and fan-out item, the remote
    ones with one candidate), worked out once per intersection: ``cache`` is a dict kept over one
    pass through groups that stay alive meanwhile (groups alike share their items)."""
    key = (id(group.items), kind)
    found = cache.get(key)
    if found is None:
        found = cache[key] = np.flatnonzero((group.items.kind == kind) & (group.choice_of < 0))
    return found


def items_key(src_table: PieceTable, dst_table: PieceTable) -> bytes | tuple:
    """What :func:`~reshard.planning.intersect.tensor_items` depends on: the boxes of both sides, which
    pieces of each side share a rank (and the ranks' order), and where source ranks are also
    destination ranks; not the rank numbers themselves (intersection reads ranks only to compare and
    order them): the expert-parallel groups of every pipeline stage, and each expert into its own
    inference GPU, plan alike. (A key of a few pieces is a tuple, of more a byte string: the size
    decides which, so tables alike get keys alike.)"""
    src_ranks, dst_ranks = src_table.ranks, dst_table.ranks
    if len(src_ranks) + len(dst_ranks) <= SMALL_TABLES:  # a few pieces (an expert at scale): in Python, no sort
        src_list, dst_list = src_ranks.tolist(), dst_ranks.tolist()
        dst_order = {r: i for i, r in enumerate(sorted(set(dst_list)))}
        src_order = {r: i for i, r in enumerate(sorted(set(src_list)))}
        ids = (tuple([src_order[r] for r in src_list]), tuple([dst_order.get(r, -1) for r in src_list]),
               tuple([dst_order[r] for r in dst_list]))
        return (src_table.offsets.shape, src_table.offsets.tobytes(), src_table.sizes.tobytes(),
                dst_table.offsets.shape, dst_table.offsets.tobytes(), dst_table.sizes.tobytes(), ids)
    _, src_rank_ids = np.unique(src_ranks, return_inverse=True)
    dst_unique, dst_rank_ids = np.unique(dst_ranks, return_inverse=True)
    at = np.searchsorted(dst_unique, src_ranks)
    at = np.minimum(at, max(len(dst_unique) - 1, 0))
    is_destination = (dst_unique[at] == src_ranks) if len(dst_unique) else np.zeros(len(src_ranks), bool)
    local = np.where(is_destination, at, -1)
    return b"|".join([np.array(src_table.offsets.shape, np.int64).tobytes(), src_table.offsets.tobytes(),
                      src_table.sizes.tobytes(), src_rank_ids.astype(np.int64).tobytes(),
                      local.astype(np.int64).tobytes(), np.array(dst_table.offsets.shape, np.int64).tobytes(),
                      dst_table.offsets.tobytes(), dst_table.sizes.tobytes(),
                      dst_rank_ids.astype(np.int64).tobytes()])


SMALL_TABLES = 16  # items_key works out rank ids in Python up to this many pieces on both sides together


def _by_geometry(source: Layout, destination: Layout, tensors: list[str]) -> list[list[str]]:
    """``tensors`` split into lists of tensors sharing a geometry, in order of first appearance."""
    keyed: dict[tuple, list[str]] = {}
    interned: dict[bytes, int] = {}
    by_identity: dict[tuple, tuple] = {}  # tables built from the same arrays (shared by the builders)
    specs, src_tables, dst_tables = destination.specs, source.tables, destination.tables
    for name in tensors:
        src_table, dst_table = src_tables[name], dst_tables[name]
        identity = (specs[name].shape, id(src_table.ranks), id(src_table.offsets), id(src_table.sizes),
                    id(dst_table.ranks), id(dst_table.offsets), id(dst_table.sizes))
        key = by_identity.get(identity)
        if key is None:  # every table stays alive (and unchanged) while planning: ids are unique
            key = by_identity[identity] = (identity[0],
                                           interned.setdefault(src_table.geometry_key(), len(interned)),
                                           interned.setdefault(dst_table.geometry_key(), len(interned)))
        keyed.setdefault(key, []).append(name)
    return list(keyed.values())


def _itemsizes(destination: Layout, names: list[str], num_pieces: int, rows: dict | None = None) -> np.ndarray:
    """Itemsize of every destination piece of each of ``names`` ``[1 or len(names), num_pieces]``
    (one row, often a broadcast view, where all agree); ``rows``: a dict kept over one grouping, where
    the broadcast rows of one size are made once."""
    single = destination.common_itemsize(names)
    if single is not None:  # one buffer dtype for every piece of every tensor
        if rows is None:
            return _broadcast_row(single, num_pieces)
        row = rows.get((single, num_pieces))
        if row is None:
            row = rows[(single, num_pieces)] = _broadcast_row(single, num_pieces)
        return row
    found = [destination.buffer_dtypes(name) for name in names]
    uniform = [dtypes.itemsize for dtypes in found]
    if None not in uniform:  # each tensor's pieces share one buffer itemsize (the common case)
        column = np.array(uniform, np.int64)[:, None]
        if (column == column[0]).all():
            column = column[:1]
        return np.broadcast_to(column, (len(column), num_pieces))
    sizes = [dtypes.itemsizes for dtypes in found]
    same = all(np.array_equal(sizes[0], other) for other in sizes[1:])
    return sizes[0][None, :] if same else np.stack(sizes)


def _broadcast_row(size: int, num_pieces: int) -> np.ndarray:
    return np.broadcast_to(np.array([[size]], np.int64), (1, num_pieces))


@dataclass(frozen=True)
class _ItemParts:
    """What :func:`_make_group` reads of one intersection whatever the ranks: worked out once for
    the groups sharing it."""

    volume: np.ndarray  # elements of each item
    piece: np.ndarray  # source piece of each item whose source needs no choice (-1: remote with a choice)
    from_source: np.ndarray  # items whose sending rank is a source piece's (not fan-out)
    multi: np.ndarray  # remote items with several candidates: the choice columns
    choice_of: np.ndarray  # per item, its column among the choice columns (-1: its source is fixed)

    @classmethod
    def of(cls, items: TensorItems) -> "_ItemParts":
        volume = items.sizes.prod(axis=1) if len(items) else np.zeros(0, np.int64)
        piece = np.where(items.kind == REMOTE, -1, items.source)
        single = (items.kind == REMOTE) & (items.cand_count == 1)  # a remote copy with one candidate
        piece[single] = items.candidates[items.cand_start[single]]
        multi = np.flatnonzero((items.kind == REMOTE) & (items.cand_count > 1))
        choice_of = np.full(len(items), -1, np.int64)
        choice_of[multi] = np.arange(len(multi))
        return cls(volume, piece, np.flatnonzero(items.kind != FANOUT), multi, read_only((choice_of,))[0])


def _make_group(items: TensorItems, parts: _ItemParts, names: list[str], tensor_index: np.ndarray,
                src_table: PieceTable, dst_table: PieceTable, itemsizes: np.ndarray, shared: dict
                ) -> GeometryGroup:
    """The group of ``names`` (one geometry, its ``items``), with every source that needs no choice;
    ``shared``: a dict kept over one grouping (bytes per item of an intersection in one itemsize, their
    views over as many instances and their sums: read-only arrays groups alike share)."""
    num_instances, num_multi = len(names), len(parts.multi)
    total = None
    if itemsizes.shape[0] == 1 and itemsizes.strides[1] == 0:  # one itemsize: bytes per item shared
        key = (id(items), int(itemsizes[0, 0]), num_instances)
        hit = shared.get(key)
        if hit is None:
            row = read_only((parts.volume * int(itemsizes[0, 0]),))[0][None, :]
            nbytes = np.broadcast_to(row, (num_instances, len(items)))
            hit = shared[key] = (nbytes, read_only((nbytes.sum(axis=0),))[0])
        nbytes, total = hit
    else:
        nbytes = np.broadcast_to(itemsizes[:, items.dst_piece] * parts.volume[None, :], (num_instances, len(items)))
    dst_rank = dst_table.ranks[items.dst_piece]
    rank = dst_rank.copy()  # fan-out: the destination rank itself
    rank[parts.from_source] = src_table.ranks[parts.piece[parts.from_source]]
    group = GeometryGroup(
        items, names, tensor_index, parts.piece, rank, dst_rank, nbytes,
        parts.multi, np.zeros((num_instances, num_multi), np.int64), np.zeros((num_instances, num_multi), np.int64),
    )
    group.__dict__["choice_of"] = parts.choice_of  # the cached properties, shared by groups alike
    if total is not None:
        group.__dict__["total_bytes"] = total
    return group


def group_tensors(source: Layout, destination: Layout, tensors: list[str]) -> list[GeometryGroup]:
    """One :class:`GeometryGroup` per geometry of ``tensors`` (each group's ``tensor_index`` is a
    position in ``tensors``); sources with several candidates are left to choose."""
    position = {name: i for i, name in enumerate(tensors)}
    groups: list[GeometryGroup] = []
    same_boxes: dict[bytes, tuple[TensorItems, _ItemParts]] = {}
    shared: dict = {}  # arrays groups alike share (read-only)
    for names in _by_geometry(source, destination, tensors):
        first = names[0]
        src_table, dst_table = source.tables[first], destination.tables[first]
        key = items_key(src_table, dst_table)  # geometries that differ only in their rank numbers
        hit = same_boxes.get(key)
        if hit is None:
            items = tensor_items(first, src_table, dst_table)
            hit = same_boxes[key] = (items, _ItemParts.of(items))
        tensor_index = np.array([position[name] for name in names], np.int64)
        groups.append(_make_group(*hit, names, tensor_index, src_table, dst_table,
                                  _itemsizes(destination, names, len(dst_table), shared), shared))
    return groups
