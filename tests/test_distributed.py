"""Real multi-process runs over gloo: both executors (reshard sequential and overlapped), bit-exact,
plus errors and live DTensors.

Each test spawns one process group and runs several scenarios in it (spawning is slow).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import reshard as rs

pytestmark = pytest.mark.slow


def _full(specs):
    out = {}
    for i, s in enumerate(specs):
        vals = (torch.arange(s.numel, dtype=torch.int64) * 7 + 1000 * i) % 4093 - 2046
        out[s.name] = vals.reshape(s.shape).to(s.dtype)
    return out


def _scenarios():
    """name -> (source layout, destination layout, max_bucket_bytes) over ranks 0..5."""
    a = rs.TensorSpec("a", (10, 7), torch.float32)  # uneven under chunk
    b = rs.TensorSpec("b", (6, 5, 4), torch.bfloat16)
    q = rs.TensorSpec("q", (8, 6), torch.float32)
    k = rs.TensorSpec("k", (4, 6), torch.float32)
    v = rs.TensorSpec("v", (4, 6), torch.float32)
    out = {}
    # M != N, cross-dim, uneven, cast to bf16 at the destination.
    out["m2_n3_crossdim_uneven"] = (
        rs.Layout.from_placements(a, [0, 1], (2,), [rs.Shard(0)]),
        rs.Layout.from_placements(a, [2, 3, 4], (3,), [rs.Shard(1)], dtype=torch.bfloat16),
        None,
    )
    # source replicas (2 x 2 mesh) to destination replicas (2 DP x 2 TP), colocated ranks 2 and 3.
    out["replicas_colocated_3d"] = (
        rs.Layout.from_placements(b, [0, 1, 2, 3], (2, 2), [rs.Shard(0), rs.Replicate()]),
        rs.Layout.from_placements(b, [2, 3, 4, 5], (2, 2), [rs.Replicate(), rs.Shard(2)]),
        None,
    )
    # strided source (FSDP over TP) into a fused qkv buffer per destination rank, TP 2.
    src = rs.Layout.merge([rs.Layout.from_placements(t, [0, 1, 2, 3], (2, 2), [rs.StridedShard(0, 2), rs.Shard(0)])
                           for t in (q, k, v)])
    pieces = []
    for tp, rank in enumerate((4, 5)):
        row = 0
        for t in (q, k, v):
            n = t.shape[0] // 2
            pieces.append(rs.Piece(t.name, (tp * n, 0), (n, 6), "qkv", (row, 0), rank))
            row += n
    out["strided_to_fused_qkv"] = (src, rs.Layout.from_pieces([q, k, v], pieces), None)
    # bucketed: the cap is smaller than one tensor, so copies split across rounds.
    out["bucketed"] = (
        rs.Layout.merge([rs.Layout.from_placements(a, [0, 1, 2], (3,), [rs.Shard(1)], split="balanced"),
                         rs.Layout.from_placements(b, [0, 1, 2], (3,), [rs.Shard(0)])]),
        rs.Layout.merge([rs.Layout.from_placements(a, [3, 4, 5], (3,), [rs.Shard(0)]),
                         rs.Layout.from_placements(b, [3, 4, 5], (3,), [rs.Replicate()])]),
        192,  # two rounds in flight of 96 bytes each
    )
    return out


def _run_scenarios(rank, world):
    for name, (src, dst, bucket) in _scenarios().items():
        plan = rs.plan(src, dst, max_bucket_bytes=bucket)
        full = _full(list(dst.specs.values()))
        expected = dst.materialize(rank, full) if rank in dst.ranks else {}
        executors = (rs.ReshardExecutor(plan, overlap=False), rs.ReshardExecutor(plan),  # overlapped by default
                     rs.ReshardExecutor(plan, overlap=rank % 2 == 0),  # ranks may differ in the order
                     rs.GatherBroadcastExecutor(rs.gather_broadcast_plan(plan)))
        for executor in executors:
            sb = src.materialize(rank, full) if rank in src.ranks else {}
            db = dst.empty_buffers(rank)
            stats = executor.run(sb, db)
            for buf, want in expected.items():
                assert torch.equal(db[buf].view(torch.uint8), want.view(torch.uint8)), (name, executor, rank, buf)
            if isinstance(executor, rs.ReshardExecutor):
                assert stats.sent_bytes == plan.send_bytes.get(rank, 0), (name, rank)
                assert stats.recv_bytes == plan.recv_bytes.get(rank, 0), (name, rank)
                assert stats.peak_staging_bytes == executor.staging_bytes(), (name, rank, stats)
                if bucket is not None:  # overlapped: two rounds in flight, each under half the cap
                    assert stats.peak_staging_bytes <= (1 if executor.overlap else 0.5) * bucket, (name, rank, stats)
                    assert stats.rounds > 1 or rank not in plan.destination.ranks
        totals = [None] * world
        dist.all_gather_object(totals, plan.for_rank(rank).recv_bytes)
        assert sum(totals) == plan.wire_bytes
    _run_hierarchical(rank, world)


def _run_hierarchical(rank, world):
    """Pretend NVLink domains {2, 3} and {4, 5} of destinations (sources 0 and 1 each alone):
    ``a`` is replicated on all four, ``b`` sharded over 2 and replicated within each domain, so
    every domain takes each byte it needs over the "network" once and forwards the rest."""
    from reshard.planning.hierarchy import domain_need_bytes, hierarchical_plan

    a = rs.TensorSpec("a", (12, 6), torch.bfloat16)
    b = rs.TensorSpec("b", (8, 5), torch.float32)
    src = rs.Layout.merge([rs.Layout.from_placements(a, [0, 1], (2,), [rs.Shard(1)]),
                           rs.Layout.from_placements(b, [0, 1], (2,), [rs.Replicate()])])
    dst = rs.Layout.merge([rs.Layout.from_placements(a, [2, 3, 4, 5], (4,), [rs.Replicate()]),
                           rs.Layout.from_placements(b, [2, 3, 4, 5], (2, 2), [rs.Shard(0), rs.Replicate()])])
    domains = {0: 0, 1: 1, 2: 2, 3: 2, 4: 3, 5: 3}
    h = hierarchical_plan(src, dst, domains, max_bucket_bytes=128)
    full = _full([a, b])
    sb = src.materialize(rank, full) if rank in src.ranks else {}
    for overlap in (True, False):
        db = dst.empty_buffers(rank)
        stats = rs.ReshardExecutor(h, overlap=overlap).run(sb, db)  # every phase, in order
        for buf, want in (dst.materialize(rank, full) if rank in dst.ranks else {}).items():
            assert torch.equal(db[buf].view(torch.uint8), want.view(torch.uint8)), ("hierarchical", overlap, rank, buf)
    received = [None] * world  # bytes each rank really took over the "network" (from another domain)
    dist.all_gather_object(received, sum(
        sum(c.nbytes for c in m.copies) for p in h.phases for m in p.for_rank(rank).recvs
        if domains[m.peer] != domains[rank]))
    per_domain = {d: sum(received[r] for r in range(world) if domains[r] == d) for d in (2, 3)}
    assert per_domain == {d: n for d, n in domain_need_bytes(dst, domains).items()}
    direct = rs.plan(src, dst).recv_bytes  # without domains every replica takes its own copy
    for d in (2, 3):
        assert per_domain[d] * 2 == sum(direct[r] for r in range(world) if domains[r] == d)
    assert h.relay is not None  # `a` has one copy of each half on the sources and two domains need it
    assert [p.name for p in stats.phases] == h.phase_names == ["network", "relay", "NVLink forward"]
    assert stats.recv_bytes == sum(st.recv_bytes for st in stats.phases) == sum(p.recv_bytes.get(rank, 0)
                                                                                  for p in h.phases)


def test_both_executors_bit_exact():
    rs.spawn(_run_scenarios, 6)


def _bad_input(rank, world):
    spec = rs.TensorSpec("w", (8, 4), torch.float32)
    src = rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(0)])
    dst = rs.Layout.from_placements(spec, [2, 3], (2,), [rs.Shard(1)])
    plan = rs.plan(src, dst)
    full = _full([spec])
    sb = src.materialize(rank, full) if rank in src.ranks else {}
    db = {b: torch.full(shape, -1.0) for b, (shape, _) in dst.buffers(rank).items()}
    if rank == 3:
        db["w"] = torch.full((8, 3), -1.0)  # wrong shape on one rank
    for executor in (rs.ReshardExecutor(plan), rs.GatherBroadcastExecutor(rs.gather_broadcast_plan(plan))):
        with pytest.raises(rs.LayoutError, match=r"rank 3: destination buffer 'w' is \(8, 3\)"):
            executor.run(sb, db)
        assert all(bool((t == -1).all()) for t in db.values()), "destination touched despite the error"
    # a rank that planned with another layout is caught by the fingerprint check
    other = rs.plan(src, rs.Layout.from_placements(spec, [2, 3], (2,), [rs.Shard(0)])) if rank == 0 else plan
    db = dst.empty_buffers(rank)
    with pytest.raises(rs.LayoutError, match="disagree on the plan fingerprint"):
        rs.ReshardExecutor(other).run(sb, db)


def test_bad_input_raises_on_every_rank_before_moving_bytes():
    rs.spawn(_bad_input, 4)


def _dtensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2))
    cases = [
        ((10, 7), [Shard(0), Shard(0)]),
        ((9, 5), [Shard(1), Replicate()]),
        ((11, 3), [Replicate(), Shard(0)]),
        ((13, 4), [_StridedShard(0, split_factor=2), Shard(0)]),
        ((7, 6, 5), [Shard(2), Shard(0)]),
    ]
    for i, (shape, placements) in enumerate(cases):
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        dt = distribute_tensor(full, mesh, placements, src_data_rank=None)  # local split, no scatter
        layout = rs.Layout.from_dtensor(f"t{i}", dt)
        mine = layout.materialize(rank, {f"t{i}": full})[f"t{i}"]
        assert torch.equal(mine, dt.to_local()), (shape, placements, rank, mine, dt.to_local())


def test_from_dtensor_matches_torch_local_shards():
    rs.spawn(_dtensor, 4)


def _fault_mid_run(rank, world):
    """Rank 1 fails while unpacking round 2 (overlapped: round 3 is in flight, round 4 already
    packed) and then stalls: it raises its own error, rank 0 raises from its bounded wait."""
    import time
    from datetime import timedelta

    from reshard.execution import executor as ex

    spec = rs.TensorSpec("w", (64, 32), torch.float32)
    src = rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(0)])
    dst = rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(1)])
    plan = rs.plan(src, dst, max_bucket_bytes=512)
    assert plan.for_rank(rank).num_rounds > 4
    sb, db = src.materialize(rank, _full([spec])), dst.empty_buffers(rank)
    if rank == 1:
        real, calls = ex.unpack, [0]

        def failing(*args):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected unpack failure")
            return real(*args)

        ex.unpack = failing
    start = time.perf_counter()
    with pytest.raises(RuntimeError) as err:
        rs.ReshardExecutor(plan, timeout=timedelta(seconds=2)).run(sb, db)
    if rank == 1:
        assert "injected" in str(err.value)
        time.sleep(6)  # stall instead of leaving: rank 0 must not wait for it
    else:
        assert time.perf_counter() - start < 5, err.value  # the 2 s timeout, not rank 1's exit


@pytest.mark.timeout(120)
def test_failure_mid_run_raises_on_every_rank():
    rs.spawn(_fault_mid_run, 2)
