"""Gather-and-broadcast, the baseline RL stacks run today: its root, its plan and its bytes, in one place.

For each tensor, in order: the source ranks send their parts of it to ``root`` (the lowest
source rank, like training rank 0), ``root`` assembles the full tensor, broadcasts it to every
destination rank, and each destination copies its pieces out of it. Every destination receives
every byte of every tensor. Per-rank bytes for tensor ``t`` on 4 -> 3 ranks (root 0)::

    rank        0 (root)          1..3 (sources)     4..6 (destinations)
    receives    3/4 of t          0                  all of t
    sends       3 x t (logical)   1/4 of t each      0

Its executor (:class:`~reshard.execution.gather_broadcast.GatherBroadcastExecutor`) runs
:func:`gather_plan` and NCCL/gloo broadcasts; the cost model's naive variant
(:func:`~reshard.modeling.baseline_time.gather_broadcast_time_of`) models the same steps from
:func:`gather_sends`; ``reshard plan`` counts :func:`gather_broadcast_bytes`.

The best implementations gather per pipeline stage instead, each stage into its own root, and
broadcast from all the roots at once: :func:`stage_groups` finds the stages of a source layout
(ranks that hold parts of one tensor), :func:`stage_sends` what each gathers, the input of the
cost model's fair variant (:func:`~reshard.modeling.baseline_time.gather_broadcast_fair_time`).

>>> import torch, reshard as rs
>>> spec = rs.TensorSpec("w", (4, 6), torch.float32)
>>> src = rs.Layout.from_placements(spec, ranks=[0, 1], mesh_shape=(2,), placements=[rs.Shard(0)])
>>> dst = rs.Layout.from_placements(spec, ranks=[2, 3, 4], mesh_shape=(3,), placements=[rs.Shard(1)])
>>> gather_broadcast_bytes(rs.plan(src, dst))   # half of w to root 0, then all of w to 3 ranks
{'gather': 48, 'broadcast': 288}
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..layout import Layout, PieceTable, read_only
from .plan import Plan


def default_root(plan: Plan) -> int:
    """The rank that gathers: the lowest source rank (training rank 0 in RL stacks)."""
    return min(plan.source.ranks)


def gather_layout(plan: Plan, root: int, tensors: list[str] | None = None) -> Layout:
    """Full tensors on ``root`` (``plan``'s, or ``tensors``), each in a buffer named after it, in the
    destination's dtype (built as tables: tensors of one shape share their piece arrays; no layout
    built and checked per tensor)."""
    specs, tables, buffers = {}, {}, {}
    shared: dict[tuple[int, ...], tuple[np.ndarray, ...]] = {}  # per shape: offsets, sizes, buffer offsets
    ranks = read_only((np.array([root], np.int64),))[0]
    for name in plan.tensors if tensors is None else tensors:
        spec = plan.destination.specs[name]
        t = plan.destination.tables[name]
        dtype = _first_dtype(plan.destination, name)
        arrays = shared.get(spec.shape)
        if arrays is None:
            zeros = np.zeros((1, len(spec.shape)), np.int64)
            arrays = shared[spec.shape] = read_only((zeros, np.array([spec.shape], np.int64).reshape(1, -1),
                                                     zeros.copy()))
        specs[name] = spec
        tables[name] = PieceTable(ranks, arrays[0], arrays[1], (name,), arrays[2])
        buffers[name] = (tuple(spec.shape), dtype)
    return Layout(specs, tables, {root: buffers} if buffers else {}, validate=False)


def gather_plan(plan: Plan, root: int | None = None) -> Plan:
    """The gather step: every tensor ``plan`` moves, from the sources to full buffers on ``root``."""
    root = default_root(plan) if root is None else root
    return Plan(plan.source, gather_layout(plan, root))


def broadcast_members(plan: Plan, root: int) -> list[int]:
    """The ranks of the broadcast: ``root`` and every destination rank, sorted."""
    return sorted({root} | set(plan.destination.ranks))


class GatherBroadcastPlan:
    """The baseline as a finished plan: ``direct`` (what each destination ends up holding), the rank
    that gathers (``root``), the :func:`gather_plan` into full buffers on it, and the broadcast's
    members. What :class:`~reshard.execution.gather_broadcast.GatherBroadcastExecutor` runs.

    >>> import torch, reshard as rs
    >>> spec = rs.TensorSpec("w", (4, 6), torch.float32)
    >>> src = rs.Layout.from_placements(spec, ranks=[0, 1], mesh_shape=(2,), placements=[rs.Shard(0)])
    >>> dst = rs.Layout.from_placements(spec, ranks=[2, 3], mesh_shape=(2,), placements=[rs.Replicate()])
    >>> g = GatherBroadcastPlan(rs.plan(src, dst))
    >>> g.root, g.members, g.phase_names, g.wire_bytes
    (0, [0, 2, 3], ['gather', 'broadcast'], 240)
    """

    max_bucket_bytes = None  # full tensors are staged: no cap

    def __init__(self, direct: Plan, root: int | None = None) -> None:
        self.direct = direct
        self.root = int(default_root(direct) if root is None else root)
        self.gather = gather_plan(direct, self.root)
        self.members = broadcast_members(direct, self.root)

    @property
    def source(self) -> Layout:
        return self.direct.source

    @property
    def destination(self) -> Layout:
        return self.direct.destination

    @property
    def tensors(self) -> list[str]:
        return self.direct.tensors

    @property
    def phases(self) -> list[Plan]:
        """The ranks and buffers it touches are the direct plan's."""
        return [self.direct]

    @property
    def phase_names(self) -> list[str]:
        return ["gather", "broadcast"]

    @property
    def wire_bytes(self) -> int:
        return sum(gather_broadcast_bytes(self.direct, self.root).values())

    def source_reads(self, rank: int) -> list:
        """The copies of ``rank``'s that read its source buffers: the gather's."""
        return self.gather.source_reads(rank)

    def fingerprint(self) -> str:
        """The direct plan's: the root is one of the executor's options, which the ranks compare too
        (so that ranks with another root are told which)."""
        return self.direct.fingerprint()

    def summary(self) -> dict:
        return {"root": self.root, **gather_broadcast_bytes(self.direct, self.root), "direct": self.direct.summary()}

    def __repr__(self) -> str:
        return f"GatherBroadcastPlan({len(self.tensors)} tensors, root {self.root})"


def gather_broadcast_plan(plan: Plan, root: int | None = None) -> GatherBroadcastPlan:
    """``plan``'s tensors by gather-and-broadcast from ``root`` (default: the lowest source rank)."""
    return GatherBroadcastPlan(plan, root)


def gather_broadcast_bytes(plan: Plan, root: int | None = None) -> dict[str, int]:
    """Logical bytes the baseline moves: ``gather`` (to root), ``broadcast`` (root to each destination).

    The gather moves every element of a tensor that ``root`` does not hold already, in the dtype
    :func:`gather_layout` gives it: counted from the boxes ``root`` holds, once per set of source
    arrays that tables share, without planning the gather (the :func:`gather_plan`'s wire bytes; a
    tensor whose boxes on ``root`` overlap is planned, as the sum of boxes would count the overlap twice).
    """
    root = default_root(plan) if root is None else root
    source, destination = plan.source, plan.destination
    single = destination.single_itemsize
    held: dict[tuple, int | None] = {}  # source arrays (alive meanwhile) -> elements root holds (None: overlap)
    full = gathered = 0
    planned: list[str] = []
    for name in plan.tensors:
        st = source.tables[name]
        ids = (id(st.ranks), id(st.offsets), id(st.sizes))
        if ids not in held:
            held[ids] = _elements_held(st, root)
        local = held[ids]
        if local is None:
            planned.append(name)
            continue
        numel = destination.specs[name].numel
        isz = single if single is not None else _first_dtype(destination, name).itemsize
        full += numel * isz
        gathered += (numel - local) * isz
    if planned:
        gathered += Plan(source, gather_layout(plan, root, planned)).wire_bytes
        full += sum(destination.specs[n].numel * _first_dtype(destination, n).itemsize for n in planned)
    receivers = [r for r in destination.ranks if r != root]
    return {"gather": gathered, "broadcast": full * len(receivers)}


def _first_dtype(layout: Layout, name: str) -> torch.dtype:
    """The dtype of the buffer that the first piece of tensor ``name`` lives in (the dtype
    :func:`gather_layout` gives the tensor's full buffer)."""
    t = layout.tables[name]
    return layout.buffer_spec(int(t.ranks[0]), t.buffers[0])[1]


def _elements_held(table: PieceTable, rank: int) -> int | None:
    """Elements of the tensor that ``rank`` holds in ``table`` (replicas of a box once); None where
    two distinct boxes on it overlap.

    >>> t = PieceTable(np.array([0, 0, 1]), np.array([[0], [0], [4]]), np.array([[4], [4], [4]]), ("w",) * 3,
    ...                np.zeros((3, 1), np.int64))
    >>> _elements_held(t, 0), _elements_held(t, 1), _elements_held(t, 2)
    (4, 4, 0)
    """
    mine = table.ranks == rank
    if not mine.any():
        return 0
    boxes = np.unique(np.concatenate([table.offsets[mine], table.sizes[mine]], axis=1), axis=0)
    lo, size = np.split(boxes, 2, axis=1)
    hi = lo + size
    overlap = (lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :])  # [box, box, dim]
    if overlap.all(axis=2).sum() > len(boxes):  # a pair of distinct boxes overlaps (besides each with itself)
        return None
    return int(size.prod(axis=1).sum())


def gather_sends(plan: Plan, root: int | None = None) -> tuple[list[str], list[int], list[dict[int, int]]]:
    """Per tensor of ``plan``: (names, full bytes in the destination dtype, ``{source rank: bytes it
    sends to root}``), the input of :func:`~reshard.modeling.baseline_time.gather_broadcast_time`.

    Pieces with the same box on several ranks are replicas: a box root holds is not sent; any
    other box's bytes are split evenly over its holders (what the planner's balanced choice of
    replicas gives in aggregate, without planning whole models). Boxes are taken as equal or
    disjoint, which Shard/Replicate layouts give.
    """
    root = default_root(plan) if root is None else root
    return _sends(plan.source, plan.destination, plan.tensors, root)


class Stage(NamedTuple):
    """One pipeline stage of the source side, as the fair baseline gathers it: its ``root`` (lowest
    rank), its ``ranks``, and per tensor it holds: ``names``, full ``sizes`` (destination dtype) and
    ``sends`` (``{rank: bytes it sends to root}``, as :func:`gather_sends`)."""

    root: int
    ranks: tuple[int, ...]
    names: list[str]
    sizes: list[int]
    sends: list[dict[int, int]]


def stage_groups(source: Layout) -> list[tuple[int, ...]]:
    """Source ranks grouped into pipeline stages, sorted: ranks that hold pieces of one tensor are
    in one stage (connected components), so a Megatron pipeline stage (all its TP / EP / DP ranks
    hold parts of its layers) is one group, and an FSDP or pure TP layout is a single group.

    >>> import torch, reshard as rs
    >>> a, b = rs.TensorSpec("a", (4,), torch.float32), rs.TensorSpec("b", (4,), torch.float32)
    >>> src = rs.Layout.merge([rs.Layout.from_placements(a, [0, 1], (2,), [rs.Shard(0)]),    # stage 0
    ...                        rs.Layout.from_placements(b, [2, 3], (2,), [rs.Replicate()])])  # stage 1
    >>> stage_groups(src)
    [(0, 1), (2, 3)]
    """
    parent: dict[int, int] = {r: r for r in source.ranks}

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    seen: set[bytes] = set()
    arrays: dict[int, np.ndarray] = {}  # ranks arrays seen (tables alike share them; held, so ids stay unique)
    for t in source.tables.values():
        if not len(t) or id(t.ranks) in arrays:
            continue
        arrays[id(t.ranks)] = t.ranks
        ranks = np.unique(t.ranks)
        key = ranks.tobytes()
        if key in seen:
            continue
        seen.add(key)
        first = find(int(ranks[0]))
        for r in ranks[1:].tolist():
            other = find(r)
            if other != first:
                parent[max(other, first)] = min(other, first)
                first = min(other, first)
    groups: dict[int, list[int]] = defaultdict(list)
    for r in source.ranks:
        groups[find(r)].append(r)
    return sorted(tuple(sorted(g)) for g in groups.values())


def stage_sends(source: Layout, destination: Layout) -> list[Stage]:
    """Per pipeline stage (:func:`stage_groups`), what it gathers into its root: the input of
    :func:`~reshard.modeling.baseline_time.gather_broadcast_fair_time`. Tensors with no destination piece
    are left out; each of the others belongs to the one stage whose ranks hold it."""
    groups = stage_groups(source)
    root_of = {r: g[0] for g in groups for r in g}
    names = [n for n, t in destination.tables.items() if len(t) and len(source.tables.get(n, ()))]
    by_root: dict[int, list[str]] = defaultdict(list)
    for n in names:
        by_root[root_of[int(source.tables[n].ranks[0])]].append(n)
    out = []
    for g in groups:
        mine = by_root.get(g[0], [])
        if not mine:
            continue
        nm, sizes, sends = _sends(source, destination, mine, g[0])
        out.append(Stage(g[0], g, nm, sizes, sends))
    return out


def _sends(source: Layout, destination: Layout, tensors, root: int
           ) -> tuple[list[str], list[int], list[dict[int, int]]]:
    names, sizes, sends = [], [], []
    cache: dict[tuple, dict[int, int]] = {}
    keys: dict = {}  # geometry key of the arrays tables alike share
    boxes: dict = {}  # replicas of tables with the same boxes (on any ranks), worked out once
    single = destination.single_itemsize  # one dtype for every buffer: no look-up per tensor
    uniform, specs, tables = destination.uniform_dtype, destination.specs, source.tables
    for name in tensors:
        spec = specs[name]
        if single is not None:
            isz = single
        else:
            dtype = uniform(name)
            if dtype is not None:
                isz = dtype.itemsize
            else:
                found = destination.buffer_dtypes(name)
                isz = found.itemsize if found.itemsize is not None else int(found.itemsizes[0])
        t = tables[name]
        key = (t.geometry_key(keys), isz, root)
        got = cache.get(key)
        if got is None:
            got = {}
            if len(t):
                inv, holders = t.box_copies(boxes)
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


def buckets(tensor_bytes: Sequence[int], bucket_bytes: int | None) -> list[list[int]]:
    """Consecutive tensors grouped up to ``bucket_bytes`` (a bigger one is a bucket of its own;
    ``None``: every tensor alone), as a packed broadcast cuts them on both ends.

    >>> buckets([4, 4, 4, 10, 1], 8), buckets([4, 4], None)
    ([[0, 1], [2], [3], [4]], [[0], [1]])
    """
    out: list[list[int]] = []
    used = 0
    for i, n in enumerate(tensor_bytes):
        if out and bucket_bytes is not None and used + n <= bucket_bytes:
            out[-1].append(i)
            used += n
        else:
            out.append([i])
            used = n
    return out


__all__ = ["GatherBroadcastPlan", "Stage", "broadcast_members", "buckets", "default_root", "gather_broadcast_bytes",
           "gather_broadcast_plan", "gather_layout", "gather_plan", "gather_sends", "stage_groups", "stage_sends"]
