"""Source choice: which replica sends each remote copy that several source ranks could send.

Largest copies first, each goes to its least-loaded candidate rank (ties: lowest rank);
the instances of a geometry (the tensors of one :class:`~reshard.planning.geometry_groups.GeometryGroup`)
are dealt round-robin over the candidates in that order. Columns of one group with the
same candidates and bytes are dealt as one run where the order cannot change within it, and
consecutive columns whose pools are the same or share no rank as one *stretch*, each pool's
columns together (a column touches its own pool's loads only, so the order between pools
sharing no rank changes no choice)::

    work (largest first)   pool            dealt
    column a               ranks {0, 1}    stretch 1, pool {0, 1}: a, c in this order
    column b               ranks {4, 5}    stretch 1, pool {4, 5}: b
    column c               ranks {0, 1}
    column d               ranks {1, 4}    overlaps both: stretch 2 starts here

A pool's columns in a stretch are dealt in closed form where that is exact (:func:`deal_one_each`:
a water-fill for one instance per column, a round in sorted order once the candidates are level).

With ``domains`` (an array rank -> NVLink domain), candidates in the destination's own
domain come first (those bytes never leave it), and the load balanced among the others
is what each rank sends out of its domain (its NIC egress; see
:mod:`reshard.planning.hierarchy`).
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from ..layout import Layout
from .geometry_groups import GeometryGroup, fixed_items
from .intersect import REMOTE


class WorkArrays(NamedTuple):
    """Every choice column, largest first (sorted as ``(-bytes, group, column)`` tuples sort), with
    what the dealing reads of it: its pool, its group's instance count, whether it can join a
    stretch, and where the run or stretch from it ends at the latest."""

    neg: np.ndarray  # -bytes of the column over all instances
    group: np.ndarray  # group index
    column: np.ndarray  # choice column in its group
    pool: np.ndarray  # its pool's id
    instances: np.ndarray  # its group's tensors
    stretch: np.ndarray  # bool: more candidates dealt over than instances, one size per column
    run_end: np.ndarray  # end of the columns from here on with the same bytes, group and pool
    stretch_end: np.ndarray  # the next column that cannot join a stretch


def _next_false(flags: np.ndarray) -> np.ndarray:
    """For each position, the first position at or after it whose flag is False (``len(flags)``: none).

    >>> _next_false(np.array([True, False, True, True])).tolist()
    [1, 1, 4, 4]
    """
    n = len(flags)
    at = np.where(flags, n, np.arange(n))
    return np.minimum.accumulate(at[::-1])[::-1] if n else at


def choose_sources(groups: list[GeometryGroup], source: Layout, domains: np.ndarray | None) -> None:
    """Fill every group's ``choice_piece``/``choice_rank`` (see module doc)."""
    _SourceChooser(groups, source, domains).choose()


def dealt_bytes(group: GeometryGroup, column: int, num_candidates: int) -> list[int]:
    """Bytes each of ``num_candidates`` candidates gets when the instances of choice column
    ``column`` are dealt round-robin (instance i to the ``i % num_candidates``-th candidate in order)."""
    num_instances = len(group.tensors)
    nbytes = group.nbytes[:, int(group.choice_cols[column])]
    if nbytes.strides[0] == 0 or num_instances == 1:  # one size for every instance
        each, rest = divmod(num_instances, num_candidates)
        size = int(nbytes[0])
        return [(each + (place < rest)) * size for place in range(num_candidates)]
    return np.bincount(np.arange(num_instances) % num_candidates, weights=nbytes,
                       minlength=num_candidates).astype(np.int64).tolist()


def fill_choices(group: GeometryGroup, orders: list[list[int]], source: Layout) -> None:
    """Write the chosen pieces and ranks: instance i of choice column c takes candidate
    ``orders[c][i % len(orders[c])]``."""
    items = group.items
    num_instances = len(group.tensors)
    starts = items.cand_start[group.choice_cols]
    counts = np.array([len(order) for order in orders], np.int64)  # candidates dealt to (all, or the near ones)
    for count in np.unique(counts).tolist():  # columns dealt over `count` candidates, all at once
        cols = np.flatnonzero(counts == count)
        order = np.array([orders[c] for c in cols.tolist()], np.int64).reshape(len(cols), count)
        slot = order[:, np.arange(num_instances) % count]  # [cols, instances]
        pieces = items.candidates[starts[cols][:, None] + slot]
        group.choice_piece[:, cols] = pieces.T
    group.choice_rank[:] = source.tables[group.tensors[0]].ranks[group.choice_piece]


def _near_homes(group: GeometryGroup, source: Layout, domains: np.ndarray) -> list[int]:
    """Per choice column of ``group``, its destination's domain where a candidate lies in it (the
    candidates dealt over are then the near ones), else -1 (all of them: columns alike share a pool
    whatever their domains)."""
    items, cols = group.items, group.choice_cols
    homes = domains[group.dst_rank[cols]]
    counts = items.cand_count[cols]
    column = np.repeat(np.arange(len(cols)), counts)
    at = np.repeat(items.cand_start[cols] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(len(column))
    ranks = source.tables[group.tensors[0]].ranks[items.candidates[at]]
    near = np.zeros(len(cols), bool)
    near[column[domains[ranks] == homes[column]]] = True
    return np.where(near, homes, -1).tolist()


def _one_span(starts: np.ndarray, counts: np.ndarray) -> tuple[int, int] | None:
    """(start, count) shared by every column of a group whose columns all have the same candidates, else
    None (a group's columns that the relay plan deals: one box's seeds, for every domain that takes it)."""
    if len(starts) < BULK_COLUMNS or (starts != starts[0]).any() or (counts != counts[0]).any():
        return None
    return int(starts[0]), int(counts[0])


def _by_load(pool, ranks: list[int], load: list[int], count: int) -> list[int]:
    """The ``count`` least-loaded candidates of ``pool`` (positions in ``ranks``), least first; ties: lowest rank."""
    if len(pool) == 2:  # the common case (two replicas), without a sort
        first, second = pool
        if (load[ranks[first]], ranks[first]) <= (load[ranks[second]], ranks[second]):
            return [first, second]
        return [second, first]
    return sorted(pool, key=lambda x: (load[ranks[x]], ranks[x]))[:count]


class _Pool(NamedTuple):
    """The candidates columns alike are dealt over: ``ranks`` (a column's candidate ranks, in its
    order: orders are positions in it), ``positions`` (those dealt over: the near ones, or all),
    whether they are balanced by the near load, and their ranks."""

    ranks: list[int]
    positions: range | list[int]
    near: bool
    members: list[int]


STRETCH_WINDOW = 512  # columns looked at for a stretch's end, doubled until it ends inside
BULK_COLUMNS = 32  # groups with at least this many choice columns find their pools with numpy


def _distinct_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a row of each distinct value, the distinct value of each row) of an int64 matrix: rows hashed to
    one int64 each (checked: ``np.unique(axis=0)`` where two rows alike in hash differ); the columns of
    a group usually share their candidates, so usually there is one.

    >>> rows = np.array([[3, 4], [1, 2], [3, 4]])
    >>> first, inverse = _distinct_rows(rows)
    >>> len(first), bool((rows[first][inverse] == rows).all()), bool(inverse[0] == inverse[2])
    (2, True, True)
    """
    if (rows == rows[0]).all():
        return np.zeros(1, np.int64), np.zeros(len(rows), np.int64)
    weights = np.random.default_rng(len(rows[0])).integers(1, 1 << 62, rows.shape[1]) | 1
    hashed = (rows * weights).sum(axis=1)  # wraps around in int64: a hash
    _, first, inverse = np.unique(hashed, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    if (rows == rows[first][inverse]).all():
        return first, inverse
    _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)


class _SourceChooser:
    """The state of one source choice: every source rank's load so far and each column's order."""

    def __init__(self, groups: list[GeometryGroup], source: Layout, domains: np.ndarray | None) -> None:
        self.groups = groups
        self.source = source
        self.domains = domains
        self.domain_of = domains.tolist() if domains is not None else None
        self.load: list[int] = []  # bytes each rank sends (with domains: out of the destination's domain)
        self.near_load: list[int] = []  # bytes sent within the destination's domain
        self.pools: list[_Pool] = []  # by id
        self.pool_ids: dict[tuple, int] = {}  # (candidate ranks, near domain or -1) -> its pool's id
        self.pool_of: dict[int, list[int]] = {}  # per group, per choice column: its pool's id
        self.orders: dict[int, list[list[int]]] = {}  # per group, per choice column: candidates in dealing order

    def choose(self) -> None:
        work = self._work()
        start = 0
        while start < len(work.group):
            start = self._deal_stretch(work, start) if work.stretch[start] else self._deal_run(work, start)
        for index, group in enumerate(self.groups):
            if len(group.choice_cols):
                fill_choices(group, self.orders[index], self.source)

    def _work(self) -> WorkArrays:
        """Every choice column, largest first; sets each rank's load from the copies with one candidate."""
        domains = self.domains
        fixed_of: dict = {}  # remote items of one candidate, per intersection
        ranks, nbytes = [], []  # of the fixed copies that load a rank
        neg, index, column = [], [], []
        for g, group in enumerate(self.groups):
            fixed = fixed_items(group, REMOTE, fixed_of)
            if len(fixed):
                if domains is not None:
                    fixed = fixed[domains[group.rank[fixed]] != domains[group.dst_rank[fixed]]]
                ranks.append(group.rank[fixed])
                nbytes.append(group.total_bytes[fixed])
            cols = len(group.choice_cols)
            if cols:
                neg.append(-group.total_bytes[group.choice_cols])
                index.append(np.full(cols, g, np.int64))
                column.append(np.arange(cols, dtype=np.int64))
        fixed_load = np.zeros(max(self.source.ranks, default=0) + 1, np.int64)
        if ranks:  # exact: integer sums
            np.add.at(fixed_load, np.concatenate(ranks), np.concatenate(nbytes).astype(np.int64))
        self.load = fixed_load.tolist()  # plain ints: the dealing does a few list operations per copy
        self.near_load = [0] * len(self.load)
        return self._work_arrays(neg, index, column)

    def _work_arrays(self, neg: list[np.ndarray], index: list[np.ndarray], column: list[np.ndarray]) -> WorkArrays:
        """The columns sorted as (-bytes, group, column) tuples sort, each with its pool (every group's
        pools made here), and where each next run or stretch may end."""
        if not neg:
            empty = np.zeros(0, np.int64)
            return WorkArrays(empty, empty, empty, empty, empty, np.zeros(0, bool), empty, empty)
        neg_all, index_all, column_all = np.concatenate(neg), np.concatenate(index), np.concatenate(column)
        order = np.lexsort((column_all, index_all, neg_all))
        neg_all, index_all, column_all = neg_all[order], index_all[order], column_all[order]
        starts = np.zeros(len(self.groups), np.int64)  # where each group's columns start among all pools
        pools: list[int] = []
        for g in dict.fromkeys(index_all.tolist()):  # pools made in the order the dealing meets them
            starts[g] = len(pools)
            pools.extend(self._start_group(g))
        pool = np.array(pools, np.int64)[starts[index_all] + column_all]
        instances = np.array([len(group.tensors) for group in self.groups], np.int64)[index_all]
        one_size = np.array([group.nbytes.strides[0] == 0 or len(group.tensors) == 1 for group in self.groups])[index_all]
        dealt_over = np.array([len(p.positions) for p in self.pools], np.int64)[pool]
        stretch = (dealt_over > instances) & one_size
        same = np.zeros(len(neg_all), bool)  # the column before has the same bytes, group and pool
        same[1:] = (neg_all[1:] == neg_all[:-1]) & (index_all[1:] == index_all[:-1]) & (pool[1:] == pool[:-1])
        run_end = np.append(_next_false(same)[1:], len(same))
        return WorkArrays(neg_all, index_all, column_all, pool, instances, stretch, run_end, _next_false(stretch))

    def _start_group(self, index: int) -> list[int]:
        """The pool id of each of group ``index``'s choice columns (its state made on first use)."""
        ids = self.pool_of.get(index)
        if ids is None:
            group = self.groups[index]
            items, cols = group.items, group.choice_cols
            ranks = self.source.tables[group.tensors[0]].ranks[items.candidates]  # of every candidate
            starts, counts = items.cand_start[cols], items.cand_count[cols]
            span = _one_span(starts, counts)
            if span is not None:
                ids = self._one_candidate_set(group, ranks[span[0]: span[0] + span[1]])
            else:
                ids = self._column_pools(group, ranks, starts, counts)
            self.pool_of[index] = ids
            self.orders[index] = [[]] * len(cols)
        return ids

    def _column_pools(self, group: GeometryGroup, ranks: np.ndarray, starts: np.ndarray, counts: np.ndarray
                      ) -> list[int]:
        """The pool id of each choice column of ``group`` (``ranks``: of every candidate; ``starts``,
        ``counts``: each column's candidates among them), column by column."""
        homes = (_near_homes(group, self.source, self.domains) if self.domain_of is not None
                 else [-1] * len(starts))
        if len(starts) < BULK_COLUMNS:
            flat = ranks.tolist()
            return [self._pool_id(tuple(flat[a: a + n]), home)
                    for a, n, home in zip(starts.tolist(), counts.tolist(), homes)]
        found = np.zeros(len(starts), np.int64)  # columns alike found with numpy, each distinct one interned once
        homes_array = np.array(homes, np.int64)
        for n in np.unique(counts).tolist():
            some = np.flatnonzero(counts == n)
            rows = np.concatenate([ranks[starts[some][:, None] + np.arange(n)], homes_array[some][:, None]], axis=1)
            first, inverse = _distinct_rows(rows)
            interned = [self._pool_id(tuple(row[:-1]), row[-1]) for row in rows[first].tolist()]
            found[some] = np.array(interned, np.int64)[inverse]
        return found.tolist()

    def _one_candidate_set(self, group: GeometryGroup, ranks: np.ndarray) -> list[int]:
        """The pool id of each choice column of ``group``, whose columns all have the candidate ``ranks``:
        one pool per destination domain holding a candidate (its near positions found by one sort), one
        for all the others (as :func:`_near_homes` decides, once per domain instead of per column)."""
        candidates = tuple(ranks.tolist())
        if self.domains is None:
            return [self._pool_id(candidates, -1)] * len(group.choice_cols)
        where = self.domains[ranks]
        order = np.argsort(where, kind="stable")  # positions by domain, ascending within one
        distinct, inverse = np.unique(self.domains[group.dst_rank[group.choice_cols]], return_inverse=True)
        low = np.searchsorted(where[order], distinct, "left").tolist()
        high = np.searchsorted(where[order], distinct, "right").tolist()
        interned = [self._pool_id(candidates, home, order[a:b].tolist()) if b > a else self._pool_id(candidates, -1)
                    for home, a, b in zip(distinct.tolist(), low, high)]
        return np.array(interned, np.int64)[inverse.reshape(-1)].tolist()

    def _pool_id(self, ranks: tuple[int, ...], home: int, near: list[int] | None = None) -> int:
        """The id of the pool of a column with candidate ``ranks`` whose destination's domain is ``home``
        where a candidate lies in it (else -1): the near candidates and the near load there, else all
        and the load out of the domain. ``near``: the positions of the candidates in ``home``, where
        known."""
        key = (ranks, home)
        found = self.pool_ids.get(key)
        if found is None:
            candidates = list(ranks)
            positions: range | list[int] = range(len(candidates))
            if home >= 0:
                positions = near if near is not None else [x for x in positions
                                                           if self.domain_of[candidates[x]] == home]
            found = self.pool_ids[key] = len(self.pools)
            self.pools.append(_Pool(candidates, positions, home >= 0, [candidates[x] for x in positions]))
        return found

    def _deal_run(self, work: WorkArrays, start: int) -> int:
        """Deal the columns of the run from ``start`` (the next columns of its group with the same bytes
        and pool: the same candidates, and destination domain where a candidate lies in it); returns
        where the next run starts."""
        index, column = int(work.group[start]), int(work.column[start])
        group = self.groups[index]
        pool = self.pools[int(work.pool[start])]
        load = self.near_load if pool.near else self.load
        end = int(work.run_end[start])
        ranks = pool.ranks
        order = _by_load(pool.positions, ranks, load, len(group.tensors))
        dealt = dealt_bytes(group, column, len(order))
        if not (len(order) == len(pool.positions) and dealt.count(dealt[0]) == len(dealt)):
            end = start + 1  # uneven gains change the order: one column at a time
        # dealt evenly, every candidate gains alike, so the order stays for the whole run
        for position, gain in zip(order, dealt):
            load[ranks[position]] += gain * (end - start)
        orders = self.orders[index]
        for same in work.column[start:end].tolist():
            orders[same] = order
        return end

    def _deal_stretch(self, work: WorkArrays, start: int) -> int:
        """Deal the columns from ``start`` on whose candidates are more than their instances (one
        size each: every instance takes another candidate), as long as any two of their pools are the
        same or share no rank; returns where the next column starts.

        A column reads and adds to the load of its pool's ranks only, so columns of pools sharing no
        rank can be dealt in any order: the columns of each pool are dealt together, in the order of
        ``work`` (with a heap), and every choice is the one dealing them one by one would make. Pools
        balanced by another load (near, far) never meet. A pool takes one run (one instance count
        and size) per stretch: a column of another size in it starts the next stretch."""
        limit, window = int(work.stretch_end[start]), STRETCH_WINDOW
        while True:  # the stretch found in a window of columns, doubled until it ends inside (or at the limit)
            end = min(start + window, limit)
            pool, instances = work.pool[start:end], work.instances[start:end]
            size = -work.neg[start:end] // instances
            _, first, run_of = np.unique(pool, return_index=True, return_inverse=True)  # a run per pool
            run_of = run_of.reshape(-1)
            head = first[run_of]  # each column's pool's first column
            other = np.flatnonzero((instances != instances[head]) | (size != size[head]))
            stop = int(other[0]) if len(other) else end - start  # a pool's second size: a new run, overlapping
            used: dict[bool, set[int]] = {False: set(), True: set()}  # ranks of the stretch's pools, per load
            runs: list[tuple[int, _Pool]] = []  # (run, its pool), in order of their first column
            for r in np.argsort(first).tolist():
                if first[r] >= stop:
                    break
                p = self.pools[int(pool[first[r]])]
                if not used[p.near].isdisjoint(p.members):
                    stop = int(first[r])  # a pool overlapping another: its order against it matters
                    break
                used[p.near].update(p.members)
                runs.append((r, p))
            if stop < end - start or end == limit:
                end = start + stop
                break
            window *= 2
        run_of = run_of[: end - start]
        by_run = np.argsort(run_of, kind="stable") + start  # each run's columns, in order
        bounds = np.concatenate([[0], np.cumsum(np.bincount(run_of, minlength=len(first)))]).tolist()
        for r, p in runs:
            at = by_run[bounds[r]: bounds[r + 1]]
            num_instances = int(work.instances[at[0]])
            self._deal_one_each(list(zip(work.group[at].tolist(), work.column[at].tolist())), num_instances, p,
                                self.near_load if p.near else self.load, int(-work.neg[at[0]]) // num_instances)
        return end

    def _deal_one_each(self, run: list[tuple[int, int]], num_instances: int, pool: _Pool, load: list[int],
                       size: int) -> None:
        """More replicas than tensors, one size: per column the least loaded take one instance each
        (the columns of ``run``, (group, column) pairs, share ``pool``), in closed form where it is
        exact (:func:`deal_one_each`)."""
        ranks, positions = pool.ranks, pool.positions
        if len(run) == 1 and num_instances == 1:  # one pick: the least loaded, as the heap would give it
            rank_load, rank, position = min([(load[ranks[x]], ranks[x], x) for x in positions])
            self.orders[run[0][0]][run[0][1]] = [position]
            load[rank] = rank_load + size
            return
        entries = [(load[ranks[x]], ranks[x], x) for x in positions]
        picked, final = deal_one_each(entries, len(run), num_instances, size)
        orders = self.orders
        for (index, column), order in zip(run, picked):
            orders[index][column] = order
        for rank_load, rank, _ in final:
            load[rank] = rank_load


def deal_one_each(entries: list[tuple[int, int, int]], columns: int, each: int, size: int
                  ) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """``columns`` columns dealt over ``entries`` ``(load, rank, position)`` (distinct, more than
    ``each``): each column takes the ``each`` least (load, rank, position) entries, least first, and
    adds ``size`` to their loads. Returns (each column's positions, the entries after).

    The answer of popping a heap, in closed form where it is exact: one instance per column takes the
    ``columns`` least of every entry's loads ``load + size * j``; several, once the entries are
    *level* (the least one after ``+ size`` above the greatest), go round in sorted order (each
    column's picks ``+ size`` come after every other). Before that, a heap, a few columns at a time.

    >>> deal_one_each([(0, 1, 0), (5, 2, 1), (9, 3, 2)], 4, 1, 4)[0]       # loads 0 4 5 8 ...
    [[0], [0], [1], [0]]
    >>> deal_one_each([(0, 1, 0), (1, 2, 1), (2, 3, 2)], 3, 2, 10)        # level: round in order
    ([[0, 1], [2, 0], [1, 2]], [(20, 1, 0), (21, 2, 1), (22, 3, 2)])
    """
    if size == 0:  # nothing changes: every column takes the same least entries
        least = [position for _, _, position in sorted(entries)[:each]]
        return [list(least) for _ in range(columns)], list(entries)
    if each == 1:
        return _water_fill(entries, columns, size)
    heap = list(entries)
    heapq.heapify(heap)
    picked: list[list[int]] = []
    pop, push, instances = heapq.heappop, heapq.heappush, range(each)
    step = -(-len(heap) // each)  # columns between checks: one round of the entries
    while len(picked) < columns:
        least, greatest = heap[0], max(heap)
        if (least[0] + size, least[1], least[2]) > greatest:  # level
            return _round(sorted(heap), columns - len(picked), each, size, picked)
        for _ in range(min(step, columns - len(picked))):
            taken = [pop(heap) for _ in instances]
            picked.append([position for _, _, position in taken])
            for rank_load, rank, position in taken:
                push(heap, (rank_load + size, rank, position))
    return picked, heap


def _round(ordered: list[tuple[int, int, int]], columns: int, each: int, size: int, picked: list[list[int]]
           ) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """:func:`deal_one_each` from level entries (``ordered``: sorted), after the columns ``picked``."""
    m, total = len(ordered), columns * each
    at = np.arange(total) % m
    positions = np.array([e[2] for e in ordered], np.int64)
    picked.extend(positions[at].reshape(columns, each).tolist())
    rounds, rest = divmod(total, m)
    final = [(load + size * (rounds + (q < rest)), rank, position) for q, (load, rank, position) in enumerate(ordered)]
    return picked, final


def _water_fill(entries: list[tuple[int, int, int]], columns: int, size: int
                ) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """:func:`deal_one_each` of one instance per column: the ``columns`` least keys
    ``(load + size * j, rank, position)`` over entries and ``j >= 0``, in order."""
    load = np.array([e[0] for e in entries], np.int64)
    rank = np.array([e[1] for e in entries], np.int64)
    position = np.array([e[2] for e in entries], np.int64)

    def at_most(level: int) -> np.ndarray:  # each entry's keys of load <= level
        return np.where(load <= level, (level - load) // size + 1, 0)

    base = int(load.min())  # the last pick's load lies in (base + size * (rounds - 1), base + size * rounds]
    low, high = 0, columns  # rounds: the least with at least `columns` keys at or below
    while low < high:
        mid = (low + high) // 2
        if int(at_most(base + size * mid).sum()) >= columns:
            high = mid
        else:
            low = mid + 1
    top = base + size * low
    below = at_most(top - size)  # keys at or below the round before: all taken
    window = load + ((top - load) // size) * size  # each entry's one key in (top - size, top]
    window = window[(load <= top)]
    last = int(np.sort(window)[columns - int(below.sum()) - 1])  # the last pick's load
    counts = at_most(last - 1)  # keys below the last pick's load: all taken
    ties = np.flatnonzero((load <= last) & ((last - load) % size == 0))  # a key at that load: the least ranks
    ties = ties[np.lexsort((position[ties], rank[ties]))][: columns - int(counts.sum())]
    counts[ties] += 1
    owner = np.repeat(np.arange(len(load)), counts)
    step = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    keys = load[owner] + size * step
    order = owner[np.lexsort((position[owner], rank[owner], keys))]
    picked = position[order][:, None].tolist()
    final = [(e[0] + size * c, e[1], e[2]) for e, c in zip(entries, counts.tolist())]
    return picked, final
