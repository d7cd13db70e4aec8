"""The planner: which source rank sends which box to which destination rank.

``plan(source, destination)`` is pure and deterministic: every rank computes the
same :class:`Plan` from the same layouts and can check so with
:meth:`Plan.fingerprint`. Tensors that share a geometry (same shape, same boxes on
the same ranks: every layer's ``q_proj``) are intersected once; the result is
stamped out for each of them, so planning cost grows with the number of distinct
geometries, not with the number of pieces.

Among source replicas, each remote copy goes to the candidate rank with the least
bytes to send so far (largest copies first); copies of many tensors sharing one
geometry are dealt round-robin over the replicas. Given ``domains`` (rank -> NVLink
domain), a replica in the destination's own domain is preferred and the balanced load
is each rank's traffic out of its domain (see :mod:`reshard.planning.hierarchy`).

Per-rank view (``plan.for_rank(r)``)::

    sends   [Message(peer, round, copies)]   packed and sent by r
    recvs   [Message(peer, round, copies)]   received and unpacked by r
    local   [Copy]   source buffer -> destination buffer on r, no wire
    fanout  [Copy]   destination buffer -> destination buffer on r, after all rounds

Every plan follows one protocol, :class:`PhasedPlan`: a list of phases, each a :class:`Plan`,
run in order (the first reads the source buffers, later ones the destination buffers the
earlier ones filled). A plan from :func:`plan` is one phase; a hierarchical plan
(:mod:`reshard.planning.hierarchy`) has two or three.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, Protocol

import numpy as np

from ..gc_pause import without_gc
from ..layout import Layout, Repeated
from ..tensors import LayoutError, dtype_class, is_int
from .intersect import FANOUT, LOCAL, REMOTE, TensorItems, tensor_items
from .schedule import ALIGN, ROUNDS_IN_FLIGHT, Copy, Message, check_max_bucket_bytes, chunk_stream, pair_quotas, round_cap

PLAN_FORMAT = 2  # 2: staging quotas in proportion to each stream's bytes


@dataclass(eq=False)
class _Group:
    """Tensors sharing one geometry (instances) and their copies (items).

    ``piece``/``rank`` give each item's source piece and rank (fan-out: the primary
    destination piece); remote items with several candidate replicas are chosen per
    instance, in ``choice_piece``/``choice_rank`` (columns ``choice_cols``).
    """

    items: TensorItems
    tensors: list[str]
    tensor_index: np.ndarray  # int64 [n_inst]: position in Plan.tensors
    piece: np.ndarray  # int64 [n_items]
    rank: np.ndarray  # int64 [n_items]
    dst_rank: np.ndarray  # int64 [n_items]
    nbytes: np.ndarray  # int64 [n_inst, n_items] (often a broadcast view)
    choice_cols: np.ndarray  # int64 [m]
    choice_piece: np.ndarray  # int64 [n_inst, m]
    choice_rank: np.ndarray  # int64 [n_inst, m]

    @cached_property
    def total_bytes(self) -> np.ndarray:
        """Bytes of each item summed over instances."""
        return self.nbytes.sum(axis=0)

    @cached_property
    def choice_of(self) -> np.ndarray:
        out = np.full(len(self.items), -1, np.int64)
        out[self.choice_cols] = np.arange(len(self.choice_cols))
        return out

    def source_of(self, i: int, k: int) -> tuple[int, int]:
        """(source piece, source rank) of item ``k`` of instance ``i``."""
        j = self.choice_of[k]
        if j < 0:
            return int(self.piece[k]), int(self.rank[k])
        return int(self.choice_piece[i, j]), int(self.choice_rank[i, j])


@dataclass
class RankPlan:
    """One rank's part of a plan."""

    rank: int
    sends: list[Message] = field(default_factory=list)
    recvs: list[Message] = field(default_factory=list)
    local: list[Copy] = field(default_factory=list)
    fanout: list[Copy] = field(default_factory=list)

    @property
    def num_rounds(self) -> int:
        return 1 + max((m.round for m in self.sends + self.recvs), default=-1)

    def round(self, j: int) -> tuple[list[Message], list[Message]]:
        """(sends, receives) of round ``j``."""
        return self._by_round.get(j, ([], []))

    @cached_property
    def _by_round(self) -> dict[int, tuple[list[Message], list[Message]]]:
        out: dict[int, tuple[list[Message], list[Message]]] = defaultdict(lambda: ([], []))
        for m in self.sends:
            out[m.round][0].append(m)
        for m in self.recvs:
            out[m.round][1].append(m)
        return dict(out)

    @property
    def send_bytes(self) -> int:
        return sum(m.payload_bytes for m in self.sends)

    @property
    def recv_bytes(self) -> int:
        return sum(m.payload_bytes for m in self.recvs)

    def peak_staging_bytes(self) -> int:
        """Largest staging (send + receive buffers, alignment included) of any round."""
        per_round: dict[int, int] = defaultdict(int)
        for m in self.sends + self.recvs:
            per_round[m.round] += m.nbytes
        return max(per_round.values(), default=0)


def check_pair(source: Layout, destination: Layout) -> None:
    """Raise :class:`LayoutError` unless ``source`` can fill ``destination``: both are layouts, every
    tensor the destination holds is in the source with the same shape and a dtype of the same class
    (a cast within a class is allowed), and none is 0-d (hold a scalar as a 1-element view,
    ``p.view(1)``, of shape ``(1,)`` on both sides)."""
    for side, lay in (("source", source), ("destination", destination)):
        if not isinstance(lay, Layout):
            raise LayoutError(f"plan: the {side} must be a Layout, got {type(lay).__name__}")
    for name, dspec in destination.specs.items():
        if not dspec.shape and len(destination.tables[name]):
            raise LayoutError(f"tensor {name!r}: 0-d (scalar) tensors cannot be planned; hold it as a 1-element "
                              f"view (t.view(1)) of shape (1,) on both sides")
        sspec = source.specs.get(name)
        if sspec is dspec or not len(destination.tables[name]):  # layouts built from one model's specs
            continue
        if sspec is None:
            r = int(destination.tables[name].ranks[0])
            raise LayoutError(f"unknown tensor {name!r}: destination rank {r} needs it but the source layout "
                              f"has no tensor of that name")
        if sspec.shape != dspec.shape:
            raise LayoutError(f"tensor {name!r}: source shape {sspec.shape} != destination shape {dspec.shape}")
        if dtype_class(sspec.dtype) != dtype_class(dspec.dtype):
            raise LayoutError(f"tensor {name!r}: source dtype {sspec.dtype} and destination dtype {dspec.dtype} "
                              f"are of different classes")


def domain_array(domains: Mapping[int, int], ranks) -> np.ndarray:
    """``{rank: domain}`` as an array indexed by rank (-1 where unknown); each of ``ranks`` needs one."""
    if not isinstance(domains, Mapping):
        raise ValueError(f"domains must be a mapping {{rank: domain}}, got {type(domains).__name__}")
    for r, d in domains.items():
        if not (is_int(r) and r >= 0 and is_int(d) and d >= 0):
            raise ValueError(f"domains: rank {r!r} -> domain {d!r}; ranks and domains are integers >= 0")
    missing = [r for r in sorted(ranks) if r not in domains]
    if missing:
        raise ValueError(f"domains: rank {missing[0]} has no domain ({len(missing)} ranks without one)")
    out = np.full(max(max(ranks, default=0), max(domains, default=0)) + 1, -1, np.int64)
    for r, d in domains.items():
        out[int(r)] = int(d)
    return out


def _items_key(st, dt) -> bytes:
    """What :func:`~reshard.planning.intersect.tensor_items` depends on: the boxes of both sides, the
    destination ranks, which source pieces share a rank, and where source ranks are also
    destination ranks; not the source rank numbers themselves (expert-parallel groups of
    every pipeline stage plan alike)."""
    _, src_rank_ids = np.unique(st.ranks, return_inverse=True)
    dst_ranks = np.unique(dt.ranks)
    at = np.searchsorted(dst_ranks, st.ranks)
    at = np.minimum(at, max(len(dst_ranks) - 1, 0))
    local = np.where((dst_ranks[at] == st.ranks) if len(dst_ranks) else np.zeros(len(st.ranks), bool), at, -1)
    return b"|".join([np.array(st.offsets.shape, np.int64).tobytes(), st.offsets.tobytes(), st.sizes.tobytes(),
                      src_rank_ids.astype(np.int64).tobytes(), local.astype(np.int64).tobytes(), dt.geometry_key()])


def _row_tuples(a: np.ndarray) -> list[tuple[int, ...]]:
    """Rows of a 2-D int array as tuples (column-wise ``tolist`` + ``zip``: the fast way)."""
    if a.shape[1] == 0:
        return [()] * len(a)
    return list(zip(*a.T.tolist()))


class PhasedPlan(Protocol):
    """What every plan offers to executors, the cost model and reports.

    >>> import torch, reshard as rs
    >>> spec = rs.TensorSpec("w", (4, 6), torch.float32)
    >>> src = rs.Layout.from_placements(spec, ranks=[0, 1], mesh_shape=(2,), placements=[rs.Shard(0)])
    >>> dst = rs.Layout.from_placements(spec, ranks=[2, 3], mesh_shape=(2,), placements=[rs.Replicate()])
    >>> p = rs.plan(src, dst)
    >>> p.phase_names, p.phases == [p], p.wire_bytes
    (['transfer'], True, 192)
    """

    source: Layout  # the layout the first phase reads
    destination: Layout  # every destination piece the refit fills
    max_bucket_bytes: int | None  # the most staging bytes a rank holds at once (None: no cap, one round)

    @property
    def phases(self) -> list["Plan"]: ...  # run in order; the first reads the source buffers

    @property
    def phase_names(self) -> list[str]: ...

    @property
    def wire_bytes(self) -> int: ...  # bytes copied between distinct ranks, all phases

    def fingerprint(self) -> str: ...  # equal on every rank that planned the same refit

    def summary(self) -> dict: ...


class Plan:
    """All copies of a refit from ``source`` to ``destination`` (see module doc); one phase."""

    @without_gc
    def __init__(self, source: Layout, destination: Layout, *, max_bucket_bytes: int | None = None,
                 domains: Mapping[int, int] | None = None) -> None:
        max_bucket_bytes = check_max_bucket_bytes(max_bucket_bytes)
        check_pair(source, destination)
        self.source = source
        self.destination = destination
        self.max_bucket_bytes = max_bucket_bytes
        self.round_bytes = round_cap(max_bucket_bytes)  # each round's share: two rounds are in flight
        self.domains = None if domains is None else domain_array(domains, set(source.ranks) | set(destination.ranks))
        self._fingerprint: str | None = None
        self._stacked_cache: dict[int, tuple] = {}
        self.tensors = [n for n, t in destination.tables.items() if len(t)]
        keyed: dict[tuple, list[str]] = {}
        interned: dict[bytes, int] = {}
        by_identity: dict[tuple, tuple] = {}  # tables built from the same arrays (shared by the builders)
        specs, src_tables, dst_tables = destination.specs, source.tables, destination.tables
        for name in self.tensors:
            st, dt = src_tables[name], dst_tables[name]
            ident = (specs[name].shape, id(st.ranks), id(st.offsets), id(st.sizes),
                     id(dt.ranks), id(dt.offsets), id(dt.sizes))
            key = by_identity.get(ident)
            if key is None:  # every table stays alive (and unchanged) while planning: ids are unique
                key = by_identity[ident] = (ident[0], interned.setdefault(st.geometry_key(), len(interned)),
                                            interned.setdefault(dt.geometry_key(), len(interned)))
            keyed.setdefault(key, []).append(name)
        position = {n: i for i, n in enumerate(self.tensors)}
        self._groups: list[_Group] = []
        same_boxes: dict[bytes, TensorItems] = {}
        for names in keyed.values():
            first = names[0]
            st, dt = source.tables[first], destination.tables[first]
            key = _items_key(st, dt)  # geometries that differ only in which ranks hold the source
            items = same_boxes.get(key)
            if items is None:
                items = same_boxes[key] = tensor_items(first, st, dt)
            volume = items.sizes.prod(axis=1) if len(items) else np.zeros(0, np.int64)
            if destination.single_dtype is not None:  # the common case: one itemsize everywhere
                isz = np.full((1, len(dt)), destination.single_dtype.itemsize, np.int64)
            else:
                uniform = [destination.uniform_itemsize(n) for n in names]
                if None not in uniform:  # each tensor's pieces share one buffer dtype
                    col = np.array(uniform, np.int64)[:, None]
                    if (col == col[0]).all():
                        col = col[:1]
                    isz = np.broadcast_to(col, (len(col), len(dt)))
                else:
                    sizes = [destination.itemsizes(n) for n in names]
                    same = all(np.array_equal(sizes[0], x) for x in sizes[1:])
                    isz = sizes[0][None, :] if same else np.stack(sizes)
            isz = isz[:, items.dst_piece]
            n_inst = len(names)
            # a remote copy with one candidate needs no choice
            piece = np.where(items.kind == REMOTE, -1, items.source)
            single = (items.kind == REMOTE) & (items.cand_count == 1)
            piece[single] = items.candidates[items.cand_start[single]]
            rank = dt.ranks[items.dst_piece].copy()  # fan-out: the destination rank itself
            from_source = items.kind != FANOUT
            rank[from_source] = st.ranks[piece[from_source]]
            multi = np.flatnonzero((items.kind == REMOTE) & (items.cand_count > 1))
            self._groups.append(_Group(
                items, names, np.array([position[n] for n in names], np.int64), piece, rank,
                dt.ranks[items.dst_piece], np.broadcast_to(isz * volume[None, :], (n_inst, len(items))),
                multi, np.zeros((n_inst, len(multi)), np.int64), np.zeros((n_inst, len(multi)), np.int64),
            ))
        self._choose_sources()
        if max_bucket_bytes is not None:
            need = self.min_bucket_bytes
            if max_bucket_bytes < need:
                busiest = max(self._streams, key=lambda r: (self._streams[r], -r))
                raise ValueError(
                    f"max_bucket_bytes={max_bucket_bytes} is too small for this plan: rank {busiest} exchanges "
                    f"{self._streams[busiest]} messages per round, which needs at least {need} bytes (two rounds in "
                    f"flight)"
                )

    # ------------------------------------------------------------------ source choice
    def _choose_sources(self) -> None:
        """Replicas: largest copies first, each to its least-loaded candidate (ties: lowest rank);
        the instances of a geometry are dealt round-robin over the candidates in that order.

        With ``domains``, candidates in the destination's own domain come first (those bytes
        never leave it), and the load balanced among the others is what each rank sends out
        of its domain (its NIC egress).
        """
        dom = self.domains
        fixed_load = np.zeros(max(self.source.ranks, default=0) + 1, np.int64)
        work = []
        for gi, g in enumerate(self._groups):
            fixed = np.flatnonzero((g.items.kind == REMOTE) & (g.choice_of < 0))
            if dom is not None:
                fixed = fixed[dom[g.rank[fixed]] != dom[g.dst_rank[fixed]]]
            fixed_load += np.bincount(g.rank[fixed], weights=g.total_bytes[fixed],
                                      minlength=len(fixed_load)).astype(np.int64)
            work.extend(zip((-g.total_bytes[g.choice_cols]).tolist(), itertools.repeat(gi), range(len(g.choice_cols))))
        work.sort()
        load = fixed_load.tolist()  # plain ints: this loop does a few list operations per copy
        near_load = [0] * len(load)  # bytes sent within the destination's domain
        dom_list = dom.tolist() if dom is not None else None
        cand_ranks: dict[int, list[list[int]]] = {}
        homes: dict[int, list[int]] = {}
        orders: dict[int, list[list[int]]] = {}
        i = 0
        while i < len(work):
            negb, gi, j = work[i]
            g = self._groups[gi]
            ranks = cand_ranks.get(gi)
            if ranks is None:
                ranks = cand_ranks[gi] = self._candidate_ranks(g)
                if dom_list is not None:
                    homes[gi] = dom[g.dst_rank[g.choice_cols]].tolist()
                orders[gi] = [[]] * len(g.choice_cols)
            cr = ranks[j]
            pool, use = range(len(cr)), load
            if dom_list is not None:
                near = [x for x in pool if dom_list[cr[x]] == homes[gi][j]]
                if near:
                    pool, use = near, near_load
            n = len(g.tensors)
            run = i + 1  # the next columns of this group with the same candidates and bytes
            while (run < len(work) and work[run][0] == negb and work[run][1] == gi and ranks[work[run][2]] == cr
                   and (dom_list is None or homes[gi][work[run][2]] == homes[gi][j])):
                run += 1
            column = g.nbytes[:, g.choice_cols[j]]
            if len(pool) > n and (column.strides[0] == 0 or n == 1):
                # more replicas than tensors, one size: per column the n least loaded take one instance each
                w = int(column[0])
                heap = [(use[cr[x]], cr[x], x) for x in pool]
                heapq.heapify(heap)
                for _, _, jj in work[i:run]:
                    picked = [heapq.heappop(heap) for _ in range(n)]
                    orders[gi][jj] = [x for _, _, x in picked]
                    for lo, r, x in picked:
                        heapq.heappush(heap, (lo + w, r, x))
                for lo, r, _ in heap:
                    use[r] = lo
                i = run
                continue
            if len(pool) == 2:  # the common case (two replicas), without a sort
                a, b = pool
                order = [a, b] if (use[cr[a]], cr[a]) <= (use[cr[b]], cr[b]) else [b, a]
            else:
                order = sorted(pool, key=lambda x: (use[cr[x]], cr[x]))[:n]
            dealt = self._dealt_bytes(g, j, len(order))
            if not (len(order) == len(pool) and dealt.count(dealt[0]) == len(dealt)):
                run = i + 1  # uneven gains change the order: one column at a time
            # dealt evenly, every candidate gains alike, so the order stays for the whole run
            for x, nbytes in zip(order, dealt):
                use[cr[x]] += nbytes * (run - i)
            for _, _, jj in work[i:run]:
                orders[gi][jj] = order
            i = run
        for gi, g in enumerate(self._groups):
            if len(g.choice_cols):
                self._fill_choices(g, orders[gi])

    def _candidate_ranks(self, g: _Group) -> list[list[int]]:
        it = g.items
        ranks = self.source.tables[g.tensors[0]].ranks[it.candidates].tolist()
        starts, counts = it.cand_start[g.choice_cols].tolist(), it.cand_count[g.choice_cols].tolist()
        return [ranks[a: a + c] for a, c in zip(starts, counts)]

    @staticmethod
    def _dealt_bytes(g: _Group, j: int, m: int) -> list[int]:
        """Bytes each of ``m`` candidates gets when the instances of choice column ``j`` are
        dealt round-robin (instance i to the ``i % m``-th candidate in order)."""
        n = len(g.tensors)
        k = int(g.choice_cols[j])
        column = g.nbytes[:, k]
        if column.strides[0] == 0 or n == 1:  # one size for every instance
            q, rem = divmod(n, m)
            w = int(column[0])
            return [(q + (p < rem)) * w for p in range(m)]
        return np.bincount(np.arange(n) % m, weights=column, minlength=m).astype(np.int64).tolist()

    def _fill_choices(self, g: _Group, orders: list[list[int]]) -> None:
        it = g.items
        n = len(g.tensors)
        starts = it.cand_start[g.choice_cols]
        counts = np.array([len(o) for o in orders], np.int64)  # candidates dealt to (all, or the near ones)
        for m in np.unique(counts).tolist():  # columns dealt over m candidates, all at once
            cols = np.flatnonzero(counts == m)
            order = np.array([orders[c] for c in cols.tolist()], np.int64).reshape(len(cols), m)
            slot = order[:, np.arange(n) % m]  # [cols, instances]
            pieces = it.candidates[starts[cols][:, None] + slot]
            g.choice_piece[:, cols] = pieces.T
        g.choice_rank[:] = self.source.tables[g.tensors[0]].ranks[g.choice_piece]

    # ------------------------------------------------------------------ figures
    def _rows(self, kind: int):
        """(source ranks, destination ranks, bytes) of all items of one kind, in array chunks."""
        for g in self._groups:
            fixed = np.flatnonzero((g.items.kind == kind) & (g.choice_of < 0))
            yield g.rank[fixed], g.dst_rank[fixed], g.total_bytes[fixed]
            if kind == REMOTE and len(g.choice_cols):
                cols = g.choice_cols
                yield (g.choice_rank.ravel(), np.broadcast_to(g.dst_rank[cols], g.choice_rank.shape).ravel(),
                       g.nbytes[:, cols].ravel())

    @cached_property
    def pair_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes sent from rank s to rank d, ``{(s, d): bytes}``, distinct ranks only."""
        rows = list(self._rows(REMOTE))
        if not rows:
            return {}
        s = np.concatenate([r[0] for r in rows])
        d = np.concatenate([r[1] for r in rows])
        b = np.concatenate([r[2] for r in rows])
        if not len(s):
            return {}
        width = int(max(s.max(), d.max())) + 1
        sums = np.bincount(s * width + d, weights=b, minlength=width * width)
        keys = np.flatnonzero(sums)
        return {(int(k) // width, int(k) % width): int(v) for k, v in zip(keys.tolist(), sums[keys].tolist())}

    @cached_property
    def wire_bytes(self) -> int:
        """Bytes copied between distinct ranks (in destination dtypes)."""
        return sum(self.pair_bytes.values())

    def tensor_wire_bytes(self) -> dict[str, int]:
        """Bytes of each tensor that cross between ranks, ``{name: bytes}``."""
        out = {}
        for g in self._groups:
            remote = np.flatnonzero(g.items.kind == REMOTE)
            per_instance = g.nbytes[:, remote].sum(axis=1)
            out.update(zip(g.tensors, per_instance.tolist()))
        return out

    @cached_property
    def local_bytes(self) -> int:
        """Bytes copied within a rank (local source replicas and fan-out)."""
        return sum(int(b.sum()) for kind in (LOCAL, FANOUT) for _, _, b in self._rows(kind))

    @cached_property
    def send_bytes(self) -> dict[int, int]:
        """Bytes each rank sends over the wire (source ranks with nothing to send show 0)."""
        out = {r: 0 for r in self.source.ranks}
        for (s, _), b in self.pair_bytes.items():
            out[s] += b
        return out

    @cached_property
    def recv_bytes(self) -> dict[int, int]:
        """Bytes each destination rank receives over the wire."""
        out = {r: 0 for r in self.destination.ranks}
        for (_, d), b in self.pair_bytes.items():
            out[d] = out.get(d, 0) + b
        return out

    @property
    def send_balance(self) -> float:
        """max / mean of bytes sent over the source ranks (1.0 is perfect)."""
        vals = list(self.send_bytes.values())
        mean = sum(vals) / len(vals) if vals else 0
        return max(vals) / mean if mean else 1.0

    @cached_property
    def _streams(self) -> dict[int, int]:
        """Per rank, how many streams it stages each round: peers it sends to plus peers it receives from."""
        streams: dict[int, int] = defaultdict(int)
        for s, d in self.pair_bytes:
            streams[s] += 1
            streams[d] += 1
        return dict(streams)

    @cached_property
    def quotas(self) -> dict[tuple[int, int], int | None]:
        """Per-round staging quota of every (source, destination) stream (:func:`~reshard.planning.schedule.pair_quotas`),
        from its payload plus at most ``ALIGN - 1`` bytes of padding per copy; ``None`` without a cap."""
        copies = self._pair_copies
        return pair_quotas({p: b + (ALIGN - 1) * copies[p] for p, b in self.pair_bytes.items()}, self.round_bytes)

    @cached_property
    def _pair_copies(self) -> dict[tuple[int, int], int]:
        """Copies from rank s to rank d (before any split into rounds), ``{(s, d): count}``."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for g in self._groups:
            n = len(g.tensors)
            fixed = np.flatnonzero((g.items.kind == REMOTE) & (g.choice_of < 0))
            for key in zip(g.rank[fixed].tolist(), g.dst_rank[fixed].tolist()):
                out[key] += n
            if len(g.choice_cols):
                width = int(max(g.choice_rank.max(), g.dst_rank.max())) + 1
                codes = g.choice_rank * width + g.dst_rank[g.choice_cols][None, :]
                keys, counts = np.unique(codes, return_counts=True)
                for k, c in zip(keys.tolist(), counts.tolist()):
                    out[(k // width, k % width)] += c
        return dict(out)

    @property
    def min_bucket_bytes(self) -> int:
        """Smallest ``max_bucket_bytes`` this plan's layouts allow (one aligned element per stream, in
        each of the rounds in flight)."""
        if not self._streams:  # nothing crosses between ranks: any valid cap
            return ALIGN
        return ROUNDS_IN_FLIGHT * ALIGN * max(self._streams.values())

    @cached_property
    def _all_rank_plans(self) -> dict[int, RankPlan]:
        ranks = sorted(set(self.source.ranks) | set(self.destination.ranks))
        return {r: self.for_rank(r) for r in ranks}

    @property
    def num_messages(self) -> int:
        """Point-to-point messages over all rounds (builds every rank's part once)."""
        return sum(len(p.sends) for p in self._all_rank_plans.values())

    @property
    def num_rounds(self) -> int:
        return max((p.num_rounds for p in self._all_rank_plans.values()), default=0)

    @property
    def num_pieces(self) -> int:
        return sum(len(self.source.tables[n]) + len(self.destination.tables[n]) for n in self.tensors)

    def summary(self) -> dict:
        return {
            "tensors": len(self.tensors), "geometries": len(self._groups), "pieces": self.num_pieces,
            "wire_bytes": self.wire_bytes, "local_bytes": self.local_bytes, "messages": self.num_messages,
            "rounds": self.num_rounds, "max_send_bytes": max(self.send_bytes.values(), default=0),
            "max_recv_bytes": max(self.recv_bytes.values(), default=0), "send_balance": self.send_balance,
        }

    @property
    def phases(self) -> list["Plan"]:
        """``[self]``: a direct plan is one phase (:class:`PhasedPlan`)."""
        return [self]

    @property
    def phase_names(self) -> list[str]:
        return ["transfer"]

    @property
    def num_geometries(self) -> int:
        """Distinct tensor geometries (tensors that plan alike are intersected once)."""
        return len(self._groups)

    def __repr__(self) -> str:
        return (f"Plan({len(self.tensors)} tensors, {len(self._groups)} geometries, wire_bytes={self.wire_bytes}, "
                f"max_bucket_bytes={self.max_bucket_bytes})")

    # ------------------------------------------------------------------ identity
    def fingerprint(self) -> str:
        """Short hash of everything that decides the copies; equal on ranks that agree."""
        if self._fingerprint is None:
            self._fingerprint = self._hash()
        return self._fingerprint

    def _hash(self) -> str:
        h = hashlib.sha256(f"reshard-plan-{PLAN_FORMAT}-{self.round_bytes}".encode())
        if self.domains is not None:
            h.update(b"domains" + self.domains.tobytes())
        for g in self._groups:
            it = g.items
            for a in (it.kind, it.dst_piece, it.offsets, it.sizes, g.piece, g.rank, g.dst_rank, g.nbytes,
                      g.choice_cols, g.choice_piece, g.choice_rank):
                h.update(np.ascontiguousarray(a).tobytes())
            for name in g.tensors:
                h.update(name.encode() + b"\0")
                for lay in (self.source, self.destination):
                    t = lay.tables[name]
                    h.update("\0".join(t.buffers).encode())
                    h.update(t.buffer_offsets.tobytes())
        for lay in (self.source, self.destination):
            for r in lay.ranks:
                h.update(repr(sorted(lay.buffers(r).items())).encode())
        return h.hexdigest()[:16]

    # ------------------------------------------------------------------ one rank
    @without_gc
    def for_rank(self, rank: int) -> RankPlan:
        """``rank``'s sends, receives, local and fan-out copies; other ranks' copies are not built."""
        rank = int(rank)
        out = RankPlan(rank)
        all_copies: list[Copy] = []  # remote copies of every group, then sorted into streams
        keys: list[tuple[np.ndarray, ...]] = []
        for g in self._groups:
            cols = np.flatnonzero((g.choice_of < 0) & ((g.rank == rank) | (g.dst_rank == rank)))
            inst = np.repeat(np.arange(len(g.tensors)), len(cols))
            item = np.tile(cols, len(g.tensors))
            piece, src_rank = g.piece[item], g.rank[item]
            if len(g.choice_cols):
                ci, cj = np.nonzero((g.choice_rank == rank) | (g.dst_rank[g.choice_cols][None, :] == rank))
                inst = np.concatenate([inst, ci])
                item = np.concatenate([item, g.choice_cols[cj]])
                piece = np.concatenate([piece, g.choice_piece[ci, cj]])
                src_rank = np.concatenate([src_rank, g.choice_rank[ci, cj]])
            if not len(inst):
                continue
            copies = self._group_copies(g, inst, item, piece)
            kind = g.items.kind[item]
            for k in (LOCAL, FANOUT):
                rows = np.flatnonzero(kind == k)
                if len(rows):
                    (out.local if k == LOCAL else out.fanout).extend(copies[r] for r in rows.tolist())
            remote = np.flatnonzero(kind == REMOTE)
            if not len(remote):
                continue
            all_copies.extend(copies[r] for r in remote.tolist())
            keys.append((src_rank[remote], g.dst_rank[item[remote]], g.tensor_index[inst[remote]], item[remote]))
        if keys:  # one stream per (source, destination) pair, copies ordered by (tensor, item)
            s_, d_, t_, k_ = (np.concatenate(x) for x in zip(*keys))
            order = np.lexsort((k_, t_, d_, s_))
            s_, d_ = s_[order], d_[order]
            cut = np.flatnonzero((s_[1:] != s_[:-1]) | (d_[1:] != d_[:-1])) + 1
            bounds = [0, *cut.tolist(), len(order)]
            order = order.tolist()
            quotas = self.quotas if self.max_bucket_bytes is not None else {}  # no cap: one round
            for a, b in zip(bounds[:-1], bounds[1:]):
                s, d = int(s_[a]), int(d_[a])
                quota = quotas.get((s, d))
                for j, chunk in enumerate(chunk_stream([all_copies[x] for x in order[a:b]], quota)):
                    (out.sends if s == rank else out.recvs).append(Message(d if s == rank else s, j, chunk))
        out.sends.sort(key=lambda m: (m.round, m.peer))
        out.recvs.sort(key=lambda m: (m.round, m.peer))
        return out

    def _group_copies(self, g: _Group, inst: np.ndarray, items: np.ndarray, pieces: np.ndarray) -> list[Copy]:
        """Copy records of rows (instance, item, source piece) of one group (for fan-out items the
        source piece is a destination piece), with array operations across the group's tensors."""
        cls_of, slot, stacks, src_names, dst_names, dtypes = self._stacked(g)
        it = g.items
        name0 = g.tensors[0]
        st, dt = self.source.tables[name0], self.destination.tables[name0]  # same boxes in every instance
        off, dp = it.offsets[items], it.dst_piece[items]
        d = off.shape[1]
        fan = it.kind[items] == FANOUT
        src_off: list = [None] * len(items)
        dst_off: list = [None] * len(items)
        for c, (src_bo, dst_bo) in enumerate(stacks):
            rows = np.flatnonzero(cls_of[inst] == c) if len(stacks) > 1 else np.arange(len(items))
            for stack, side, boxes, sel, out in ((src_bo, 0, st.offsets, ~fan[rows], src_off),
                                                 (dst_bo, 1, dt.offsets, fan[rows], src_off),
                                                 (dst_bo, 1, dt.offsets, None, dst_off)):
                r = rows if sel is None else rows[sel]
                if not len(r):
                    continue
                p = dp[r] if sel is None else pieces[r]
                bo = stack[slot[inst[r], side], p]
                bo[:, bo.shape[1] - d:] += off[r] - boxes[p]
                if len(r) == len(items):
                    out[:] = _row_tuples(bo)
                else:
                    for k, v in zip(r.tolist(), _row_tuples(bo)):
                        out[k] = v
        names = g.tensors
        return [
            Copy(names[i], o, z, (dst_names[i][sp] if f else src_names[i][sp]), so, dst_names[i][q], do, dtypes[i][q])
            for i, o, z, sp, f, so, q, do in zip(inst.tolist(), _row_tuples(off), _row_tuples(it.sizes[items]),
                                                 pieces.tolist(), fan.tolist(), src_off, dp.tolist(), dst_off)
        ]

    def _stacked(self, g: _Group):
        """Per group, cached: its tensors sorted into classes by their buffers' numbers of dims, each
        class with its pieces' buffer offsets stacked ``[arrays, pieces, dims]`` (source, destination;
        tensors sharing an offsets array share a slot); each tensor's class and slots in it; and every
        tensor's buffer names and piece dtypes."""
        hit = self._stacked_cache.get(id(g))
        if hit is None:
            src = [self.source.tables[n] for n in g.tensors]
            dst = [self.destination.tables[n] for n in g.tensors]
            classes: dict[tuple[int, int], list[int]] = defaultdict(list)
            for i, (a, b) in enumerate(zip(src, dst)):
                classes[(a.buffer_offsets.shape[1], b.buffer_offsets.shape[1])].append(i)
            cls_of = np.zeros(len(g.tensors), np.int64)
            slot = np.zeros((len(g.tensors), 2), np.int64)
            stacks = []
            for c, members in enumerate(classes.values()):
                cls_of[members] = c
                pair = []
                for side, tables in enumerate((src, dst)):
                    arrays: dict[int, int] = {}
                    unique = []
                    for i in members:
                        a = tables[i].buffer_offsets
                        k = arrays.get(id(a))
                        if k is None:
                            k = arrays[id(a)] = len(unique)
                            unique.append(a)
                        slot[i, side] = k
                    pair.append(np.stack(unique))
                stacks.append(tuple(pair))
            dtypes = []
            for name, t in zip(g.tensors, dst):
                dt = self.destination.uniform_dtype(name)
                dtypes.append(Repeated(dt, len(t)) if dt is not None else self.destination.piece_dtypes(name))
            hit = self._stacked_cache[id(g)] = (
                cls_of, slot, stacks, [t.buffers for t in src], [t.buffers for t in dst], dtypes)
        return hit


def plan(source: Layout, destination: Layout, *, max_bucket_bytes: int | None = None,
         domains: Mapping[int, int] | None = None) -> Plan:
    """Plan the refit of every tensor ``destination`` holds from ``source``.

    >>> import torch, reshard as rs
    >>> spec = rs.TensorSpec("w", (4, 6), torch.float32)
    >>> src = rs.Layout.from_placements(spec, ranks=[0, 1], mesh_shape=(2,), placements=[rs.Shard(0)])
    >>> dst = rs.Layout.from_placements(spec, ranks=[2, 3, 4], mesh_shape=(3,), placements=[rs.Shard(1)])
    >>> rs.plan(src, dst).wire_bytes  # every element once: 4 * 6 * 4 bytes
    96
    """
    return Plan(source, destination, max_bucket_bytes=max_bucket_bytes, domains=domains)
