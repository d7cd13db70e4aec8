"""Property tests of the planner and the in-process executor over random layout pairs.

Oracles are computed independently of the planner: expected destination buffers
by copying each destination piece's box out of the full tensor, write counts by
replaying every rank's ``plan.for_rank(r)`` copies, and the minimum wire bytes with
numpy boolean masks over each tensor.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as rs
from reshard.planning.baseline import gather_broadcast_bytes, gather_plan
from reshard.planning.rank_plan import rows_by_rank
from reshard.tensors import Piece

try:
    import strategies as S
except ImportError:  # tests/ imported as a package
    from . import strategies as S

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run(case: S.Case, plan: rs.Plan) -> dict[int, dict[str, torch.Tensor]]:
    """Run ``plan`` with ``run_local``; destination buffers start as the sentinel."""
    src = {r: S.fill(case.source, r, case.full) for r in case.source.ranks}
    dst = {r: {b: torch.full(shape, S.SENTINEL, dtype=dt) for b, (shape, dt) in case.destination.buffers(r).items()}
           for r in case.destination.ranks}
    rs.run_local(plan, src, dst)
    return dst


def assert_exact(case: S.Case, out: dict[int, dict[str, torch.Tensor]]) -> None:
    for r in case.destination.ranks:
        expected = S.fill(case.destination, r, case.full)  # sentinel where no piece lies
        assert out[r].keys() == expected.keys()
        for b, want in expected.items():
            got = out[r][b]
            assert S.bitwise_equal(got, want), f"rank {r} buffer {b!r}:\n got {got}\nwant {want}"


# ---------------------------------------------------------------------------- values and coverage
@PROPS
@given(S.layout_pairs())
def test_every_destination_element_equals_its_source(case):
    plan = rs.plan(case.source, case.destination)
    assert_exact(case, run(case, plan))


@PROPS
@given(S.layout_pairs())
def test_every_destination_element_is_written_exactly_once(case):
    plan = rs.plan(case.source, case.destination)
    counts = S.write_counts(plan)
    for r in case.destination.ranks:
        want = S.coverage(case.destination, r)  # 1 under a piece (pieces never overlap in a buffer), else 0
        for b, c in counts[r].items():
            assert not (want[b] > 1).any()
            assert torch.equal(c, want[b]), f"rank {r} buffer {b!r}: write counts\n{c}\nexpected\n{want[b]}"


@PROPS
@given(S.layout_pairs())
def test_every_ranks_rows_made_at_once_are_the_rows_made_alone(case):
    """A planner serving every rank makes a group's rows for all its ranks in one pass: the same rows,
    in the same order, as one rank's part worked out alone (and none for the ranks it leaves out)."""
    plan = rs.plan(case.source, case.destination)
    builder = plan._rank_plans
    for group in builder.groups:
        at_once = rows_by_rank(group)
        for r in S.all_ranks(plan):
            alone = builder._rows_of(group, r)
            got = at_once.get(r)
            if got is None:
                assert not len(alone.instance)
                continue
            for field in ("instance", "item", "piece", "src_rank"):
                assert getattr(got, field).tolist() == getattr(alone, field).tolist(), (r, field)


@PROPS
@given(S.layout_pairs())
def test_copies_are_well_formed_and_both_ends_agree(case):
    """Every rank's part is computed alone; sender and receiver must see the same messages."""
    plan = rs.plan(case.source, case.destination)
    parts = {r: plan.for_rank(r) for r in S.all_ranks(plan)}
    sent = {}
    for r, p in parts.items():
        assert p.rank == r
        for m in p.sends:
            assert m.peer != r and m.copies
            sent[(r, m.peer, m.round)] = m.copies
        for c in p.local:  # source buffer -> destination buffer on one rank
            assert c.src_buffer in case.source.buffers(r) and c.dst_buffer in case.destination.buffers(r)
        for c in p.fanout:  # destination buffer -> another destination buffer on one rank
            assert c.src_buffer in case.destination.buffers(r) and c.dst_buffer in case.destination.buffers(r)
            assert c.src_buffer != c.dst_buffer or c.src_offsets != c.dst_offsets
    received = {}
    for r, p in parts.items():
        for m in p.recvs:
            received[(m.peer, r, m.round)] = m.copies
            for c in m.copies:
                assert c.src_buffer in case.source.buffers(m.peer)
                assert c.dst_buffer in case.destination.buffers(r)
                assert c.dtype == case.destination.buffers(r)[c.dst_buffer][1]
    assert sent == received


# ---------------------------------------------------------------------------- bytes
@PROPS
@given(S.layout_pairs())
def test_wire_bytes_is_the_minimum(case):
    plan = rs.plan(case.source, case.destination)
    lo, hi = S.min_wire_bytes(case.source, case.destination)
    assert lo <= plan.wire_bytes <= hi
    if lo == hi:
        assert plan.wire_bytes == lo


def usable(case, bucket):
    """``bucket`` raised to the smallest cap the layouts allow (smaller caps are rejected)."""
    if bucket is None:
        return None
    return max(bucket, rs.plan(case.source, case.destination).min_bucket_bytes)


@PROPS
@given(S.layout_pairs(), st.sampled_from([None, 64, 256]))
def test_byte_figures_are_consistent(case, bucket):
    plan = rs.plan(case.source, case.destination, max_bucket_bytes=usable(case, bucket))
    wire = plan.wire_bytes
    assert sum(plan.pair_bytes.values()) == wire
    assert sum(plan.send_bytes.values()) == wire
    assert sum(plan.recv_bytes.values()) == wire
    assert all(s != d and b > 0 for (s, d), b in plan.pair_bytes.items())
    for r in S.all_ranks(plan):
        p = plan.for_rank(r)
        assert p.send_bytes == plan.send_bytes.get(r, 0)
        assert p.recv_bytes == plan.recv_bytes.get(r, 0)
        for peer in {m.peer for m in p.sends}:
            assert sum(m.payload_bytes for m in p.sends if m.peer == peer) == plan.pair_bytes[(r, peer)]
    assert plan.num_messages == sum(len(plan.for_rank(r).sends) for r in S.all_ranks(plan))
    if bucket is None:
        assert plan.num_rounds <= 1


# ---------------------------------------------------------------------------- bucketing
def shift_ranks(layout: rs.Layout, k: int) -> rs.Layout:
    pieces = [p._replace(rank=p.rank + k) for p in layout.all_pieces()]
    return rs.Layout.from_pieces(layout.tensors, pieces, {r + k: layout.buffers(r) for r in layout.ranks})


@PROPS
@given(S.layout_pairs(), st.integers(64, 512))
def test_bucketed_plan_is_exact(case, bucket):
    plan = rs.plan(case.source, case.destination, max_bucket_bytes=usable(case, bucket))
    assert_exact(case, run(case, plan))
    counts = S.write_counts(plan)
    for r in case.destination.ranks:
        want = S.coverage(case.destination, r)
        assert all(torch.equal(c, want[b]) for b, c in counts[r].items())
    assert plan.wire_bytes == rs.plan(case.source, case.destination).wire_bytes


@PROPS
@given(S.layout_pairs(), st.integers(64, 512))
def test_bucketed_peak_staging_within_max_bucket_bytes(case, bucket):
    bucket = usable(case, bucket)
    plan = rs.plan(case.source, case.destination, max_bucket_bytes=bucket)
    for r in S.all_ranks(plan):
        peak = plan.for_rank(r).peak_staging_bytes()
        assert peak <= bucket, f"rank {r}: peak staging {peak} > max_bucket_bytes {bucket}"


@PROPS
@given(S.layout_pairs(), st.integers(16, 512))
def test_too_small_bucket_is_rejected_at_plan_time(case, bucket):
    smallest = rs.plan(case.source, case.destination).min_bucket_bytes
    if bucket >= smallest:
        rs.plan(case.source, case.destination, max_bucket_bytes=bucket)
    else:
        with pytest.raises(ValueError, match=rf"max_bucket_bytes={bucket} is too small .* at least {smallest}"):
            rs.plan(case.source, case.destination, max_bucket_bytes=bucket)


def test_bucket_smaller_than_one_tensor_runs_in_rounds():
    spec = _spec((16, 8))  # 512 bytes
    src = rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(0)])
    dst = rs.Layout.from_placements(spec, [2, 3], (2,), [rs.Shard(1)], dtype=torch.bfloat16)
    plan = rs.plan(src, dst, max_bucket_bytes=64)
    assert plan.num_rounds > 1
    assert all(plan.for_rank(r).peak_staging_bytes() <= 64 for r in range(4))
    case = S.Case(S.Recipe(()), src, dst, S.full_tensors([spec]))
    assert_exact(case, run(case, plan))


def test_peak_staging_with_many_peers():
    """Five 16-byte messages leave rank 0 in one round, and two rounds are in flight: a 128-byte cap
    (64 bytes a round) cannot hold them."""
    spec = _spec((64,))
    src = rs.Layout.from_placements(spec, [0], (1,), [rs.Replicate()])
    dst = rs.Layout.from_placements(spec, [1, 2, 3, 4, 5], (5,), [rs.Replicate()])
    with pytest.raises(ValueError, match="rank 0 exchanges 5 messages per round, which needs at least 160 bytes"):
        rs.plan(src, dst, max_bucket_bytes=128)
    plan = rs.plan(src, dst, max_bucket_bytes=160)
    assert plan.for_rank(0).peak_staging_bytes() <= 80  # one round: half the cap


def test_peak_staging_with_colocated_ranks():
    """A rank that sends to and receives from one peer stages both messages in one round."""
    spec = _spec((3, 3))
    src = rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(0)])
    dst = rs.Layout.from_placements(spec, [0, 1, 2], (3,), [rs.Replicate()])
    plan = rs.plan(src, dst, max_bucket_bytes=128)
    assert all(plan.for_rank(r).peak_staging_bytes() <= 64 for r in (0, 1, 2))  # one round: half the cap


def test_small_bucket_with_many_peers_and_8_byte_elements():
    spec = _spec((64,), torch.int64)
    src = rs.Layout.from_placements(spec, [0], (1,), [rs.Replicate()])
    dst = rs.Layout.from_placements(spec, list(range(1, 10)), (9,), [rs.Replicate()])
    with pytest.raises(ValueError, match="max_bucket_bytes=64 is too small"):
        rs.plan(src, dst, max_bucket_bytes=64)
    plan = rs.plan(src, dst, max_bucket_bytes=2 * 9 * 16)
    case = S.Case(S.Recipe(()), src, dst, S.full_tensors([spec]))
    assert_exact(case, run(case, plan))
    assert plan.for_rank(0).peak_staging_bytes() <= 9 * 16  # one round: half the cap


# ---------------------------------------------------------------------------- determinism
@PROPS
@given(S.layout_pairs(), st.sampled_from([None, 64, 200]))
def test_plan_is_deterministic(case, bucket):
    bucket = usable(case, bucket)
    a = rs.plan(case.source, case.destination, max_bucket_bytes=bucket)
    src2, dst2 = S.build(case.recipe)  # same recipe, built again from scratch
    b = rs.plan(src2, dst2, max_bucket_bytes=bucket)
    c = rs.plan(S.rebuild_from_tables(case.source), S.rebuild_from_tables(case.destination),
                max_bucket_bytes=bucket)  # through Layout.from_pieces
    fp = a.fingerprint()
    assert isinstance(fp, str) and 8 <= len(fp) <= 64
    assert fp == a.fingerprint() == b.fingerprint() == c.fingerprint()
    for r in S.all_ranks(a) + [max(S.all_ranks(a), default=0) + 1]:
        assert a.for_rank(r) == b.for_rank(r) == c.for_rank(r)
    assert a.pair_bytes == b.pair_bytes == c.pair_bytes


def rename_buffer(layout: rs.Layout, rank: int, old: str, new: str) -> rs.Layout:
    pieces = [p._replace(buffer=new) if (p.rank, p.buffer) == (rank, old) else p for p in layout.all_pieces()]
    buffers = {r: layout.buffers(r) for r in layout.ranks}
    buffers[rank][new] = buffers[rank].pop(old)
    return rs.Layout.from_pieces(layout.tensors, pieces, buffers)


@PROPS
@given(S.layout_pairs())
def test_fingerprint_changes_with_options_and_layouts(case):
    plan = rs.plan(case.source, case.destination)
    fp = plan.fingerprint()
    small = usable(case, 64)
    assert rs.plan(case.source, case.destination, max_bucket_bytes=small).fingerprint() != fp
    assert rs.plan(case.source, case.destination, max_bucket_bytes=2 * small).fingerprint() != \
        rs.plan(case.source, case.destination, max_bucket_bytes=4 * small).fingerprint()
    if not plan.tensors:
        return
    moved = shift_ranks(case.destination, 100)
    assert rs.plan(case.source, moved).fingerprint() != fp
    piece = next(case.destination.all_pieces())
    renamed = rename_buffer(case.destination, piece.rank, piece.buffer, piece.buffer + ".renamed")
    assert rs.plan(case.source, renamed).fingerprint() != fp


def test_fingerprint_covers_every_rank_buffers():
    """Refits alike but for one destination buffer, padded past its piece, or one buffer more on a rank: the
    pieces and copies are the same, yet ranks that disagree on their buffers must not agree on the plan."""
    w = rs.TensorSpec("w", (4, 6), torch.float32)
    src = rs.Layout.from_placements(w, [0, 1], (2,), [rs.Shard(0)])
    pieces = list(rs.Layout.from_placements(w, [2, 3], (2,), [rs.Shard(1)]).all_pieces())
    held = {2: {"w": ((4, 3), torch.float32)}, 3: {"w": ((4, 3), torch.float32)}}
    padded = {**held, 3: {"w": ((4, 4), torch.float32)}}
    more = {**held, 3: {**held[3], "spare": ((2,), torch.float32)}}
    plans = [rs.plan(src, rs.Layout.from_pieces([w], pieces, buffers)) for buffers in (held, padded, more)]
    assert [p.wire_bytes for p in plans] == [plans[0].wire_bytes] * 3
    assert len({p.fingerprint() for p in plans}) == 3


_FINGERPRINT_SCRIPT = textwrap.dedent("""
    import torch, reshard as rs
    w = rs.TensorSpec("w", (10, 6), torch.float32)
    q = rs.TensorSpec("q", (7, 5), torch.float32)
    src = rs.Layout.merge([
        rs.Layout.from_placements(w, [0, 1, 2, 3], (2, 2), [rs.StridedShard(0, 2), rs.Shard(0)]),
        rs.Layout.from_placements(q, [0, 1, 2, 3], (2, 2), [rs.Replicate(), rs.Shard(1)], split="balanced"),
    ])
    dst = rs.Layout.merge([
        rs.Layout.from_placements(w, [3, 4, 5], (3,), [rs.Shard(1)], dtype=torch.bfloat16),
        rs.Layout.from_placements(q, [5, 4, 6, 7], (2, 2), [rs.Shard(0), rs.Replicate()]),
    ])
    print(rs.plan(src, dst).fingerprint(), rs.plan(src, dst, max_bucket_bytes=192).fingerprint())
""")


def test_fingerprint_is_the_same_in_other_processes():
    """Ranks are separate processes: string hashing (PYTHONHASHSEED) must not leak into plans."""
    outs = set()
    for seed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", _FINGERPRINT_SCRIPT], env=env, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr
        outs.add(res.stdout.strip())
    ns: dict = {}
    exec(_FINGERPRINT_SCRIPT.replace("print(rs.plan", "result = (rs.plan"), ns)
    outs.add(" ".join(ns["result"]))
    assert len(outs) == 1, outs


# ---------------------------------------------------------------------------- examples
def _spec(shape=(8, 6), dtype=torch.float32, name="w"):
    return rs.TensorSpec(name, shape, dtype)


def test_replicated_sources_share_the_sending():
    spec = _spec((8, 6))
    src = rs.Layout.from_placements(spec, [0, 1, 2, 3], (4,), [rs.Replicate()])
    dst = rs.Layout.from_placements(spec, [4, 5, 6, 7], (4,), [rs.Shard(0)])
    plan = rs.plan(src, dst)
    assert plan.wire_bytes == 8 * 6 * 4
    assert plan.send_bytes == {0: 48, 1: 48, 2: 48, 3: 48}
    assert plan.send_balance == 1.0


def test_identical_colocated_layouts_send_nothing():
    spec = _spec((9, 5))
    lay = rs.Layout.from_placements(spec, [0, 1, 2], (3,), [rs.Shard(0)])
    plan = rs.plan(lay, lay)
    assert plan.wire_bytes == 0 and plan.num_messages == 0
    assert plan.local_bytes == 9 * 5 * 4
    case = S.Case(S.Recipe(()), lay, lay, S.full_tensors([spec]))
    assert_exact(case, run(case, plan))


def test_fanout_sends_once_per_rank():
    """A rank holding one box in two buffers receives it once and copies it locally."""
    spec = _spec((4, 4))
    src = rs.Layout.from_placements(spec, [0], (1,), [rs.Replicate()])
    dst = rs.Layout.merge([
        rs.Layout.from_placements(spec, [1], (1,), [rs.Replicate()], buffer="a"),
        rs.Layout.from_placements(spec, [1], (1,), [rs.Replicate()], buffer="b"),
    ])
    plan = rs.plan(src, dst)
    assert plan.wire_bytes == 64
    p = plan.for_rank(1)
    assert len(p.fanout) == 1 and p.fanout[0].src_buffer != p.fanout[0].dst_buffer
    case = S.Case(S.Recipe(()), src, dst, S.full_tensors([spec]))
    assert_exact(case, run(case, plan))


# Fan-out items index the destination table: regression for an IndexError when a destination
# piece index exceeded the number of source pieces.
def test_fanout_with_more_destination_pieces_than_source_pieces():
    spec = _spec((4,))
    src = rs.Layout.from_placements(spec, [0], (1,), [rs.Replicate()])
    dst = rs.Layout.merge([
        rs.Layout.from_placements(spec, [1, 2], (2,), [rs.Replicate()], buffer="a"),
        rs.Layout.from_placements(spec, [2], (1,), [rs.Replicate()], buffer="b"),
    ])
    plan = rs.plan(src, dst)  # IndexError: index 1 is out of bounds for axis 0 with size 1
    assert plan.wire_bytes == 2 * 4 * 4
    case = S.Case(S.Recipe(()), src, dst, S.full_tensors([spec]))
    assert_exact(case, run(case, plan))


def test_partially_overlapping_sources_cover_the_destination():
    spec = _spec((10, 6))
    src = rs.Layout.merge([
        rs.Layout.from_pieces([spec], [Piece("w", (0, 0), (7, 6), "a", (0, 0), 0)]),
        rs.Layout.from_pieces([spec], [Piece("w", (4, 0), (6, 6), "b", (0, 0), 1)]),
    ])
    dst = rs.Layout.from_placements(spec, [1, 2], (2,), [rs.Shard(1)])
    plan = rs.plan(src, dst)
    # rank 1 holds rows 4:10 already; it needs rows 0:4 of its 3 columns; rank 2 needs all 60 / 2 elements
    assert plan.wire_bytes == (4 * 3 + 10 * 3) * 4
    case = S.Case(S.Recipe(()), src, dst, S.full_tensors([spec]))
    assert_exact(case, run(case, plan))


def test_plan_docstring_example():
    spec = rs.TensorSpec("w", (4, 6), torch.float32)
    src = rs.Layout.from_placements(spec, ranks=[0, 1], mesh_shape=(2,), placements=[rs.Shard(0)])
    dst = rs.Layout.from_placements(spec, ranks=[2, 3, 4], mesh_shape=(3,), placements=[rs.Shard(1)])
    assert rs.plan(src, dst).wire_bytes == 96


def test_max_bucket_bytes_below_minimum_is_rejected():
    spec = _spec()
    lay = rs.Layout.from_placements(spec, [0], (1,), [rs.Replicate()])
    with pytest.raises(ValueError, match="max_bucket_bytes"):
        rs.plan(lay, lay, max_bucket_bytes=15)  # below one aligned element


@given(S.layout_pairs())
def test_gather_bytes_are_the_gather_plans_wire(case):
    """gather_broadcast_bytes counts the gather from the boxes its root holds, without planning it: the
    gather plan's own wire bytes, whichever source rank gathers."""
    plan = rs.plan(case.source, case.destination)
    for root in plan.source.ranks:
        assert gather_broadcast_bytes(plan, root)["gather"] == gather_plan(plan, root).wire_bytes, root


def test_gather_bytes_where_the_root_holds_overlapping_boxes():
    spec = _spec((10, 6))
    src = rs.Layout.merge([
        rs.Layout.from_pieces([spec], [Piece("w", (0, 0), (7, 6), "a", (0, 0), 0),
                                       Piece("w", (4, 0), (6, 6), "b", (0, 0), 0)]),
        rs.Layout.from_pieces([spec], [Piece("w", (0, 0), (10, 6), "c", (0, 0), 1)]),
    ])
    plan = rs.plan(src, rs.Layout.from_placements(spec, [2, 3], (2,), [rs.Shard(0)]))
    # rank 0 holds every row (rows 4:7 twice): nothing to gather; rank 1 lacks nothing either
    assert gather_broadcast_bytes(plan, 0) == {"gather": 0, "broadcast": 2 * 60 * 4} == {
        "gather": gather_plan(plan, 0).wire_bytes, "broadcast": 2 * 60 * 4}
    assert gather_broadcast_bytes(plan, 1)["gather"] == gather_plan(plan, 1).wire_bytes == 0
