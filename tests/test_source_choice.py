"""Source choice deals runs and stretches of columns at once (:mod:`reshard.planning.sources`); every
choice must be the one the rule makes dealing the columns one at a time, largest first."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reshard as rs
from reshard.planning import sources
from reshard.planning.geometry_groups import group_tensors
from reshard.planning.sources import BULK_COLUMNS, _SourceChooser, dealt_bytes, fill_choices
from strategies import layout_pairs


def candidate_ranks(group, source: rs.Layout) -> list[list[int]]:
    """Per choice column of ``group``, the ranks of its candidate source pieces."""
    items = group.items
    ranks = source.tables[group.tensors[0]].ranks[items.candidates].tolist()
    starts, counts = items.cand_start[group.choice_cols].tolist(), items.cand_count[group.choice_cols].tolist()
    return [ranks[start: start + count] for start, count in zip(starts, counts)]


def near_homes(group, candidates: list[list[int]], domains: np.ndarray | None) -> list[int]:
    """Per choice column, its destination's domain where one of its ``candidates`` (ranks) lies in it, else -1."""
    if domains is None:
        return [-1] * len(candidates)
    homes = [int(domains[rank]) for rank in group.dst_rank[group.choice_cols].tolist()]
    return [home if any(int(domains[r]) == home for r in ranks) else -1 for home, ranks in zip(homes, candidates)]


class OneColumnAtATime(_SourceChooser):
    """The rule as written: each column in turn, its instances dealt round-robin over its candidates
    least loaded first (with domains: the candidates in the destination's domain and the load within
    it, where there are such), each candidate's load raised by what it is dealt."""

    def choose(self) -> None:
        candidates, homes, orders = {}, {}, {}
        work = self._work()
        for index, column in zip(work.group.tolist(), work.column.tolist()):
            group = self.groups[index]
            if index not in candidates:
                candidates[index] = candidate_ranks(group, self.source)
                homes[index] = near_homes(group, candidates[index], self.domains)
                orders[index] = [None] * len(group.choice_cols)
            ranks, home = candidates[index][column], homes[index][column]
            pool, load = list(range(len(ranks))), self.load
            if home >= 0:
                pool, load = [x for x in pool if self.domains[ranks[x]] == home], self.near_load
            order = sorted(pool, key=lambda x: (load[ranks[x]], ranks[x]))[:len(group.tensors)]
            for position, gain in zip(order, dealt_bytes(group, column, len(order))):
                load[ranks[position]] += gain
            orders[index][column] = order
        for index, group in enumerate(self.groups):
            if len(group.choice_cols):
                fill_choices(group, orders[index], self.source)


def chosen(source: rs.Layout, destination: rs.Layout, domains: np.ndarray | None, chooser) -> list[list[int]]:
    tensors = [n for n, t in destination.tables.items() if len(t)]
    groups = group_tensors(source, destination, tensors)
    chooser(groups, source, domains).choose()
    return [g.choice_rank.tolist() for g in groups]


def domain_array(num_ranks: int, gpus_per_domain: int | None) -> np.ndarray | None:
    """Rank r in NVLink domain r // gpus_per_domain (None: no domains)."""
    if gpus_per_domain is None:
        return None
    return np.arange(num_ranks) // gpus_per_domain


@st.composite
def replicated_tensors(draw):
    """Many small tensors, each whole on a few of 12 source ranks and on one or two destination
    ranks: one-tensor groups whose candidate sets interleave (some alike, some disjoint, some
    overlapping), as the relay phase of a big hierarchical plan has them."""
    layouts_src, layouts_dst = [], []
    for i in range(draw(st.integers(1, 40))):
        spec = rs.TensorSpec(f"t{i}", (draw(st.sampled_from([2, 4, 6])), 3), torch.float32)
        holders = draw(st.lists(st.integers(0, 11), min_size=1, max_size=5, unique=True))
        readers = draw(st.lists(st.integers(12, 27), min_size=1, max_size=2, unique=True))
        layouts_src.append(rs.Layout.from_placements(spec, holders, (len(holders),), [rs.Replicate()]))
        layouts_dst.append(rs.Layout.from_placements(spec, readers, (len(readers),), [rs.Replicate()]))
    return rs.Layout.merge(layouts_src), rs.Layout.merge(layouts_dst)


@settings(max_examples=150, deadline=None)
@given(replicated_tensors(), st.sampled_from([None, 1, 4, 8]), st.sampled_from([1, BULK_COLUMNS]))
def test_stretches_of_one_tensor_columns_choose_as_one_at_a_time(pair, gpus_per_domain, bulk):
    source, destination = pair
    domains = domain_array(28, gpus_per_domain)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sources, "BULK_COLUMNS", bulk)  # 1: every group's pools found with numpy
        patch.setattr(sources, "STRETCH_WINDOW", bulk)  # 1: a stretch's end found by doubling from one column
        assert chosen(source, destination, domains, _SourceChooser) == chosen(source, destination, domains,
                                                                              OneColumnAtATime)


@settings(max_examples=100, deadline=None)
@given(layout_pairs(), st.sampled_from([None, 2, 4]), st.sampled_from([1, BULK_COLUMNS]))
def test_runs_choose_as_one_at_a_time_on_random_layouts(case, gpus_per_domain, bulk):
    ranks = set(case.source.ranks) | set(case.destination.ranks)
    domains = domain_array(max(ranks) + 1, gpus_per_domain)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sources, "BULK_COLUMNS", bulk)
        assert chosen(case.source, case.destination, domains, _SourceChooser) == chosen(
            case.source, case.destination, domains, OneColumnAtATime)


@pytest.mark.parametrize("gpus_per_domain", [None, 4, 8])
@pytest.mark.parametrize("layers", [1, 3])
def test_many_columns_of_one_group_choose_as_one_at_a_time(gpus_per_domain, layers):
    """Groups of many choice columns (their pools found with numpy): 64 rows split over 32
    destination ranks, each layer replicated on 4 or 5 of 12 source ranks."""
    src, dst = [], []
    for layer in range(layers):
        for kind, holders in (("a", [0, 3, 5, 9]), ("b", [1, 2, 6, 10, 11])):
            spec = rs.TensorSpec(f"l{layer}.{kind}", (64, 4), torch.float32)
            src.append(rs.Layout.from_placements(spec, holders, (len(holders),), [rs.Replicate()]))
            dst.append(rs.Layout.from_placements(spec, list(range(12, 44)), (32,), [rs.Shard(0)]))
    source, destination = rs.Layout.merge(src), rs.Layout.merge(dst)
    domains = domain_array(44, gpus_per_domain)
    expected = chosen(source, destination, domains, OneColumnAtATime)
    assert chosen(source, destination, domains, _SourceChooser) == expected
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sources, "STRETCH_WINDOW", 1)
        assert chosen(source, destination, domains, _SourceChooser) == expected


@pytest.mark.parametrize("gpus_per_domain", [2, 4, 8])
@pytest.mark.parametrize("shards", [40, 48])
def test_columns_sharing_one_candidate_set_near_and_far_choose_as_one_at_a_time(gpus_per_domain, shards):
    """Groups whose columns all have one candidate set (the relay phase's: a box's seeds, for every
    domain taking it), some of them with a candidate in their destination's domain and some not, on
    ranks both sides share."""
    src, dst = [], []
    for layer, holders in enumerate(([0, 5, 9, 14, 18], [0, 5, 9, 14, 18], [2, 3, 21, 30], [7, 33])):
        spec = rs.TensorSpec(f"l{layer}", (shards * 2, 4), torch.float32)
        src.append(rs.Layout.from_placements(spec, holders, (len(holders),), [rs.Replicate()]))
        dst.append(rs.Layout.from_placements(spec, list(range(4, 4 + shards)), (shards,), [rs.Shard(0)]))
    source, destination = rs.Layout.merge(src), rs.Layout.merge(dst)
    domains = domain_array(4 + shards, gpus_per_domain)
    tensors = [n for n, t in destination.tables.items() if len(t)]
    groups = group_tensors(source, destination, tensors)
    items = groups[0].items
    starts, counts = items.cand_start[groups[0].choice_cols], items.cand_count[groups[0].choice_cols]
    assert (starts == starts[0]).all() and (counts == counts[0]).all() and len(starts) >= BULK_COLUMNS
    homes = near_homes(groups[0], candidate_ranks(groups[0], source), domains)
    assert -1 in homes and any(h >= 0 for h in homes)  # near and far columns both
    expected = chosen(source, destination, domains, OneColumnAtATime)
    assert chosen(source, destination, domains, _SourceChooser) == expected
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sources, "BULK_COLUMNS", 10 ** 6)  # the per-column paths (no shared candidate set)
        assert chosen(source, destination, domains, _SourceChooser) == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(-3, 3), min_size=3, max_size=3), min_size=1, max_size=30))
def test_distinct_rows_group_rows_as_numpy_unique_does(rows):
    from reshard.planning.sources import _distinct_rows

    rows = np.array(rows, np.int64)
    first, inverse = _distinct_rows(rows)
    assert (rows[first][inverse] == rows).all()  # each row's representative equals it
    assert len(first) == len(np.unique(rows, axis=0))  # and distinct rows have distinct representatives


def popped_from_a_heap(entries, columns, each, size):
    """:func:`~reshard.planning.sources.deal_one_each` as the rule says it: per column, pop the ``each``
    least entries, then push them back ``size`` heavier."""
    import heapq
    heap = list(entries)
    heapq.heapify(heap)
    picked = []
    for _ in range(columns):
        taken = [heapq.heappop(heap) for _ in range(each)]
        picked.append([position for _, _, position in taken])
        for load, rank, position in taken:
            heapq.heappush(heap, (load + size, rank, position))
    return picked, sorted(heap)


@st.composite
def deals(draw):
    """Entries of distinct positions, loads spread little or much against the size (level or not,
    ties among loads and ranks), and as many columns as a run has."""
    count = draw(st.integers(2, 12))
    size = draw(st.sampled_from([0, 1, 3, 7, 100]))
    spread = draw(st.sampled_from([0, 1, 5, 50, 10_000, size - 1, size, size + 1]))  # the last: at the edge of level
    loads = draw(st.lists(st.integers(0, max(spread, 0)), min_size=count, max_size=count))
    ranks = draw(st.lists(st.integers(0, draw(st.sampled_from([3, 20]))), min_size=count, max_size=count))
    entries = [(load, rank, position) for position, (load, rank) in enumerate(zip(loads, ranks))]
    return entries, draw(st.integers(1, 60)), draw(st.integers(1, count - 1)), size


@settings(max_examples=400, deadline=None)
@given(deals())
def test_closed_form_dealing_pops_as_a_heap_does(deal):
    entries, columns, each, size = deal
    picked, final = sources.deal_one_each(entries, columns, each, size)
    expected_picked, expected_final = popped_from_a_heap(entries, columns, each, size)
    assert picked == expected_picked
    assert sorted(final) == expected_final
