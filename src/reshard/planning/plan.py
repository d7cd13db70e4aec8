"""The planner: which source rank sends which box to which destination rank.

``plan(source, destination)`` is pure and deterministic: every rank computes the
same :class:`Plan` from the same layouts and can check so with
:meth:`Plan.fingerprint`. :class:`Plan` coordinates the steps, each in its module:

- tensors that share a geometry (same shape, same boxes on the same ranks: every
  layer's ``q_proj``) are intersected once and stamped out for each of them
  (:mod:`reshard.planning.geometry_groups`), so planning cost grows with the number
  of distinct geometries, not with the number of pieces;
- among source replicas, each remote copy goes to the candidate rank with the least
  bytes to send so far (largest copies first); copies of many tensors sharing one
  geometry are dealt round-robin over the replicas. Given ``domains`` (rank -> NVLink
  domain), a replica in the destination's own domain is preferred and the balanced load
  is each rank's traffic out of its domain (:mod:`reshard.planning.sources`, and see
  :mod:`reshard.planning.hierarchy`);
- the plan's figures (bytes per pair and rank, per-round quotas) and its fingerprint
  are here;
- the per-rank view, ``plan.for_rank(r)``, builds only rank ``r``'s part
  (:mod:`reshard.planning.rank_plan`)::

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
from collections import defaultdict
from functools import cached_property
from typing import Iterator, Mapping, Protocol

import numpy as np

from ..gc_pause import without_gc
from ..layout import Layout, Repeated
from ..tensors import LayoutError, dtype_class, is_int
from .geometry_groups import GeometryGroup, fixed_items, group_tensors
from .intersect import FANOUT, LOCAL, REMOTE
from .rank_plan import RankPlan, RankPlanBuilder
from .schedule import ALIGN, ROUNDS_IN_FLIGHT, Copy, check_max_bucket_bytes, pair_quotas, round_cap
from .sources import choose_sources

PLAN_FORMAT = 4  # 2: staging quotas in proportion to each stream's bytes; 3: arrays hashed by digest;
# 4: each rank's buffers as a sum of a digest per buffer (RankBuffers.digest)


def check_pair(source: Layout, destination: Layout) -> None:
    """Raise :class:`LayoutError` unless ``source`` can fill ``destination``: both are layouts, every
    tensor the destination holds is in the source with the same shape and a dtype of the same class
    (a cast within a class is allowed), and none is 0-d (hold a scalar as a 1-element view,
    ``p.view(1)``, of shape ``(1,)`` on both sides)."""
    for side, layout in (("source", source), ("destination", destination)):
        if not isinstance(layout, Layout):
            raise LayoutError(f"plan: the {side} must be a Layout, got {type(layout).__name__}")
    for name, dspec in destination.specs.items():
        if not dspec.shape and len(destination.tables[name]):
            raise LayoutError(f"tensor {name!r}: 0-d (scalar) tensors cannot be planned; hold it as a 1-element "
                              f"view (t.view(1)) of shape (1,) on both sides")
        sspec = source.specs.get(name)
        if sspec is dspec or not len(destination.tables[name]):  # layouts built from one model's specs
            continue
        if sspec is None:
            needing = int(destination.tables[name].ranks[0])
            raise LayoutError(f"unknown tensor {name!r}: destination rank {needing} needs it but the source layout "
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
    for rank, domain in domains.items():
        if not (is_int(rank) and rank >= 0 and is_int(domain) and domain >= 0):
            raise ValueError(f"domains: rank {rank!r} -> domain {domain!r}; ranks and domains are integers >= 0")
    missing = [rank for rank in sorted(ranks) if rank not in domains]
    if missing:
        raise ValueError(f"domains: rank {missing[0]} has no domain ({len(missing)} ranks without one)")
    out = np.full(max(max(ranks, default=0), max(domains, default=0)) + 1, -1, np.int64)
    for rank, domain in domains.items():
        out[int(rank)] = int(domain)
    return out


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

    def source_reads(self, rank: int) -> list[Copy]: ...  # the copies of rank's that read its source buffers

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
        self.tensors = [name for name, table in destination.tables.items() if len(table)]
        self._groups: list[GeometryGroup] = group_tensors(source, destination, self.tensors)
        choose_sources(self._groups, source, self.domains)
        self._rank_plans = RankPlanBuilder(source, destination, self._groups)
        if max_bucket_bytes is not None:
            self._check_bucket(max_bucket_bytes)

    def _check_bucket(self, max_bucket_bytes: int) -> None:
        need = self.min_bucket_bytes
        if max_bucket_bytes < need:
            busiest = max(self._streams, key=lambda rank: (self._streams[rank], -rank))
            raise ValueError(
                f"max_bucket_bytes={max_bucket_bytes} is too small for this plan: rank {busiest} exchanges "
                f"{self._streams[busiest]} messages per round, which needs at least {need} bytes (two rounds in "
                f"flight)"
            )

    # ------------------------------------------------------------------ figures
    def _rows(self, kind: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(source ranks, destination ranks, bytes) of all items of one kind, in array chunks."""
        fixed_of: dict = {}  # per intersection
        for group in self._groups:
            fixed = fixed_items(group, kind, fixed_of)
            if len(fixed):
                yield group.rank[fixed], group.dst_rank[fixed], group.total_bytes[fixed]
            if kind == REMOTE and len(group.choice_cols):
                cols = group.choice_cols
                dst_ranks = np.broadcast_to(group.dst_rank[cols], group.choice_rank.shape)
                yield group.choice_rank.ravel(), dst_ranks.ravel(), group.nbytes[:, cols].ravel()

    @cached_property
    def pair_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes sent from rank s to rank d, ``{(s, d): bytes}``, distinct ranks only."""
        rows = list(self._rows(REMOTE))
        if not rows:
            return {}
        src = np.concatenate([row[0] for row in rows])
        dst = np.concatenate([row[1] for row in rows])
        nbytes = np.concatenate([row[2] for row in rows])
        if not len(src):
            return {}
        width = int(max(src.max(), dst.max())) + 1
        sums = np.bincount(src * width + dst, weights=nbytes, minlength=width * width)
        keys = np.flatnonzero(sums)  # exact: whole bytes, far below 2**53
        pairs = zip((keys // width).tolist(), (keys % width).tolist())
        return dict(zip(pairs, sums[keys].astype(np.int64).tolist()))

    @cached_property
    def wire_bytes(self) -> int:
        """Bytes copied between distinct ranks (in destination dtypes)."""
        return sum(self.pair_bytes.values())

    def tensor_wire_bytes(self) -> dict[str, int]:
        """Bytes of each tensor that cross between ranks, ``{name: bytes}``."""
        out = {}
        for group in self._groups:
            remote = np.flatnonzero(group.items.kind == REMOTE)
            per_instance = group.nbytes[:, remote].sum(axis=1)
            out.update(zip(group.tensors, per_instance.tolist()))
        return out

    @cached_property
    def local_bytes(self) -> int:
        """Bytes copied within a rank (local source replicas and fan-out)."""
        return sum(int(nbytes.sum()) for kind in (LOCAL, FANOUT) for _, _, nbytes in self._rows(kind))

    @cached_property
    def send_bytes(self) -> dict[int, int]:
        """Bytes each rank sends over the wire (source ranks with nothing to send show 0)."""
        out = {rank: 0 for rank in self.source.ranks}
        for (sender, _), nbytes in self.pair_bytes.items():
            out[sender] += nbytes
        return out

    @cached_property
    def recv_bytes(self) -> dict[int, int]:
        """Bytes each destination rank receives over the wire."""
        out = {rank: 0 for rank in self.destination.ranks}
        for (_, receiver), nbytes in self.pair_bytes.items():
            out[receiver] = out.get(receiver, 0) + nbytes
        return out

    @property
    def send_balance(self) -> float:
        """max / mean of bytes sent over the source ranks (1.0 is perfect)."""
        sent = list(self.send_bytes.values())
        mean = sum(sent) / len(sent) if sent else 0
        return max(sent) / mean if mean else 1.0

    @cached_property
    def _streams(self) -> dict[int, int]:
        """Per rank, how many streams it stages each round: peers it sends to plus peers it receives from."""
        streams: dict[int, int] = defaultdict(int)
        for sender, receiver in self.pair_bytes:
            streams[sender] += 1
            streams[receiver] += 1
        return dict(streams)

    @cached_property
    def quotas(self) -> dict[tuple[int, int], int | None]:
        """Per-round staging quota of every (source, destination) stream
        (:func:`~reshard.planning.schedule.pair_quotas`), from its payload plus at most ``ALIGN - 1``
        bytes of padding per copy; ``None`` without a cap."""
        copies = self._pair_copies
        return pair_quotas({pair: nbytes + (ALIGN - 1) * copies[pair] for pair, nbytes in self.pair_bytes.items()},
                           self.round_bytes)

    @cached_property
    def _pair_copies(self) -> dict[tuple[int, int], int]:
        """Copies from rank s to rank d (before any split into rounds), ``{(s, d): count}``."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for group in self._groups:
            num_instances = len(group.tensors)
            fixed = np.flatnonzero((group.items.kind == REMOTE) & (group.choice_of < 0))
            for pair in zip(group.rank[fixed].tolist(), group.dst_rank[fixed].tolist()):
                out[pair] += num_instances
            if len(group.choice_cols):
                width = int(max(group.choice_rank.max(), group.dst_rank.max())) + 1
                codes = group.choice_rank * width + group.dst_rank[group.choice_cols][None, :]
                keys, counts = np.unique(codes, return_counts=True)
                for key, count in zip(keys.tolist(), counts.tolist()):
                    out[(key // width, key % width)] += count
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
        return {rank: self.for_rank(rank) for rank in ranks}

    @property
    def num_messages(self) -> int:
        """Point-to-point messages over all rounds (builds every rank's part once)."""
        return sum(len(part.sends) for part in self._all_rank_plans.values())

    @property
    def num_rounds(self) -> int:
        return max((part.num_rounds for part in self._all_rank_plans.values()), default=0)

    @property
    def num_pieces(self) -> int:
        return sum(len(self.source.tables[name]) + len(self.destination.tables[name]) for name in self.tensors)

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
        digest = hashlib.sha256(f"reshard-plan-{PLAN_FORMAT}-{self.round_bytes}".encode())
        if self.domains is not None:
            digest.update(b"domains" + self.domains.tobytes())
        digests = _ArrayDigests()
        src_tables, dst_tables = self.source.tables, self.destination.tables
        for group in self._groups:
            items = group.items
            chunks = [digests.of(array) for array in (
                items.kind, items.dst_piece, items.offsets, items.sizes, group.piece, group.rank, group.dst_rank,
                group.nbytes, group.choice_cols, group.choice_piece, group.choice_rank)]
            for name in group.tensors:  # the tensors' names, buffer names and offsets (kept short: per tensor)
                chunks.append(name.encode() + b"\0")
                for tables in (src_tables, dst_tables):
                    table = tables[name]
                    chunks.append(_buffer_names(table.buffers))
                    chunks.append(digests.of(table.buffer_offsets))
            digest.update(b"".join(chunks))
        for layout in (self.source, self.destination):  # each rank's buffers: a digest kept on the shared mapping
            ranks = layout.ranks
            digest.update(b"ranks" + np.array(ranks, np.int64).tobytes())
            digest.update(b"".join(layout.buffer_map(rank).digest().to_bytes(32, "little") for rank in ranks))
        return digest.hexdigest()[:16]

    # ------------------------------------------------------------------ one rank
    @without_gc
    def for_rank(self, rank: int) -> RankPlan:
        """``rank``'s sends, receives, local and fan-out copies; other ranks' copies are not built
        (:mod:`reshard.planning.rank_plan`)."""
        return self._rank_plans.build(int(rank), self._round_quotas)

    def source_reads(self, rank: int) -> list[Copy]:
        """The copies of ``rank``'s part that read its source buffers: its sends and local copies."""
        part = self.for_rank(rank)
        return [copy for message in part.sends for copy in message.copies] + list(part.local)

    def _round_quotas(self) -> Mapping[tuple[int, int], int | None]:
        """Each stream's per-round quota, empty without a cap (one round)."""
        return self.quotas if self.max_bucket_bytes is not None else {}


class _ArrayDigests:
    """A digest of each array's shape, dtype and contents, worked out once per array (by identity:
    arrays that tables and groups alike share; every array hashed stays alive while this lives).
    Equal contents give equal digests however the arrays are shared, so ranks that built their
    layouts differently still agree.

    >>> d = _ArrayDigests()
    >>> a = np.arange(4)
    >>> d.of(a) == d.of(a.copy()) != d.of(a.reshape(2, 2)), len(d.of(a))
    (True, 32)
    """

    def __init__(self) -> None:
        self._found: dict[int, tuple[np.ndarray, bytes]] = {}  # id -> (the array, held: its id stays unique)

    def of(self, array: np.ndarray) -> bytes:
        hit = self._found.get(id(array))
        if hit is None:
            h = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
            h.update(np.ascontiguousarray(array))  # its memory: the bytes of tobytes()
            hit = self._found[id(array)] = (array, h.digest())
        return hit[1]


def _buffer_names(names) -> bytes:
    """Buffer names as hashed: the one name where all are one (a :class:`Repeated` or a tuple alike:
    they are equal; how many, the buffer offsets' shape says), else all of them.

    >>> _buffer_names(Repeated("w", 3)) == _buffer_names(("w", "w", "w")) != _buffer_names(("w", "v", "w"))
    True
    """
    if type(names) is Repeated:  # the common case, once per tensor: no pass over the names
        one = names.name if names.n else None
    else:
        one = names[0] if names and names.count(names[0]) == len(names) else None
    if one is None:
        return b"\2" + "\0".join(names).encode() + b"\1"
    return b"\3" + one.encode() + b"\1"


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


__all__ = ["PLAN_FORMAT", "PhasedPlan", "Plan", "RankPlan", "check_pair", "domain_array", "plan"]
