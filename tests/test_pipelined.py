"""The pipelined hierarchical order (issue 22 point 1): the NVLink forward of chunk c in the same
rounds as the network transfer of chunk c+1.

Property tests on random layouts and random domains, in process (``run_local``): every destination
element equals its source and is written exactly once, both ends of every stream agree on every
message of every step (each rank's steps built alone), a sub-round stays within the staging cap,
and the model's figures follow the steps. A few real runs over gloo with pretend domains.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as rs
from reshard.modeling.pipeline import RefitModel, pipelined_traffic
from reshard.modeling.topology import Placement, Topology
from reshard.planning.hierarchy import Bands, chunk_pair_bytes, hierarchical_plan, tensor_chunks
from reshard.planning.schedule import ALIGN, round_cap

try:
    import strategies as S
    from test_hierarchy import domain_cases
    from test_plan_properties import assert_exact, run
except ImportError:  # tests/ imported as a package
    from . import strategies as S
    from .test_hierarchy import domain_cases
    from .test_plan_properties import assert_exact, run

PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def pipelined_cases(draw):
    case, domains, split = draw(domain_cases())
    cap = draw(st.sampled_from([None, 4096, 1 << 20]))
    try:
        h = hierarchical_plan(case.source, case.destination, domains, split_bytes=split, max_bucket_bytes=cap)
    except ValueError:  # a cap below what this plan's streams need: refused, as for any plan
        h = hierarchical_plan(case.source, case.destination, domains, split_bytes=split)
    return case, domains, h, h.pipelined(draw(st.integers(1, 5)))


def _ranks(h):
    return sorted(set(h.source.ranks) | set(h.destination.ranks))


@PROPS
@given(pipelined_cases())
def test_pipelined_delivers_every_element_exactly_once(pc):
    case, domains, seq, h = pc
    assert_exact(case, run(case, h))
    counts = {r: {b: torch.zeros(shape, dtype=torch.int32) for b, (shape, _) in h.destination.buffers(r).items()}
              for r in h.destination.ranks}
    for r in _ranks(h):
        for step in h.steps_for_rank(r):
            for sp in step:
                for c in list(sp.part.local) + list(sp.part.fanout) + [c for m in sp.part.recvs for c in m.copies]:
                    S.buffer_view(counts[r][c.dst_buffer], c.dst_offsets, c.sizes).add_(1)
    for r in h.destination.ranks:
        want = S.coverage(h.destination, r)
        for b, c in counts[r].items():
            assert torch.equal(c, want[b]), (r, b)
    assert h.wire_bytes == seq.wire_bytes and h.cross_domain_bytes == seq.cross_domain_bytes


@PROPS
@given(pipelined_cases())
def test_the_bands_read_from_three_layouts_are_those_of_every_phase_layout(pc):
    """chunk_of reads the source, the receivers and the destination only: the other phases' layouts
    hold whole pieces of those, so they would cut no row finer."""
    _, _, _, h = pc
    every = [lay for p in h.phases for lay in (p.source, p.destination)] + [h.destination]
    assert h.chunk_of == tensor_chunks(h.destination, h.chunks, every)


@PROPS
@given(pipelined_cases())
def test_both_ends_agree_and_a_sub_round_stays_within_the_cap(pc):
    case, domains, seq, h = pc
    steps = {r: h.steps_for_rank(r) for r in _ranks(h)}
    assert all(len(s) == h.num_steps for s in steps.values())
    for r, mine in steps.items():
        for s, step in enumerate(mine):
            assert [sp.phase for sp in step] == [p for p in range(len(h.phases)) if 0 <= s - p < h.chunks]
            for sp in step:
                for m in sp.part.sends:
                    theirs = next(x for x in steps[m.peer][s] if x.phase == sp.phase)
                    match = [x for x in theirs.part.recvs if x.peer == r and x.round == m.round]
                    assert len(match) == 1 and match[0].copies == m.copies, (r, m.peer, s, m.round)
                    assert all(h.split_by_chunk(c) == [(s - sp.phase, c)] for c in m.copies)  # its chunk's rows
            if h.max_bucket_bytes is None:
                continue
            for j, (staged, streams) in enumerate(_sub_rounds(step)):
                assert staged <= round_cap(h.max_bucket_bytes) + 2 * ALIGN * streams, (r, s, j, staged)


def _sub_rounds(step) -> list[tuple[int, int]]:
    """``(bytes staged, streams)`` of each sub-round of one rank's step, every phase's messages in it together."""
    streams = sum(len({m.peer for m in sp.part.sends}) + len({m.peer for m in sp.part.recvs}) for sp in step)
    return [(sum(m.nbytes for sp in step for msgs in sp.part.round(j) for m in msgs), streams)
            for j in range(max((sp.part.num_rounds for sp in step), default=0))]


def _placement(h, domains, topo):
    """One rank per GPU, each pretend domain on its own node of 8 GPUs; None where a domain has more
    than 8 ranks."""
    ranks = _ranks(h)
    if max(sum(1 for r in ranks if domains[r] == d) for d in set(domains.values())) > 8:
        return None
    gpu = {}
    for d in sorted(set(domains.values())):
        for i, r in enumerate(sorted(r for r in ranks if domains[r] == d)):
            gpu[r] = 8 * d + i
    return Placement(topo, np.array([gpu.get(r, 0) for r in range(max(ranks) + 1)]), tuple(h.source.ranks),
                     tuple(h.destination.ranks))


@PROPS
@given(pipelined_cases())
def test_the_pieces_counted_per_chunk_are_the_copies_the_steps_cut(pc):
    """chunk_pair_bytes(pieces=True) counts, per chunk and pair, the copies a stream's chunk holds once
    the bands cut it (each staged aligned: the padding step_rounds counts for a capped plan)."""
    _, _, _, h = pc
    for p, phase in enumerate(h.phases):
        want = chunk_pair_bytes(phase, h.chunk_of, h.chunks, pieces=True)
        got = [dict() for _ in range(h.chunks)]
        for r in _ranks(h):
            for m in phase._rank_plans.build(r, dict).sends:
                for c in m.copies:
                    for k, _ in h.split_by_chunk(c):
                        got[k][(r, m.peer)] = got[k].get((r, m.peer), 0) + 1
        assert [dict(w) for w in want] == got, p


def test_a_sub_round_of_tiny_copies_stays_within_the_cap():
    """Found by test_both_ends_agree_and_a_sub_round_stays_within_the_cap under load: a forward phase
    of 4-byte copies (a box cut across eight replicas), each staged aligned to 16 bytes, is four times
    its payload; the step's sub-rounds count that padding, as the sequential quotas do, so a sub-round
    stays within the cap."""
    spec = rs.TensorSpec("t0", (3, 7, 9), torch.float32)
    view = S.View
    src = (view((0,), (1,), (rs.Replicate(),), "chunk", "t0.s0", torch.float32),
           view(tuple(range(8)), (4, 1, 2), (rs.Replicate(),) * 3, "chunk", "t0.s1", torch.float32))
    dst = (view((0, 1), (1, 2), (rs.Replicate(),) * 2, "chunk", "t0.d0", torch.float32),
           view(tuple(range(8)), (1, 2, 4), (rs.Replicate(), rs.Shard(0), rs.Shard(1)), "chunk", "t0.d1",
                torch.float32))
    source, destination = S.build(S.Recipe((S.PlainTensor(spec, src, dst),)))
    h = hierarchical_plan(source, destination, dict.fromkeys(range(8), 0), split_bytes=1,
                          max_bucket_bytes=4096).pipelined(1)
    staged_most = 0
    for r in _ranks(h):
        for step in h.steps_for_rank(r):
            for j, (staged, streams) in enumerate(_sub_rounds(step)):
                assert staged <= round_cap(4096) + 2 * ALIGN * streams, (r, j, staged)
                staged_most = max(staged_most, staged)
    assert staged_most > sum(h.forward.pair_bytes.values())  # the padding is real: more than the payload


@PROPS
@given(pipelined_cases())
def test_the_model_counts_the_bytes_the_steps_move(pc):
    case, domains, seq, h = pc
    ranks = _ranks(h)
    topo = Topology.preset("dgx-h100")
    place = _placement(h, domains, topo)
    if place is None:
        return
    tr = pipelined_traffic(h, place, topo)
    sent = {r: 0 for r in ranks}
    for r in ranks:
        for step in h.steps_for_rank(r):
            for sp in step:
                sent[r] += sum(m.payload_bytes for m in sp.part.sends if place.gpu_of[m.peer] != place.gpu_of[r])
    nic_nvl = tr.total("nic_out") + tr.total("nvlink_out")
    assert sum(sent.values()) == pytest.approx(float(nic_nvl.sum()))


def _engines(n_tensors=24, rows=64, engines=4):
    """Sources 0..3 (one domain), each pipeline-like stage holding its own tensors; ``engines`` TP2
    engines in two domains of 4 ranks (ranks 4..11): every engine needs the whole model."""
    specs = [rs.TensorSpec(f"t{i}", (rows, 256), torch.float32) for i in range(n_tensors)]
    src = rs.Layout.merge([rs.Layout.from_placements(s, [i % 4], (1,), [rs.Replicate()]) for i, s in enumerate(specs)])
    dst = rs.Layout.merge([rs.Layout.from_placements(s, list(range(4, 4 + 2 * engines)), (engines, 2),
                                                     [rs.Replicate(), rs.Shard(0)]) for s in specs])
    domains = {r: 0 for r in range(4)} | {4 + i: 1 + i // 4 for i in range(2 * engines)}
    return src, dst, domains


def test_pipelined_models_faster_where_the_forward_is_not_free():
    """Bandwidth-bound (an 8.6 GB model into 4 independent engines on H100): the forward hides behind the
    network, so the pipelined order models faster than the sequential one and near the network phase."""
    src, dst, domains = _engines(n_tensors=32, rows=256 * 1024)
    m = RefitModel.build(src, dst, Topology.preset("dgx-h100"), infer_start="domain", max_bucket_bytes=256 << 20)
    _, seq = m.estimate(m.hierarchical)
    _, pipe = m.estimate(m.pipelined(8))
    network = seq.phases[0].seconds
    assert pipe.seconds < seq.seconds
    assert pipe.seconds < network + (seq.seconds - network) / 2, (pipe.seconds, seq.seconds, network)
    best = m.fastest_order()
    assert m.estimate(best)[1].seconds <= seq.seconds


@PROPS
@given(pipelined_cases())
def test_the_chosen_order_never_models_slower_than_sequential(pc):
    case, domains, seq, h = pc
    topo = Topology.preset("dgx-h100")
    place = _placement(h, domains, topo)
    if place is None:
        return
    m = RefitModel(case.source, case.destination, topo, place, rs.plan(case.source, case.destination), seq)
    best = m.fastest_order()
    assert m.estimate(best)[1].seconds <= m.estimate(seq)[1].seconds
    assert best.fingerprint().startswith(seq.fingerprint())  # the same copies, in one order or the other


def test_chunks_spread_consecutive_tensors_and_bad_chunks_are_refused():
    src, dst, domains = _engines()
    chunks = tensor_chunks(dst, 4)  # TP2 rows: each rank's half of a tensor spans 4 of its 8 bands
    assert [chunks[f"t{i}"] for i in range(8)] == [Bands(r, 8) for r in (0, 1, 2, 3, 0, 1, 2, 3)]
    h = hierarchical_plan(src, dst, domains)
    with pytest.raises(ValueError, match="chunks must be an integer >= 1"):
        h.pipelined(0)
    assert h.pipelined(1).num_steps == len(h.phases) and not h.pipelined(1).is_pipelined


def _lm_head(rows=4096, sources=8, tp=4, cols=64):
    """One big tensor replicated on ``sources`` training ranks (one domain), needed by two TP
    engines in two domains: the planner cuts each receiver's rows into one part per replica."""
    spec = rs.TensorSpec("lm_head", (rows, cols), torch.float32)
    src = rs.Layout.from_placements(spec, list(range(sources)), (sources,), [rs.Replicate()])
    dst = rs.Layout.from_placements(spec, list(range(sources, sources + 2 * tp)), (2, tp), [rs.Replicate(), rs.Shard(0)])
    domains = {r: 0 for r in range(sources)} | {sources + i: 1 + i // tp for i in range(2 * tp)}
    return src, dst, domains


@pytest.mark.parametrize("chunks", [2, 4, 8])
def test_every_stream_sends_its_share_in_every_step(chunks):
    """Each source replica sends its own row part of the LM head; those parts line up with a
    tensor's row bands when they are as many as the chunks, so the bands are cut finer than the
    finest piece of the phases' layouts and each source sends 1/chunks of its stream per step
    (before: one source's whole part in one step, its NIC the pipelined order's bottleneck)."""
    src, dst, domains = _lm_head()
    h = hierarchical_plan(src, dst, domains, split_bytes=1).pipelined(chunks)
    assert len({s for s, _ in h.network.pair_bytes}) == 8  # every replica sends a part
    per_chunk = chunk_pair_bytes(h.network, h.chunk_of, chunks)
    band = 64 * 4 * 4096 // h.chunk_of["lm_head"].count
    for pair, total in h.network.pair_bytes.items():
        shares = [c.get(pair, 0) for c in per_chunk]
        assert sum(shares) == total
        assert max(shares) - min(shares) <= band, (pair, shares)
    for r in h.destination.ranks:  # the executor's steps cut the same way as the model counts
        for s, step in enumerate(h.steps_for_rank(r)):
            for sp in step:
                got = sum(c.nbytes for m in sp.part.recvs for c in m.copies if sp.phase == 0)
                want = sum(b for (a, d), b in per_chunk[s].items() if d == r) if sp.phase == 0 else 0
                assert got == want, (r, s)


def test_the_pipelined_order_models_near_its_busiest_link_on_an_lm_head():
    """Bandwidth-bound: with every source's part spread over the steps, the pipelined order models
    within one step's share of the sequential network phase."""
    src, dst, domains = _lm_head(rows=1 << 17, cols=8192)  # 4.3 GB
    topo = Topology.preset("dgx-h100")
    place = Placement(topo, np.array(list(range(8)) + list(range(8, 16))), tuple(src.ranks), tuple(dst.ranks))
    h = hierarchical_plan(src, dst, domains, split_bytes=1)
    m = RefitModel(src, dst, topo, place, rs.plan(src, dst), h)
    _, seq = m.estimate(h)
    _, pipe = m.estimate(m.pipelined(8))
    assert pipe.seconds <= seq.seconds * (1 + 1 / 8), (pipe.seconds, seq.seconds)


# ------------------------------------------------------------------------------------- over gloo
def _run_gloo(rank, world):
    src, dst, domains = _engines(n_tensors=12, rows=16, engines=2)
    src = rs.Layout.merge([src])
    full = {n: torch.arange(s.numel, dtype=torch.float32).reshape(s.shape) + 1000 * i
            for i, (n, s) in enumerate(dst.specs.items())}
    sb = src.materialize(rank, full) if rank in src.ranks else {}
    want = dst.materialize(rank, full) if rank in dst.ranks else {}
    h = hierarchical_plan(src, dst, domains, max_bucket_bytes=8192)
    for plan in (h, h.pipelined(3), h.pipelined(5)):
        for overlap in (True, False):
            db = dst.empty_buffers(rank)
            ex = rs.ReshardExecutor(plan, overlap=overlap)
            stats = ex.run(sb, db)
            for b, w in want.items():
                assert torch.equal(db[b], w), (plan.chunks, overlap, rank, b)
            assert stats.peak_staging_bytes == ex.staging_bytes() <= 8192 + 2 * ALIGN * 16, (rank, stats)
            assert len(stats.phases) == plan.num_steps
    sent = [None] * world
    dist.all_gather_object(sent, rs.ReshardExecutor(h.pipelined(3)).run(sb, dst.empty_buffers(rank)).sent_bytes)
    assert sum(sent) == h.wire_bytes


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pipelined_over_gloo_bit_exact():
    rs.spawn(_run_gloo, 8)
