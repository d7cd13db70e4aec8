"""Gather-and-broadcast, the baseline RL stacks run today: its root, its plan and its bytes, in one place.

For each tensor, in order: the source ranks send their parts of it to ``root`` (the lowest
source rank, like training rank 0), ``root`` assembles the full tensor, broadcasts it to every
destination rank, and each destination copies its pieces out of it. Every destination receives
every byte of every tensor. Per-rank bytes for tensor ``t`` on 4 -> 3 ranks (root 0)::

    rank        0 (root)          1..3 (sources)     4..6 (destinations)
    receives    3/4 of t          0                  all of t
    sends       3 x t (logical)   1/4 of t each      0

Its executor (:class:`~reshard.execution.gather_broadcast.GatherBroadcastExecutor`) runs
:func:`gather_plan` and NCCL/gloo broadcasts; the cost model
(:func:`~reshard.modeling.cost.gather_broadcast_time_of`) models the same steps from
:func:`gather_sends`; ``reshard plan`` counts :func:`gather_broadcast_bytes`.

>>> import torch, reshard as rs
>>> spec = rs.TensorSpec("w", (4, 6), torch.float32)
>>> src = rs.Layout.from_placements(spec, ranks=[0, 1], mesh_shape=(2,), placements=[rs.Shard(0)])
>>> dst = rs.Layout.from_placements(spec, ranks=[2, 3, 4], mesh_shape=(3,), placements=[rs.Shard(1)])
>>> gather_broadcast_bytes(rs.plan(src, dst))   # half of w to root 0, then all of w to 3 ranks
{'gather': 48, 'broadcast': 288}
"""

from __future__ import annotations

from collections import defaultdict

from ..layout import Layout
from ..placements import Replicate
from .plan import Plan


def default_root(plan: Plan) -> int:
    """The rank that gathers: the lowest source rank (training rank 0 in RL stacks)."""
    return min(plan.source.ranks)


def gather_layout(plan: Plan, root: int) -> Layout:
    """Full tensors on ``root``, each in a buffer named after it, in the destination's dtype."""
    layouts = []
    for name in plan.tensors:
        spec = plan.destination.specs[name]
        t = plan.destination.tables[name]
        dtype = plan.destination.buffer_spec(int(t.ranks[0]), t.buffers[0])[1]
        layouts.append(Layout.from_placements(spec, [root], (1,), [Replicate()], dtype=dtype))
    return Layout.merge(layouts)


def gather_plan(plan: Plan, root: int | None = None) -> Plan:
    """The gather step: every tensor ``plan`` moves, from the sources to full buffers on ``root``."""
    root = default_root(plan) if root is None else root
    return Plan(plan.source, gather_layout(plan, root))


def broadcast_members(plan: Plan, root: int) -> list[int]:
    """The ranks of the broadcast: ``root`` and every destination rank, sorted."""
    return sorted({root} | set(plan.destination.ranks))


def gather_broadcast_bytes(plan: Plan, root: int | None = None) -> dict[str, int]:
    """Logical bytes the baseline moves: ``gather`` (to root), ``broadcast`` (root to each destination)."""
    root = default_root(plan) if root is None else root
    gather = gather_plan(plan, root)
    receivers = [r for r in plan.destination.ranks if r != root]
    full = sum(gather.destination.specs[n].numel * gather.destination.buffer_spec(root, n)[1].itemsize
               for n in plan.tensors)
    return {"gather": gather.wire_bytes, "broadcast": full * len(receivers)}


def gather_sends(plan: Plan, root: int | None = None) -> tuple[list[str], list[int], list[dict[int, int]]]:
    """Per tensor of ``plan``: (names, full bytes in the destination dtype, ``{source rank: bytes it
    sends to root}``), the input of :func:`~reshard.modeling.cost.gather_broadcast_time`.

    Pieces with the same box on several ranks are replicas: a box root holds is not sent; any
    other box's bytes are split evenly over its holders (what the planner's balanced choice of
    replicas gives in aggregate, without planning whole models). Boxes are taken as equal or
    disjoint, which Shard/Replicate layouts give.
    """
    src = plan.source
    root = default_root(plan) if root is None else root
    names, sizes, sends = [], [], []
    cache: dict[tuple, dict[int, int]] = {}
    for name in plan.tensors:
        spec = plan.destination.specs[name]
        isz = int(plan.destination.itemsizes(name)[0])
        t = src.tables[name]
        key = (t.geometry_key(), isz)
        got = cache.get(key)
        if got is None:
            got = {}
            if len(t):
                inv, holders = t.box_copies()
                held_by_root = set(inv[t.ranks == root].tolist())
                vol = t.sizes.prod(axis=1) * isz
                acc: dict[int, float] = defaultdict(float)
                for r, u, v in zip(t.ranks.tolist(), inv.tolist(), vol.tolist()):
                    if u not in held_by_root and r != root:
                        acc[r] += v / holders[u]
                got = {r: int(round(v)) for r, v in acc.items()}
            cache[key] = got
        names.append(name)
        sizes.append(spec.numel * isz)
        sends.append(got)
    return names, sizes, sends


__all__ = ["broadcast_members", "default_root", "gather_broadcast_bytes", "gather_layout", "gather_plan",
           "gather_sends"]
