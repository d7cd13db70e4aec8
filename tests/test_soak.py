"""Under load, in short: gather-and-broadcast executors built and closed over and over keep the open
file descriptors flat (each makes a broadcast subgroup, which it must release), on torch's default
group and on a standalone one; and ranks that pass different roots all raise at once instead of
hanging in the split. ``benchmarks/bench_soak.py`` is the long version (100 refits, memory and time)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

import reshard as rs
from reshard.execution.group import Group
from reshard.execution.process_group import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TIMEOUT = timedelta(seconds=30)
BUILDS = 30


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _layouts():
    """Sources 0 and 1, destination 2: with root 0 the broadcast group is {0, 2}, so rank 1 is outside
    it; with root 1 it is {1, 2}."""
    w = rs.TensorSpec("w", (8, 6), torch.float32)
    return (rs.Layout.from_placements(w, [0, 1], (2,), [rs.Shard(0)]),
            rs.Layout.from_placements(w, [2], (1,), [rs.Shard(1)]))


def _soak(rank, world, store_addr):
    src, dst = _layouts()
    plan = rs.plan(src, dst)
    full = {"w": torch.arange(48, dtype=torch.float32).reshape(8, 6)}
    sb = src.materialize(rank, full) if rank in src.ranks else {}
    standalone = Group.connect(store_addr, rank, world, timeout=TIMEOUT)
    for label, group in (("default group", None), ("standalone group", standalone)):
        for i in range(BUILDS + 5):
            if i == 5:  # after a few builds: lazily opened connections (stores, control plane) are open
                before = open_fds()
            if i % 3 == 0:
                with rs.GatherBroadcastExecutor(rs.gather_broadcast_plan(plan, root=i % 2), group, timeout=TIMEOUT) as ex:
                    if i in (0, BUILDS + 3):  # the first and the last move bytes too
                        db = dst.empty_buffers(rank)
                        ex.run(sb, db)
                        for name, want in dst.materialize(rank, full).items():
                            assert torch.equal(db[name], want), (label, rank, name)
            elif i % 3 == 1:
                ex = rs.GatherBroadcastExecutor(rs.gather_broadcast_plan(plan, root=i % 2), group, timeout=TIMEOUT)
                ex.close()
                ex.close()  # idempotent
                with pytest.raises(RuntimeError, match="closed"):
                    ex.run(sb, dst.empty_buffers(rank))
            else:  # a forgotten close: released when the executor is collected
                rs.GatherBroadcastExecutor(rs.gather_broadcast_plan(plan, root=i % 2), group, timeout=TIMEOUT)
        grown = open_fds() - before
        assert grown <= 2, f"rank {rank}, {label}: {grown} more file descriptors after {BUILDS} executors"

    # ranks pass different roots: every rank raises the same error, naming the roots, before any split
    for label, group in (("default group", None), ("standalone group", standalone)):
        start = time.monotonic()
        with pytest.raises(rs.LayoutError) as err:
            rs.GatherBroadcastExecutor(rs.gather_broadcast_plan(plan, root=rank % 2), group, timeout=TIMEOUT)
        took = time.monotonic() - start
        assert "option 'root' (rank 0: 0, rank 1: 1, rank 2: 0)" in str(err.value), (label, str(err.value))
        assert took < TIMEOUT.total_seconds() / 3, (label, took)
        # the group still works afterwards (the failed construction left no split half made)
        with rs.GatherBroadcastExecutor(rs.gather_broadcast_plan(plan), group, timeout=TIMEOUT) as ex:
            db = dst.empty_buffers(rank)
            ex.run(sb, db)
            for name, want in dst.materialize(rank, full).items():
                assert torch.equal(db[name], want), (label, rank, name)
    standalone.close()


def test_gather_broadcast_executors_release_their_groups_and_agree_on_the_root():
    rs.spawn(_soak, 3, f"127.0.0.1:{free_port()}", backend="gloo")
