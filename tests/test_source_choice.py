"""Source choice deals runs and stretches of columns at once (:mod:`reshard.planning.sources`); every
choice must be the one the rule makes dealing the columns one at a time, largest first."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reshard as rs
from reshard.planning.geometry_groups import group_tensors
from reshard.planning.sources import _by_load, _SourceChooser, dealt_bytes, fill_choices
from strategies import layout_pairs


class OneColumnAtATime(_SourceChooser):
    """The rule as written: each column in turn, its instances dealt round-robin over its pool's
    candidates least loaded first, each candidate's load raised by what it is dealt."""

    def choose(self) -> None:
        for _, index, column in self._work():
            group = self.groups[index]
            ranks = self._start_group(index)[column]
            pool, load = self._pool(index, column, ranks)
            order = _by_load(pool, ranks, load, len(group.tensors))
            for position, gain in zip(order, dealt_bytes(group, column, len(order))):
                load[ranks[position]] += gain
            self.orders[index][column] = order
        for index, group in enumerate(self.groups):
            if len(group.choice_cols):
                fill_choices(group, self.orders[index], self.source)


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
@given(replicated_tensors(), st.sampled_from([None, 1, 4, 8]))
def test_stretches_of_one_tensor_columns_choose_as_one_at_a_time(pair, gpus_per_domain):
    source, destination = pair
    domains = domain_array(28, gpus_per_domain)
    assert chosen(source, destination, domains, _SourceChooser) == chosen(source, destination, domains,
                                                                          OneColumnAtATime)


@settings(max_examples=100, deadline=None)
@given(layout_pairs(), st.sampled_from([None, 2, 4]))
def test_runs_choose_as_one_at_a_time_on_random_layouts(case, gpus_per_domain):
    ranks = set(case.source.ranks) | set(case.destination.ranks)
    domains = domain_array(max(ranks) + 1, gpus_per_domain)
    assert chosen(case.source, case.destination, domains, _SourceChooser) == chosen(
        case.source, case.destination, domains, OneColumnAtATime)
