"""Run every rank's part of a plan in one process: the fuzzing target and the tests' executor.

It goes through exactly the packing functions the distributed executors use, phase by phase
(the first phase reads the source buffers, later ones the destination buffers).
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..planning.hybrid import HybridPlan
from ..planning.plan import PhasedPlan, Plan
from ..planning.precision import PrecisionPlan
from .packing import Buffers, copy_within, pack, unpack


def run_local(plan: PhasedPlan, src_buffers: Mapping[int, Buffers], dst_buffers: Mapping[int, Buffers]) -> None:
    """Run every rank's part of ``plan`` in this process, phase after phase.

    ``src_buffers[rank]`` / ``dst_buffers[rank]`` are ``{buffer_name: Tensor}``;
    destination tensors are written in place. A :class:`~reshard.planning.precision.PrecisionPlan`
    also quantizes: :func:`~reshard.execution.precision.run_local_precision` runs it.

    >>> import torch, reshard as rs
    >>> spec = rs.TensorSpec("w", (2, 4), torch.float32)
    >>> src = rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(0)])
    >>> dst = rs.Layout.from_placements(spec, [2, 3], (2,), [rs.Shard(1)])
    >>> full = {"w": torch.arange(8.0).view(2, 4)}
    >>> out = {r: dst.empty_buffers(r) for r in dst.ranks}
    >>> run_local(rs.plan(src, dst), {r: src.materialize(r, full) for r in src.ranks}, out)
    >>> out[3]["w"].tolist()
    [[2.0, 3.0], [6.0, 7.0]]
    """
    if isinstance(plan, PrecisionPlan):  # its wire phases read staging that quantizing fills first
        raise TypeError("run_local moves bytes only; a PrecisionPlan also quantizes: use "
                        "reshard.execution.precision.run_local_precision (rs.run_local_precision)")
    if isinstance(plan, HybridPlan):  # two plans, each reading the source buffers
        for part in (plan.reshard, plan.broadcast):
            if part is not None:
                run_local(part, src_buffers, dst_buffers)
        return
    if getattr(plan, "is_pipelined", False):  # a pipelined hierarchical plan: step by step
        from .executor import run_local_pipelined
        return run_local_pipelined(plan, src_buffers, dst_buffers)
    for i, phase in enumerate(plan.phases):
        _run_phase(phase, src_buffers if i == 0 else dst_buffers, dst_buffers)


def _run_phase(plan: Plan, src_buffers: Mapping[int, Buffers], dst_buffers: Mapping[int, Buffers]) -> None:
    ranks = sorted(set(plan.source.ranks) | set(plan.destination.ranks))
    parts = {r: plan.for_rank(r) for r in ranks}
    empty: dict[str, torch.Tensor] = {}
    for r, p in parts.items():
        copy_within(p.local, src_buffers.get(r, empty), dst_buffers.get(r, empty), r)
    rounds = max((p.num_rounds for p in parts.values()), default=0)
    for j in range(rounds):
        for r, p in parts.items():
            for msg in p.round(j)[0]:
                payload = pack(msg, src_buffers.get(r, empty), r)
                peer_msg = next(m for m in parts[msg.peer].round(j)[1] if m.peer == r)
                unpack(peer_msg, payload, dst_buffers.get(msg.peer, empty), msg.peer)
    for r, p in parts.items():
        copy_within(p.fanout, dst_buffers.get(r, empty), dst_buffers.get(r, empty), r)
