"""Hierarchical plans spread NIC load evenly over each domain's GPUs.

Cases are independent inference engines (every engine needs the whole model), each tensor-parallel
over whole NVLink domains or several to a domain, fed by a few training ranks that hold each tensor
once (an expert) or on every rank (a dense weight): the shape where boxes must be relayed between
domains. Every GPU of a domain then needs the same bytes, so no GPU's NIC (in or out, all phases)
should carry more than its domain's mean plus the largest single box, and every destination
element must arrive exactly.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as rs
from reshard.planning.hierarchy import hierarchical_plan

try:
    import strategies as S
    from test_plan_properties import assert_exact, run
except ImportError:  # tests/ imported as a package
    from . import strategies as S
    from .test_plan_properties import assert_exact, run

PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def engine_recipes(draw):
    """``engines`` TP-``tp`` engines on domains of ``g`` GPUs, ``n_src`` training ranks (one domain
    each), and per tensor (rows, cols, held by every training rank)."""
    g = draw(st.sampled_from([1, 2, 4]))
    tp = draw(st.sampled_from([k for k in (1, 2, 4, 8) if k % g == 0 or g % k == 0]))
    engines = draw(st.integers(2, 6))
    n_src = draw(st.integers(1, 3))
    tensors = draw(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3), st.booleans()), min_size=1, max_size=10))
    return g, tp, engines, n_src, tuple(tensors)


def build(recipe):
    """(case, domains) of an :func:`engine_recipes` recipe; each call builds new layouts."""
    g, tp, engines, n_src, tensors = recipe
    dst_ranks = list(range(n_src, n_src + engines * tp))
    domains = {r: r for r in range(n_src)}  # one source rank per domain
    domains.update({r: n_src + (r - n_src) // g for r in dst_ranks})
    specs, src, dst = [], [], []
    for i, (rows, cols, dense) in enumerate(tensors):
        spec = rs.TensorSpec(f"t{i}", (tp * rows, cols), torch.float32)
        specs.append(spec)
        if dense:  # a dense weight on every training rank
            src.append(rs.Layout.from_placements(spec, list(range(n_src)), (n_src,), [rs.Replicate()]))
        else:  # an expert on one training rank
            src.append(rs.Layout.from_placements(spec, [i % n_src], (1,), [rs.Replicate()]))
        dst.append(rs.Layout.from_placements(spec, dst_ranks, (engines, tp), [rs.Replicate(), rs.Shard(0)]))
    return S.Case(None, rs.Layout.merge(src), rs.Layout.merge(dst), S.full_tensors(specs)), domains


def nic_loads(h, domains) -> tuple[dict[int, int], dict[int, int]]:
    """(bytes each rank sends, bytes each rank receives) across domains, all phases."""
    out: dict[int, int] = defaultdict(int)
    inn: dict[int, int] = defaultdict(int)
    for p in h.phases:
        for (s, d), b in p.pair_bytes.items():
            if domains[s] != domains[d]:
                out[s] += b
                inn[d] += b
    return out, inn


def assert_balanced(h, case, domains):
    dst = case.destination
    largest = max(_volume(p.sizes) for r in dst.ranks for p in dst.pieces(r)) * 4  # float32
    by_domain: dict[int, list[int]] = defaultdict(list)
    for r in dst.ranks:
        by_domain[domains[r]].append(r)
    for kind, load in zip(("NIC out", "NIC in"), nic_loads(h, domains)):
        for d, ranks in by_domain.items():
            mean = sum(load[r] for r in ranks) / len(ranks)
            worst = max(ranks, key=lambda r: load[r])
            assert load[worst] <= mean + largest, (
                f"{kind} of rank {worst}: {load[worst]} bytes, domain {d} mean {mean:.0f}, largest box {largest}")


def _volume(sizes) -> int:
    v = 1
    for s in sizes:
        v *= int(s)
    return v


@PROPS
@given(engine_recipes())
def test_no_gpu_nic_carries_more_than_its_domain_mean_plus_one_box(recipe):
    case, domains = build(recipe)
    h = hierarchical_plan(case.source, case.destination, domains, split_bytes=None)
    assert_balanced(h, case, domains)
    assert_exact(case, run(case, h))


@PROPS
@given(engine_recipes())
def test_engine_plans_are_deterministic(recipe):
    (a, da), (b, db) = build(recipe), build(recipe)
    assert (hierarchical_plan(a.source, a.destination, da).fingerprint()
            == hierarchical_plan(b.source, b.destination, db).fingerprint())


def test_slices_of_many_experts_seed_on_different_gpus():
    """8 experts on one training rank, 4 TP-2 engines on domains of 2 GPUs: slice t of every
    expert is relayed by all four domains' GPU t in turn, not by one GPU alone."""
    specs = [rs.TensorSpec(f"e{i}", (4, 2), torch.float32) for i in range(8)]
    src = rs.Layout.merge([rs.Layout.from_placements(s, [0], (1,), [rs.Replicate()]) for s in specs])
    ranks = list(range(1, 9))
    dst = rs.Layout.merge([rs.Layout.from_placements(s, ranks, (4, 2), [rs.Replicate(), rs.Shard(0)])
                           for s in specs])
    domains = {0: 0, **{r: 1 + (r - 1) // 2 for r in ranks}}
    h = hierarchical_plan(src, dst, domains, split_bytes=None)
    assert h.relay is not None
    sends = h.relay.send_bytes
    half = specs[0].nbytes // 2  # one slice
    assert sorted(sends.values()) == [2 * 3 * half] * 8  # each GPU seeds 2 of the 8 experts' slice, sends 3 copies
    case = S.Case(None, src, dst, S.full_tensors(specs))
    assert_exact(case, run(case, h))


@st.composite
def source_domain_recipes(draw):
    """``per`` training ranks in each of ``n_dom`` source domains, TP-``tp`` engines on domains of
    ``g`` GPUs, and per tensor (rows, cols, held by every training rank or by every rank of one
    source domain): every byte a source domain sends, each of its ranks could send."""
    per, n_dom = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    g, tp, engines = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 4))
    tensors = draw(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3), st.booleans()), min_size=1, max_size=12))
    return per, n_dom, g, tp, engines, tuple(tensors)


def build_sources(recipe):
    """(case, domains, source ranks) of a :func:`source_domain_recipes` recipe."""
    per, n_dom, g, tp, engines, tensors = recipe
    n_src = per * n_dom
    dst_ranks = list(range(n_src, n_src + engines * tp))
    domains = {r: r // per for r in range(n_src)}
    domains.update({r: n_dom + (r - n_src) // g for r in dst_ranks})
    specs, src, dst = [], [], []
    for i, (rows, cols, everywhere) in enumerate(tensors):
        spec = rs.TensorSpec(f"t{i}", (tp * rows, cols), torch.float32)
        specs.append(spec)
        d = i % n_dom
        ranks = list(range(n_src)) if everywhere else list(range(d * per, d * per + per))
        src.append(rs.Layout.from_placements(spec, ranks, (len(ranks),), [rs.Replicate()]))
        dst.append(rs.Layout.from_placements(spec, dst_ranks, (engines, tp), [rs.Replicate(), rs.Shard(0)]))
    return S.Case(None, rs.Layout.merge(src), rs.Layout.merge(dst), S.full_tensors(specs)), domains, range(n_src)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source_domain_recipes())
def test_no_source_gpu_nic_sends_more_than_its_domain_mean_plus_one_box(recipe):
    """The sending side: a source domain's NICs share what it sends to other domains, one GPU
    exceeding the domain's mean by at most the largest single box."""
    case, domains, sources = build_sources(recipe)
    h = hierarchical_plan(case.source, case.destination, domains, split_bytes=None)
    dst = case.destination
    largest = max(_volume(p.sizes) for r in dst.ranks for p in dst.pieces(r)) * 4  # float32
    out, _ = nic_loads(h, domains)
    by_domain: dict[int, list[int]] = defaultdict(list)
    for r in sources:
        by_domain[domains[r]].append(r)
    for d, ranks in by_domain.items():
        mean = sum(out[r] for r in ranks) / len(ranks)
        worst = max(ranks, key=lambda r: out[r])
        assert out[worst] <= mean + largest, (
            f"NIC out of source rank {worst}: {out[worst]} bytes, domain {d} mean {mean:.0f}, largest box {largest}")
    assert_exact(case, run(case, h))
