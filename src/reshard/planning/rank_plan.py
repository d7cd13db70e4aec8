"""The per-rank view of a plan: one rank's sends, receives, local and fan-out copies.

``plan.for_rank(r)`` builds only rank ``r``'s part: of every geometry group it takes the
items ``r`` sends or receives, makes their copy records with array operations across the
group's tensors, and cuts each (source, destination) stream into rounds under the plan's
per-round quotas::

    sends   [Message(peer, round, copies)]   packed and sent by r
    recvs   [Message(peer, round, copies)]   received and unpacked by r
    local   [Copy]   source buffer -> destination buffer on r, no wire
    fanout  [Copy]   destination buffer -> destination buffer on r, after all rounds
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from itertools import repeat
from typing import Callable, Mapping

import numpy as np

from ..layout import Layout
from .geometry_groups import GeometryGroup
from .intersect import FANOUT, LOCAL, REMOTE
from .schedule import Copy, Message, chunk_stream

Quotas = Mapping[tuple[int, int], "int | None"]  # per-round staging quota of each (source, destination) stream


@dataclass
class RankPlan:
    """One rank's part of a plan."""

    rank: int
    sends: list[Message] = field(default_factory=list)
    recvs: list[Message] = field(default_factory=list)
    local: list[Copy] = field(default_factory=list)
    fanout: list[Copy] = field(default_factory=list)

    @property
    def num_rounds(self) -> int:
        return 1 + max((m.round for m in self.sends + self.recvs), default=-1)

    def round(self, j: int) -> tuple[list[Message], list[Message]]:
        """(sends, receives) of round ``j``."""
        return self._by_round.get(j, ([], []))

    @cached_property
    def _by_round(self) -> dict[int, tuple[list[Message], list[Message]]]:
        out: dict[int, tuple[list[Message], list[Message]]] = defaultdict(lambda: ([], []))
        for m in self.sends:
            out[m.round][0].append(m)
        for m in self.recvs:
            out[m.round][1].append(m)
        return dict(out)

    @property
    def send_bytes(self) -> int:
        return sum(m.payload_bytes for m in self.sends)

    @property
    def recv_bytes(self) -> int:
        return sum(m.payload_bytes for m in self.recvs)

    def peak_staging_bytes(self) -> int:
        """Largest staging (send + receive buffers, alignment included) of any round."""
        per_round: dict[int, int] = defaultdict(int)
        for m in self.sends + self.recvs:
            per_round[m.round] += m.nbytes
        return max(per_round.values(), default=0)


def rows_by_rank(group: GeometryGroup) -> dict[int, _Rows]:
    """Every rank's rows of ``group`` at once, each the rows :meth:`RankPlanBuilder._rows_of` gives it
    in its order (fixed sources by instance then item, then chosen ones by instance then column); a
    rank with none is left out. Per rank ::

        fixed items 0, 1 (ranks 5->7, 6->7), two instances  ->  5: (0,0) (1,0)   6: (0,1) (1,1)
                                                               7: (0,0) (0,1) (1,0) (1,1)
    """
    num_inst, num_items = len(group.tensors), len(group.items)
    fixed = np.flatnonzero(group.choice_of < 0)
    # (rank, item) of each fixed item's sending and receiving rank, once each, by rank then item
    key = np.unique(np.concatenate([group.rank[fixed], group.dst_rank[fixed]]) * num_items
                    + np.concatenate([fixed, fixed]))
    fixed_rank, fixed_item = np.divmod(key, num_items)
    ranks_f, start_f, count_f = np.unique(fixed_rank, return_index=True, return_counts=True)
    # each rank's items over every instance, instance by instance
    rows_f = count_f * num_inst
    seg = np.repeat(np.arange(len(ranks_f)), rows_f)
    within = np.arange(int(rows_f.sum())) - np.repeat(np.cumsum(rows_f) - rows_f, rows_f)
    instance = within // count_f[seg]
    item = fixed_item[start_f[seg] + within % count_f[seg]]
    rank_of = ranks_f[seg]
    piece, src_rank = group.piece[item], group.rank[item]
    cols, m = group.choice_cols, len(group.choice_cols)
    if m:
        size = num_inst * m
        flat = np.arange(size)
        dst = np.broadcast_to(group.dst_rank[cols][None, :], (num_inst, m)).ravel()
        key = np.unique(np.concatenate([group.choice_rank.ravel() * size + flat, dst * size + flat]))
        chosen_rank, chosen = np.divmod(key, size)
        inst, col = np.divmod(chosen, m)
        instance = np.concatenate([instance, inst])
        item = np.concatenate([item, cols[col]])
        piece = np.concatenate([piece, group.choice_piece[inst, col]])
        src_rank = np.concatenate([src_rank, group.choice_rank[inst, col]])
        rank_of = np.concatenate([rank_of, chosen_rank])
    order = np.argsort(rank_of, kind="stable")  # per rank: its fixed rows, then its chosen ones
    rank_of, instance, item, piece, src_rank = (a[order] for a in (rank_of, instance, item, piece, src_rank))
    ranks, starts = np.unique(rank_of, return_index=True)
    bounds = [*starts.tolist(), len(rank_of)]
    return {r: _Rows(instance[a:b], item[a:b], piece[a:b], src_rank[a:b])
            for r, a, b in zip(ranks.tolist(), bounds[:-1], bounds[1:])}


def _row_tuples(array: np.ndarray) -> list[tuple[int, ...]]:
    """Rows of a 2-D int array as tuples (column-wise ``tolist`` + ``zip``: the fast way)."""
    if array.shape[1] == 0:
        return [()] * len(array)
    return list(zip(*array.T.tolist()))


def _box_starts(stack: np.ndarray, slots: np.ndarray, piece: np.ndarray, offsets: np.ndarray, boxes: np.ndarray
                ) -> list[tuple[int, ...]]:
    """Where boxes at ``offsets`` (tensor coordinates) start in their buffers, as tuples: each one's piece's
    buffer offsets (``stack[slots, piece]``) moved in the trailing dims by the box's offset inside that
    piece (``boxes[piece]``: where each piece starts in the tensor)."""
    at = stack[slots, piece]
    at[:, at.shape[1] - offsets.shape[1]:] += offsets - boxes[piece]
    return _row_tuples(at)


@dataclass
class _Stacked:
    """One group's tensors sorted into classes by their buffers' numbers of dims, each class with its
    pieces' buffer offsets stacked ``[arrays, pieces, dims]`` (source, destination; tensors sharing
    an offsets array share a slot); each tensor's class and slots in it; and every tensor's buffer
    names and piece dtypes."""

    class_of: np.ndarray  # int64 [n_inst]
    slot: np.ndarray  # int64 [n_inst, 2]: (source, destination) slot in its class's stacks
    stacks: list[tuple[np.ndarray, np.ndarray]]  # per class: (source, destination) stacked offsets
    src_buffers: list  # per tensor: source buffer name of each piece
    dst_buffers: list  # per tensor: destination buffer name of each piece
    dtypes: list  # per tensor: dtype of each destination piece


@dataclass
class _Rows:
    """Rows (instance, item, source piece, source rank) of one group that one rank takes part in."""

    instance: np.ndarray
    item: np.ndarray
    piece: np.ndarray
    src_rank: np.ndarray


class RankPlanBuilder:
    """Builds rank parts of the plan of ``groups`` (sources chosen) from ``source`` to ``destination``;
    keeps, per group, what every rank's copies reuse."""

    def __init__(self, source: Layout, destination: Layout, groups: list[GeometryGroup]) -> None:
        self.source = source
        self.destination = destination
        self.groups = groups
        self._stacked_cache: dict[int, _Stacked] = {}
        self._groups_by_rank: dict[int, list[int]] | None = None
        self._pending_rows: dict[int, dict[int, _Rows]] = {}  # per group: the rows of ranks not yet built
        self._remote_only: dict[int, tuple] = {}  # id of an intersection -> (it, whether all its items are remote)
        self._built_one = False

    def build(self, rank: int, quotas: Callable[[], Quotas]) -> RankPlan:
        """``rank``'s sends, receives, local and fan-out copies; other ranks' copies are not built.
        ``quotas()`` gives each stream's per-round quota (empty: no cap, one round); it is asked only
        where the rank has a stream."""
        out = RankPlan(rank)
        remote_copies: list[Copy] = []  # remote copies of every group, then sorted into streams
        keys: list[tuple[np.ndarray, ...]] = []
        every_rank = self._groups_by_rank is not None  # parts of several ranks asked for: rows made per group
        for index in self._groups_of(rank):
            group = self.groups[index]
            rows = self._rows_taken(index, rank) if every_rank else self._rows_of(group, rank)
            if not len(rows.instance):
                continue
            if self._all_remote(group):  # the common case between disjoint ranks: no local or fan-out item
                remote_copies.extend(self._group_copies(group, rows.instance, rows.item, rows.piece, None))
                keys.append((rows.src_rank, group.dst_rank[rows.item], group.tensor_index[rows.instance], rows.item))
                continue
            kind = group.items.kind[rows.item]
            copies = self._group_copies(group, rows.instance, rows.item, rows.piece, kind == FANOUT)
            for wanted, into in ((LOCAL, out.local), (FANOUT, out.fanout)):
                found = np.flatnonzero(kind == wanted)
                if len(found):
                    into.extend(copies[row] for row in found.tolist())
            remote = np.flatnonzero(kind == REMOTE)
            if not len(remote):
                continue
            remote_copies.extend(copies[row] for row in remote.tolist())
            item = rows.item[remote]
            keys.append((rows.src_rank[remote], group.dst_rank[item], group.tensor_index[rows.instance[remote]], item))
        if keys:
            self._add_messages(out, remote_copies, keys, quotas())
        out.sends.sort(key=lambda m: (m.round, m.peer))
        out.recvs.sort(key=lambda m: (m.round, m.peer))
        return out

    def _all_remote(self, group: GeometryGroup) -> bool:
        """Whether every item of ``group`` is a remote copy, once per intersection (groups alike share it)."""
        items = group.items
        hit = self._remote_only.get(id(items))
        if hit is None:
            hit = self._remote_only[id(items)] = (items, bool((items.kind == REMOTE).all()))
        return hit[1]

    def _groups_of(self, rank: int) -> list[int] | range:
        """Indices, in order, of the groups that name ``rank`` as a source or destination of any
        item (a superset of those it sends or receives in), so a rank's part visits only those.
        The first part built visits every group (a rank planning only its own part pays nothing
        more); the second builds the index for every rank, in one sort over all groups' ranks::

            group 0: ranks 0, 2    group 1: ranks 1, 2    ->    {0: [0], 1: [1], 2: [0, 1]}
        """
        if self._groups_by_rank is None:
            if not self._built_one or not self.groups:
                self._built_one = True
                return range(len(self.groups))
            named = [np.concatenate([g.rank, g.dst_rank, g.choice_rank.ravel()]) for g in self.groups]
            count = len(named)
            keys = np.unique(np.concatenate(named) * count
                             + np.repeat(np.arange(count, dtype=np.int64), [len(n) for n in named]))
            ranks, owner = np.divmod(keys, count)  # sorted by rank, then group
            cut = np.flatnonzero(ranks[1:] != ranks[:-1]) + 1
            starts = [0, *cut.tolist()]
            groups = (chunk.tolist() for chunk in np.split(owner, cut))
            self._groups_by_rank = dict(zip(ranks[starts].tolist(), groups))
        return self._groups_by_rank.get(rank, [])

    def _rows_taken(self, index: int, rank: int) -> _Rows:
        """:meth:`_rows_of` for ``rank``, out of every rank's rows of group ``index`` made at its first
        visit (:func:`rows_by_rank`), each handed out once and then dropped (a rank asked for again, or
        one with no rows, is worked out alone)."""
        pending = self._pending_rows.get(index)
        if pending is None:
            pending = self._pending_rows[index] = rows_by_rank(self.groups[index])
        rows = pending.pop(rank, None)
        return rows if rows is not None else self._rows_of(self.groups[index], rank)

    @staticmethod
    def _rows_of(group: GeometryGroup, rank: int) -> _Rows:
        """The rows of ``group`` that ``rank`` sends or receives (fixed sources, then chosen ones)."""
        cols = np.flatnonzero((group.choice_of < 0) & ((group.rank == rank) | (group.dst_rank == rank)))
        instance = np.repeat(np.arange(len(group.tensors)), len(cols))
        item = np.tile(cols, len(group.tensors))
        piece, src_rank = group.piece[item], group.rank[item]
        if len(group.choice_cols):
            chosen_inst, chosen_col = np.nonzero((group.choice_rank == rank)
                                                 | (group.dst_rank[group.choice_cols][None, :] == rank))
            instance = np.concatenate([instance, chosen_inst])
            item = np.concatenate([item, group.choice_cols[chosen_col]])
            piece = np.concatenate([piece, group.choice_piece[chosen_inst, chosen_col]])
            src_rank = np.concatenate([src_rank, group.choice_rank[chosen_inst, chosen_col]])
        return _Rows(instance, item, piece, src_rank)

    @staticmethod
    def _add_messages(out: RankPlan, copies: list[Copy], keys: list[tuple[np.ndarray, ...]], quotas: Quotas) -> None:
        """One stream per (source, destination) pair, copies ordered by (tensor, item), cut into
        rounds of at most its quota: the messages ``out.rank`` sends and receives."""
        src, dst, tensor, item = (np.concatenate(column) for column in zip(*keys))
        order = np.lexsort((item, tensor, dst, src))
        src, dst = src[order], dst[order]
        cut = np.flatnonzero((src[1:] != src[:-1]) | (dst[1:] != dst[:-1])) + 1
        bounds = [0, *cut.tolist(), len(order)]
        order = order.tolist()
        for begin, end in zip(bounds[:-1], bounds[1:]):
            sender, receiver = int(src[begin]), int(dst[begin])
            quota = quotas.get((sender, receiver))
            stream = [copies[x] for x in order[begin:end]]
            for round_index, chunk in enumerate(chunk_stream(stream, quota)):
                if sender == out.rank:
                    out.sends.append(Message(receiver, round_index, chunk))
                else:
                    out.recvs.append(Message(sender, round_index, chunk))

    def _group_copies(self, group: GeometryGroup, inst: np.ndarray, items: np.ndarray,
                      pieces: np.ndarray, fan: np.ndarray | None) -> list[Copy]:
        """Copy records of rows (instance, item, source piece) of one group (for fan-out items, ``fan``
        true, the source piece is a destination piece; None: no row is), with array operations across
        the group's tensors."""
        stacked = self._stacked(group)
        group_items = group.items
        offsets, dst_pieces = group_items.offsets[items], group_items.dst_piece[items]
        if fan is not None and not fan.any():
            fan = None
        src_off, dst_off = self._buffer_offsets(group, stacked, inst, offsets, dst_pieces, pieces, fan)
        names, dtypes = group.tensors, stacked.dtypes
        src_buffers, dst_buffers = stacked.src_buffers, stacked.dst_buffers
        return [
            Copy(names[i], offset, size, (dst_buffers[i][piece] if fanned else src_buffers[i][piece]), src_at,
                 dst_buffers[i][dst_piece], dst_at, dtypes[i][dst_piece])
            for i, offset, size, piece, fanned, src_at, dst_piece, dst_at in zip(
                inst.tolist(), _row_tuples(offsets), _row_tuples(group_items.sizes[items]), pieces.tolist(),
                repeat(False) if fan is None else fan.tolist(), src_off, dst_pieces.tolist(), dst_off)
        ]

    def _buffer_offsets(self, group: GeometryGroup, stacked: _Stacked, inst: np.ndarray, offsets: np.ndarray,
                        dst_pieces: np.ndarray, pieces: np.ndarray, fan: np.ndarray) -> tuple[list, list]:
        """Where each row's box starts in its source buffer (fan-out: the primary destination
        piece's buffer) and in its destination buffer, as tuples."""
        name0 = group.tensors[0]
        src_table, dst_table = self.source.tables[name0], self.destination.tables[name0]  # same boxes in every instance
        if fan is None and len(stacked.stacks) == 1:  # every row from a source piece, one class: no selection
            src_stack, dst_stack = stacked.stacks[0]
            return (_box_starts(src_stack, stacked.slot[inst, 0], pieces, offsets, src_table.offsets),
                    _box_starts(dst_stack, stacked.slot[inst, 1], dst_pieces, offsets, dst_table.offsets))
        if fan is None:
            fan = np.zeros(len(inst), bool)
        src_off: list = [None] * len(inst)
        dst_off: list = [None] * len(inst)
        for cls, (src_stack, dst_stack) in enumerate(stacked.stacks):
            rows = np.flatnonzero(stacked.class_of[inst] == cls) if len(stacked.stacks) > 1 else np.arange(len(inst))
            for stack, side, boxes, select, out in ((src_stack, 0, src_table.offsets, ~fan[rows], src_off),
                                                    (dst_stack, 1, dst_table.offsets, fan[rows], src_off),
                                                    (dst_stack, 1, dst_table.offsets, None, dst_off)):
                chosen = rows if select is None else rows[select]
                if not len(chosen):
                    continue
                piece = dst_pieces[chosen] if select is None else pieces[chosen]
                starts = _box_starts(stack, stacked.slot[inst[chosen], side], piece, offsets[chosen], boxes)
                if len(chosen) == len(inst):
                    out[:] = starts
                else:
                    for row, value in zip(chosen.tolist(), starts):
                        out[row] = value
        return src_off, dst_off

    def _stacked(self, group: GeometryGroup) -> _Stacked:
        """The group's :class:`_Stacked`, made on first use."""
        hit = self._stacked_cache.get(id(group))
        if hit is None:
            hit = self._stacked_cache[id(group)] = self._stack(group)
        return hit

    def _stack(self, group: GeometryGroup) -> _Stacked:
        src = [self.source.tables[name] for name in group.tensors]
        dst = [self.destination.tables[name] for name in group.tensors]
        classes: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, (src_table, dst_table) in enumerate(zip(src, dst)):
            classes[(src_table.buffer_offsets.shape[1], dst_table.buffer_offsets.shape[1])].append(i)
        class_of = np.zeros(len(group.tensors), np.int64)
        slot = np.zeros((len(group.tensors), 2), np.int64)
        stacks = []
        for cls, members in enumerate(classes.values()):
            class_of[members] = cls
            pair = []
            for side, tables in enumerate((src, dst)):
                arrays: dict[int, int] = {}
                unique = []
                for i in members:
                    array = tables[i].buffer_offsets
                    index = arrays.get(id(array))
                    if index is None:
                        index = arrays[id(array)] = len(unique)
                        unique.append(array)
                    slot[i, side] = index
                pair.append(np.stack(unique))
            stacks.append(tuple(pair))
        dtypes = [self.destination.buffer_dtypes(name).per_piece for name in group.tensors]
        return _Stacked(class_of, slot, stacks, [t.buffers for t in src], [t.buffers for t in dst], dtypes)
