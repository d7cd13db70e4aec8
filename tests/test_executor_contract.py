"""The written executor contract (``reshard.execution.base``), checked on every executor with real
processes: a rank that never arrives is named within the timeout, whatever the kind of group.

Rank 2 stands for a rank whose training step failed: it joins every group but never builds or
runs the executor. Ranks 0 and 1 must raise ``RefitError`` naming rank 2 within the executor's
timeout (plus a margin for a loaded machine), on torch's default group, a registered subgroup
and a standalone group, for the reshard, hybrid, gather-broadcast and precision executors."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import reshard as rs
from reshard.execution.base import Executor
from reshard.execution.gather_broadcast import GatherBroadcastExecutor
from reshard.execution.group import Group
from reshard.execution.hybrid import HybridExecutor
from reshard.execution.precision import PrecisionExecutor
from reshard.execution.process_group import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
T = datetime.timedelta(seconds=3)
MARGIN_S = 12.0  # the bound checked: T plus this, for a machine whose cores are busy
ABSENT = 2
WORLD = 3


def _plans() -> dict[str, tuple[type[Executor], object]]:
    """executor name -> (its class, a finished plan): sources on rank 0, destinations on rank 1."""
    up = rs.TensorSpec("mlp.up_proj.weight", (128, 128), torch.bfloat16)
    norm = rs.TensorSpec("norm.weight", (128,), torch.bfloat16)
    src = rs.Layout.merge([rs.Layout.from_placements(s, [0], (1,), [rs.Replicate()]) for s in (up, norm)])
    dst = rs.Layout.merge([rs.Layout.from_placements(s, [1], (1,), [rs.Replicate()]) for s in (up, norm)])
    direct = rs.plan(src, dst)
    return {
        "reshard": (rs.ReshardExecutor, direct),
        "hybrid": (HybridExecutor, rs.HybridPlan(src, dst)),
        "gather-broadcast": (GatherBroadcastExecutor, rs.gather_broadcast_plan(direct)),
        "precision": (PrecisionExecutor, rs.PrecisionPlan(src, dst, "fp8")),
    }


def _buffers(plan, rank: int) -> tuple[dict, dict]:
    src = {n: torch.ones(shape, dtype=dt) for n, (shape, dt) in plan.source.buffers(rank).items()}
    return src, plan.destination.empty_buffers(rank)


def _expect_rank_named(name: str, kind: str, cls, plan, group) -> None:
    """Ranks other than ABSENT: building and running the executor raises RefitError naming ABSENT in time."""
    start = time.monotonic()
    with pytest.raises(rs.RefitError) as err:
        executor = cls(plan, group, timeout=T)  # collective for hybrid and gather-broadcast
        src, dst = _buffers(plan, dist.get_rank())
        executor.run(src, dst)
    took = time.monotonic() - start
    where = f"{name} on {kind}"
    assert ABSENT in err.value.ranks, f"{where}: {err.value}"
    assert took < T.total_seconds() + MARGIN_S, f"{where}: took {took:.1f} s, timeout {T.total_seconds()} s"
    assert not err.value.moved, f"{where}: nothing moved, yet the error says bytes moved: {err.value}"


def _body(rank: int, world: int, store_port: int) -> None:
    plans = _plans()
    store = dist.TCPStore("127.0.0.1", store_port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    store_addr = f"127.0.0.1:{store_port}"
    absent = rank == ABSENT
    if not absent:  # torch's default group: the README's second example's case
        cls, plan = plans["reshard"]
        _expect_rank_named("reshard", "the default group", cls, plan, None)
    for index, (name, (cls, plan)) in enumerate(plans.items()):
        sub = dist.new_group(list(range(world)))  # collective: the absent rank joins the group itself
        standalone = Group.connect(store_addr, rank, world, timeout=T, prefix=f"contract{index}", store=store)
        if not absent:
            _expect_rank_named(name, "a registered subgroup", cls, plan, sub)
            _expect_rank_named(name, "a standalone group", cls, plan, standalone)
        standalone.close()
    dist.barrier()  # the absent rank stays alive (it never arrives; it does not die) until everyone is done


def test_a_rank_that_never_arrives_is_named_within_the_timeout():
    store_port = free_port()
    rs.spawn(_body, WORLD, store_port, timeout=datetime.timedelta(seconds=240))
