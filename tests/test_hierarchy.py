"""The two-phase (network, then NVLink) refit: exact results, and network bytes per domain.

Oracles are independent of the planner: expected buffers by copying boxes out of the full
tensors, and the bytes a domain must take over the network from numpy masks of the boxes its
ranks need minus those its own source ranks hold.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as rs
from reshard.planning.hierarchy import domain_need_bytes, hierarchical_plan, seed_count

try:
    import strategies as S
    from test_plan_properties import assert_exact, run
except ImportError:  # tests/ imported as a package
    from . import strategies as S
    from .test_plan_properties import assert_exact, run

PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _domains(draw, ranks, max_domains=3):
    n = draw(st.integers(1, max_domains))
    return {r: draw(st.integers(0, n - 1)) for r in ranks}


@st.composite
def domain_cases(draw):
    case = draw(S.layout_pairs())
    domains = _domains(draw, sorted(set(case.source.ranks) | set(case.destination.ranks)))
    return case, domains, draw(st.sampled_from([None, 1, 64, "auto"]))


@st.composite
def single_view_cases(draw):
    """One tensor, one placement view per side: destination boxes are identical or disjoint."""
    cls = draw(st.sampled_from(("float", "int")))
    spec = rs.TensorSpec("w", draw(S.shapes(max_ndim=3)), torch.float32 if cls == "float" else torch.int32)
    sv = draw(S.views([spec.shape], 0, "w.src", cls))
    dv = draw(S.views([spec.shape], draw(st.sampled_from([0, S.RANK_POOL])), "w.dst", cls))
    src, dst = S.view_layout(spec, sv), S.view_layout(spec, dv)
    case = S.Case(None, src, dst, S.full_tensors([spec]))
    return case, _domains(draw, sorted(set(src.ranks) | set(dst.ranks)))


def _union_mask(shape, pieces):
    return S.box_mask(shape, pieces)


@PROPS
@given(domain_cases())
def test_two_phases_deliver_every_element(dc):
    case, domains, split = dc
    h = hierarchical_plan(case.source, case.destination, domains, split_bytes=split)
    assert_exact(case, run(case, h))
    for (s, d) in h.forward.pair_bytes:  # the forward phase never leaves a domain
        assert domains[s] == domains[d]


@PROPS
@given(single_view_cases())
def test_network_bytes_per_domain_are_the_bytes_it_lacks(dc):
    case, domains = dc
    h = hierarchical_plan(case.source, case.destination, domains)
    assert_exact(case, run(case, h))
    spec = case.source.specs["w"]
    for d in set(domains[r] for r in case.destination.ranks):
        need = _union_mask(spec.shape, [p for r in case.destination.ranks if domains[r] == d
                                        for p in case.destination.pieces(r)])
        have = _union_mask(spec.shape, [p for r in case.source.ranks if domains[r] == d
                                        for p in case.source.pieces(r)])
        itemsize = case.destination.buffer_dtypes("w").itemsize  # bytes travel in the destination dtype
        lacking = int((need & ~have).sum()) * itemsize
        assert h.cross_domain_bytes.get(d, 0) == lacking, (d, [p.pair_bytes for p in h.phases])


def _replicated_refit(n_tensors=8, rows=16):
    specs = [rs.TensorSpec(f"t{i}", (rows, 4), torch.float32) for i in range(n_tensors)]
    src = rs.Layout.merge([rs.Layout.from_placements(s, [0, 1], (2,), [rs.Replicate()]) for s in specs])
    dst = rs.Layout.merge([rs.Layout.from_placements(s, [2, 3, 4, 5], (4,), [rs.Replicate()]) for s in specs])
    return specs, src, dst


def test_dp_replicas_in_one_domain_take_each_box_once_and_share_the_ingress():
    specs, src, dst = _replicated_refit()
    domains = {0: 0, 1: 1, 2: 2, 3: 2, 4: 2, 5: 2}
    h = hierarchical_plan(src, dst, domains, split_bytes=None)
    total = sum(s.nbytes for s in specs)
    assert h.cross_domain_bytes == {2: total}  # 4 replicas, the bytes cross once
    assert domain_need_bytes(dst, domains) == {2: total}
    ingress = {r: 0 for r in (2, 3, 4, 5)}
    for (s, d), b in h.network.pair_bytes.items():
        ingress[d] += b
    assert set(ingress.values()) == {total // 4}  # every receiver takes a quarter
    egress = {0: 0, 1: 0}
    for (s, d), b in h.network.pair_bytes.items():
        egress[s] += b
    assert egress == {0: total // 2, 1: total // 2}
    direct = rs.plan(src, dst)
    assert direct.wire_bytes == 4 * total  # without domains, once per replica


def test_a_source_inside_the_domain_is_used_instead_of_the_network():
    specs, src, dst = _replicated_refit(n_tensors=2)
    domains = {0: 0, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1}  # source 1 shares the destinations' domain
    h = hierarchical_plan(src, dst, domains, split_bytes=None)
    assert h.cross_domain_bytes == {}
    assert all(s == 1 for s, _ in h.network.pair_bytes)


def test_a_big_box_is_split_across_source_replicas():
    spec = rs.TensorSpec("emb", (64, 8), torch.float32)
    src = rs.Layout.from_placements(spec, [0, 1, 2, 3], (4,), [rs.Replicate()])
    dst = rs.Layout.from_placements(spec, [4], (1,), [rs.Replicate()])
    domains = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}
    whole = hierarchical_plan(src, dst, domains, split_bytes=None)
    split = hierarchical_plan(src, dst, domains, split_bytes=1024)
    assert max(whole.network.send_bytes.values()) == spec.nbytes
    assert sorted(split.network.send_bytes.values()) == [spec.nbytes // 4] * 4
    case = S.Case(None, src, dst, S.full_tensors([spec]))
    assert_exact(case, run(case, split))


def test_domains_must_name_every_rank():
    specs, src, dst = _replicated_refit(n_tensors=1)
    try:
        hierarchical_plan(src, dst, {0: 0, 1: 0, 2: 1})
    except ValueError as e:
        assert "rank 3" in str(e)
    else:
        raise AssertionError("missing domains were accepted")


def test_masks_helper_agrees_with_numpy():
    m = _union_mask((4, 4), [rs.Piece("w", (0, 0), (2, 2), "b", (0, 0), 0)])
    assert int(np.sum(m)) == 4


def test_boxes_more_domains_need_than_sources_hold_are_relayed_between_domains():
    """An LM head on 2 training ranks, needed whole by 6 one-rank inference domains: the sources
    send it twice (to 2 seed domains), the seeds forward it to the other 4 over the network."""
    spec = rs.TensorSpec("lm_head.weight", (32, 8), torch.bfloat16)
    src = rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Replicate()])
    dst = rs.Layout.from_placements(spec, list(range(2, 8)), (6,), [rs.Replicate()])
    domains = {0: 0, 1: 1, **{r: r for r in range(2, 8)}}
    h = hierarchical_plan(src, dst, domains, split_bytes=None)
    assert h.relay is not None and h.phase_names == ["network", "relay", "NVLink forward"]
    assert h.network.send_bytes == {0: spec.nbytes, 1: spec.nbytes}
    assert h.relay.wire_bytes == 4 * spec.nbytes
    assert h.cross_domain_bytes == {d: spec.nbytes for d in range(2, 8)}
    case = S.Case(None, src, dst, S.full_tensors([spec]))
    assert_exact(case, run(case, h))
    flat = hierarchical_plan(src, dst, domains, split_bytes=None, relay=False)
    assert flat.relay is None and max(flat.network.send_bytes.values()) == 3 * spec.nbytes


def test_seeds_balance_the_sources_against_the_relays():
    """An LM head on 16 training ranks (two domains), needed by 36 TP4 inference domains: each TP
    slice takes sqrt(16 copies x 36 domains / 4 GPUs) = 12 seeds, not 16, so the training NICs
    (which also carry the experts only they hold) send the head 12 times and the idle inference
    NICs relay it to the other 24 domains."""
    assert seed_count(16, 36, 4) == 12
    spec = rs.TensorSpec("lm_head.weight", (64, 8), torch.bfloat16)
    src = rs.Layout.from_placements(spec, list(range(16)), (16,), [rs.Replicate()])
    dst = rs.Layout.merge([rs.Layout.from_placements(spec, list(range(16 + 4 * d, 20 + 4 * d)), (4,), [rs.Shard(0)])
                           for d in range(36)])
    domains = {r: r // 8 for r in range(16)} | {r: 2 + (r - 16) // 4 for r in range(16, 16 + 4 * 36)}
    h = hierarchical_plan(src, dst, domains, split_bytes=None)
    assert sum(h.network.send_bytes.values()) == 12 * spec.nbytes
    assert h.relay.wire_bytes == 24 * spec.nbytes
    assert h.cross_domain_bytes == {d: spec.nbytes for d in range(2, 38)}
    case = S.Case(None, src, dst, S.full_tensors([spec]))
    assert_exact(case, run(case, h))


def test_restricted_buffer_offsets_stay_right_when_an_earlier_rows_array_is_gone():
    """The split caches restricted buffer offsets by the ids of the offsets and rows arrays; once a
    caller drops a rows array its id can come back for other rows (it did on the 2.4 T MoE's relay
    split: relayed tables with fewer buffer-offset rows than pieces). The cache holds both arrays."""
    from reshard.layout import PieceTable, Repeated
    from reshard.planning.hierarchy import _rows_of, _subset

    ranks = np.arange(4, dtype=np.int64)
    offsets = np.array([[0], [2], [4], [6]], np.int64)
    sizes = np.full((4, 1), 2, np.int64)
    table = PieceTable(ranks, offsets, sizes, Repeated("w", 4), offsets * 10)
    cache: dict = {}
    first = np.array([0], np.int64)
    _subset(table, first, _rows_of(table, first), cache)
    gone = id(first)
    del first
    later = None
    for _ in range(1000):  # CPython hands a freed array's memory to the next array made: usually at once
        later = np.array([1, 3], np.int64)
        if id(later) == gone:
            break
    sub = _subset(table, later, _rows_of(table, later), cache)
    assert sub.buffer_offsets.tolist() == [[20], [60]]
    assert len(sub.buffer_offsets) == len(sub)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_relay_boxes_of_a_few_rows_are_those_numpy_finds(data):
    """The Python path for small receivers tables (experts at scale) gives the boxes, members, their
    order and seed counts of the numpy path."""
    from reshard.planning.hierarchy import _relay_boxes_large, _relay_boxes_small
    from reshard.piece_table import PieceTable, Repeated

    boxes = [((0, 0), (4, 8)), ((4, 0), (4, 8)), ((0, 0), (8, 8)), ((0, 4), (8, 4))]
    rows = data.draw(st.lists(st.tuples(st.integers(0, 31), st.sampled_from(boxes)), min_size=1, max_size=16))
    held = data.draw(st.lists(st.tuples(st.integers(32, 47), st.sampled_from(boxes)), min_size=1, max_size=4))
    dom = np.array(data.draw(st.lists(st.integers(0, 7), min_size=48, max_size=48)), np.int64)

    def table(pieces):
        ranks = np.array([r for r, _ in pieces], np.int64)
        offsets = np.array([o for _, (o, _) in pieces], np.int64)
        sizes = np.array([s for _, (_, s) in pieces], np.int64)
        return PieceTable(ranks, offsets, sizes, Repeated("w", len(pieces)), offsets.copy())

    t, source = table(rows), table(held)
    gpus = np.bincount(dom[t.ranks], minlength=8)
    copies = data.draw(st.integers(1, 3))
    small, large = _relay_boxes_small(t, source, dom, copies, gpus), _relay_boxes_large(t, source, dom, copies, gpus)
    assert [(m.tolist(), e) for m, e in small] == [(m.tolist(), e) for m, e in large]


def _tables_sharing(layout: rs.Layout, shared: bool) -> rs.Layout:
    """``layout`` with the same contents, its tensors' rank and box arrays either one set shared by
    all the tensors alike (``shared``) or copies of their own."""
    from reshard.piece_table import PieceTable
    first: dict[bytes, PieceTable] = {}
    tables = {}
    for name, t in layout.tables.items():
        model = first.setdefault(t.geometry_key(), t)
        arrays = (model.ranks, model.offsets, model.sizes) if shared else (t.ranks.copy(), t.offsets.copy(),
                                                                           t.sizes.copy())
        tables[name] = PieceTable(*arrays, t.buffers, t.buffer_offsets.copy())
    return layout.with_tables(tables)


@pytest.mark.parametrize("chunks", [1, 4])
def test_a_plan_depends_on_what_the_layouts_hold_not_on_how_their_arrays_are_shared(chunks):
    """Twelve LM-head-like tensors on 4 training ranks (2 domains), needed whole by 10 inference
    domains: their seeds are dealt over the tensors alike. Two processes building the same layouts,
    one with the tensors' arrays shared and one with copies (as unpickling parts from several ranks
    gives), must get the same plan: the relay split groups tensors by content, not identity."""
    specs = [rs.TensorSpec(f"head{i}.weight", (16, 8), torch.bfloat16) for i in range(12)]
    src = rs.Layout.merge([rs.Layout.from_placements(s, [0, 1, 2, 3], (4,), [rs.Replicate()]) for s in specs])
    dst = rs.Layout.merge([rs.Layout.from_placements(s, list(range(4, 24)), (10, 2), [rs.Replicate(), rs.Shard(0)])
                           for s in specs])
    domains = {r: r // 2 for r in range(4)} | {r: 2 + (r - 4) // 2 for r in range(4, 24)}
    plans = [hierarchical_plan(_tables_sharing(src, shared), _tables_sharing(dst, shared), domains, split_bytes=None)
             for shared in (True, False)]
    assert plans[0].relay is not None
    assert plans[0].fingerprint() == plans[1].fingerprint()
    for a, b in zip(plans[0].phases, plans[1].phases):
        assert a.pair_bytes == b.pair_bytes
    steps = [[[(phase, dict(pairs)) for phase, pairs in step] for step in plan.pipelined(chunks).step_pair_bytes()]
             for plan in plans]
    assert steps[0] == steps[1]
