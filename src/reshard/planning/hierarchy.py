"""Refit in phases across NVLink domains: cross the network once per domain, fan out over NVLink.

When several destination ranks of one NVLink domain hold the same box (data-parallel
engines, replicated KV heads, norms, routers), the box crosses the network once into the
domain, to one *receiver* chosen to balance NIC ingress over the domain's ranks, and is
forwarded from there over NVLink::

    phase 1 (network)   sources   -> receivers        Plan(source, receivers, domains)
    phase 2 (NVLink)    receivers -> the other ranks   Plan(receivers, rest, domains)

Both phases are ordinary :class:`~reshard.planning.plan.Plan` objects; phase 2 reads the destination
buffers that phase 1 filled. Example: two sources each hold all of ``w``, four destinations
each need all of it, domains ``{2, 3}`` and ``{4, 5}``::

    phase 1   0 -> 2  w      1 -> 4  w     each domain takes w once over the network
    phase 2   2 -> 3  w      4 -> 5  w     NVLink

A *relay* phase goes between them when more domains need a box than the sources hold copies
of it (:func:`split_relays`): the sources send it to a few *seed* domains (:func:`seed_count`:
between one and as many as they hold copies, balancing the sources' NICs against the seeds'),
and the seeds' receivers send it on to the other domains' over the network, whose
inference-side NICs are otherwise idle in phase 1. A seed sends its box several times, so seeds
are spread per box and per tensor over the ranks, balancing what each NIC sends on: with 8
independent engines, slice t of each expert seeds on the GPUs holding slice t in turn.

Sources are chosen with ``domains`` (see :class:`~reshard.planning.plan.Plan`): a replica inside the
destination's domain is used when there is one, else the replica with the least traffic out
of its domain so far. Boxes of at least ``split_bytes`` that several source replicas hold are
cut along their first dim into one part per replica, so that one big box does not load one
source alone.

Boxes are deduplicated when identical (same tensor, offsets and sizes) within a domain: the
replicas frameworks make. Partially overlapping boxes are planned as they are.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from bisect import bisect_right
from functools import cached_property, lru_cache
from typing import Mapping, NamedTuple

import numpy as np

from ..gc_pause import without_gc
from ..layout import Layout, PieceTable, Repeated, read_only
from ..tensors import itemsize
from .code_sums import sum_by_code, sum_rows_by_code
from .geometry_groups import SMALL_TABLES
from .pair_arrays import PairArrays
from .plan import Plan, domain_array
from .rank_plan import RankPlan
from .schedule import ALIGN, Message, aligned, chunk_stream, round_cap

AUTO = "auto"
DENSE_CODES = 1 << 24  # chunk_pair_bytes sums by a dense array of (chunk, pair) codes up to this many
SEED_UNITS = 8  # runs of tensors sharing a geometry that may seed a relayed box on different ranks


@dataclass
class HierarchicalPlan:
    """The phases of a domain-aware refit, and the figures a cost model needs (a
    :class:`~reshard.planning.plan.PhasedPlan`)."""

    source: Layout  # what the network phase reads
    destination: Layout  # every destination piece, filled by one phase or another
    network: Plan  # sources -> one receiver per (domain, box) (the seeds, when there is a relay)
    forward: Plan  # receivers -> the other ranks of their domain, over NVLink
    domains: dict[int, int]
    relay: Plan | None = None  # seeds -> receivers of other domains, over the network
    chunks: int = 1  # 1: phases one after another; more: pipelined over this many tensor chunks (see pipelined)
    _steps: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def max_bucket_bytes(self) -> int | None:
        return self.network.max_bucket_bytes

    @property
    def phases(self) -> list[Plan]:
        """In order: the first reads the source buffers, the others the destination buffers."""
        return [self.network] + ([self.relay] if self.relay is not None else []) + [self.forward]

    @property
    def phase_names(self) -> list[str]:
        return ["network"] + (["relay"] if self.relay is not None else []) + ["NVLink forward"]

    def source_reads(self, rank: int) -> list:
        """The copies of ``rank``'s that read its source buffers (the network phase's)."""
        return self.network.source_reads(rank)

    @cached_property
    def cross_domain_bytes(self) -> dict[int, int]:
        """Bytes entering each destination domain from other domains (over NICs)."""
        out: dict[int, int] = {}
        for p in self.phases:
            for d, b in cross_domain_bytes(p.pair_bytes, self.domains).items():
                out[d] = out.get(d, 0) + b
        return out

    @property
    def wire_bytes(self) -> int:
        return sum(p.wire_bytes for p in self.phases)

    def fingerprint(self) -> str:
        out = "".join(p.fingerprint() for p in self.phases)
        return out if not self.is_pipelined else f"{out}-pipelined{self.chunks}"

    def summary(self) -> dict:
        out = {name: p.summary() for name, p in zip(self.phase_names, self.phases)}
        out["cross_domain_bytes"] = sum(self.cross_domain_bytes.values())
        if self.is_pipelined:
            out["pipelined"] = {"chunks": self.chunks, "steps": self.num_steps}
        return out

    # ------------------------------------------------------------------ pipelined order
    def pipelined(self, chunks: int = 8) -> "HierarchicalPlan":
        """The same phases (the same copies, sources, receivers and seeds) run pipelined: the
        destination's tensors are dealt into ``chunks`` chunks (:func:`tensor_chunks`) and step ``s``
        runs phase ``p`` of chunk ``s - p`` for every phase at once, so the NVLink forward of chunk c
        moves in the same rounds as the network transfer of chunk c+1 (and, with a relay, the relay
        of chunk c). Every rank builds its own steps alone (:meth:`steps_for_rank`); ``chunks=1`` is
        the sequential order.

        Staging: the phases of a step share the staging cap: every stream of a step is cut into the
        step's number of sub-rounds, chosen so that what the busiest rank stages in a sub-round,
        every phase's streams together, stays within the round cap (half of ``max_bucket_bytes``,
        two sub-rounds in flight) as a sequential round does, plus at most ``2 * ALIGN`` per stream
        of rounding (:meth:`step_rounds`).

        >>> import torch, reshard as rs
        >>> spec = rs.TensorSpec("w", (8, 4), torch.float32)
        >>> src = rs.Layout.from_placements(spec, ranks=[0, 1], mesh_shape=(2,), placements=[rs.Shard(0)])
        >>> dst = rs.Layout.from_placements(spec, ranks=[2, 3], mesh_shape=(2,), placements=[rs.Replicate()])
        >>> h = hierarchical_plan(src, dst, {0: 0, 1: 0, 2: 1, 3: 1}).pipelined(4)
        >>> h.chunks, h.num_steps    # rows 0-1 of w, 2-3, 4-5, 6-7 in turn; two phases: five steps
        (4, 5)
        """
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"pipelined: chunks must be an integer >= 1, got {chunks!r}")
        tensors = sum(1 for t in self.destination.tables.values() if len(t))
        return replace(self, chunks=chunks if tensors else 1, _steps={})

    @property
    def is_pipelined(self) -> bool:
        return self.chunks > 1 and len(self.phases) > 1

    @property
    def num_steps(self) -> int:
        """Steps of the pipelined order (chunks + phases - 1); the phases, in the sequential one."""
        return self.chunks + len(self.phases) - 1 if self.is_pipelined else len(self.phases)

    @cached_property
    def chunk_of(self) -> dict[str, Bands]:
        """How each destination tensor's rows are dealt into the chunks (:func:`tensor_chunks` over
        every phase's layouts). The seeds, relayed and rest layouts hold some of the receivers' or the
        destination's pieces, whole (:func:`hierarchical_plan`'s splits), so they cut no row finer than
        those: the source, the receivers and the destination are the layouts read."""
        return tensor_chunks(self.destination, self.chunks, [self.source, self.forward.source, self.destination])

    def split_by_chunk(self, c) -> list[tuple[int, object]]:
        """``[(chunk, sub-copy)]``: copy ``c`` cut at the row bands of its tensor (:class:`Bands`),
        in row order."""
        n = self.destination.specs[c.tensor].shape[0]
        lo, size = c.offsets[0], c.sizes[0]
        bands, k = self.chunk_of[c.tensor], self.chunks
        edges = [n * j // bands.count for j in range(bands.count + 1)]
        first = max(bisect_right(edges, lo) - 1, 0)
        out = []
        for band in range(first, bands.count):
            a, b = max(edges[band], lo), min(edges[band + 1], lo + size)
            if a >= lo + size:
                break
            if a < b:
                out.append(((band + bands.rotation) % k, c if (a, b) == (lo, lo + size) else c.narrow(0, a - lo, b - a)))
        return out

    def phase_share(self) -> int:
        """How many phases share a round's staging cap: the number of phases when pipelined, else 1."""
        return len(self.phases) if self.is_pipelined else 1

    @cached_property
    def _chunk_pairs(self) -> list[list[PairArrays]]:
        return [chunk_pair_bytes(phase, self.chunk_of, self.chunks) for phase in self.phases]

    @cached_property
    def _chunk_pieces(self) -> list[list[PairArrays]]:
        return [chunk_pair_bytes(phase, self.chunk_of, self.chunks, pieces=True) for phase in self.phases]

    def step_rounds(self, cap: int | None = None) -> list[int]:
        """Sub-rounds of each step: the most any rank needs to stage its streams of every phase in the
        step together within the round cap ``B`` (of the plan's ``max_bucket_bytes``, or of ``cap``
        for an uncapped plan; 1 without either): the phases of a step share ``B``. Every
        stream of the step is cut into about this many equal messages, so the phases of a step (a
        network chunk on NICs, an NVLink chunk) keep their links busy in the same sub-rounds, and a
        rank stages at most ``B`` per sub-round (plus ``ALIGN`` per stream). A capped plan counts
        each piece's padding to ``ALIGN`` (up to ``ALIGN - 1`` bytes a piece: it matters where copies
        are tiny) as its sequential quotas do; an uncapped plan modeled at ``cap`` leaves it out, as
        the sequential model does. A plan-wide figure from the plan's arrays, the same on every rank,
        as the quotas are."""
        capped = self.max_bucket_bytes is not None
        cap = self.max_bucket_bytes if capped else cap
        members_of = self.step_pair_bytes()
        if cap is None:
            return [1] * len(members_of)
        room_of_cap = round_cap(cap)
        out = []
        for s, members in enumerate(members_of):
            arrays = [pairs for _, pairs in members]
            pieces = [self._chunk_pieces[p][s - p] for p, _ in members] if capped else []
            width = max((int(max(a.src.max(), a.dst.max())) + 1 for a in arrays + pieces if len(a)), default=0)
            load = np.zeros(width, np.int64)  # what each rank stages over the step, every phase in it together
            count = np.zeros(width, np.int64)
            for a in arrays:
                load += a.rank_totals(width)
                count += a.rank_totals(width, np.ones(len(a)))
            for a in pieces:  # a capped plan: each piece is staged aligned, up to ALIGN - 1 bytes more each
                load += (ALIGN - 1) * a.rank_totals(width)
            room = np.maximum(room_of_cap - 2 * ALIGN * count, ALIGN)
            out.append(max(1, int((-(-load // room)).max(initial=0))))
        return out

    def steps_for_rank(self, rank: int) -> list[list["StepPart"]]:
        """``rank``'s part of each step of the pipelined order: per step, one :class:`StepPart` per
        phase that runs in it (phase ``p`` of chunk ``s - p``). Sub-round ``j`` of a step carries
        the ``j``-th message of every stream of every phase in it; each stream's chunk is cut into
        about :meth:`step_rounds` messages (its quota: its staged bytes over that, at most
        :meth:`step_rounds`). Both ends of a stream cut the same copies the same way, so they agree
        with no other rank's part. Built from this rank's own part of each phase (``Plan.for_rank``
        with no round cap, then cut per chunk) and plan-wide figures."""
        rank = int(rank)
        hit = self._steps.get(rank)
        if hit is not None:
            return hit
        num_chunks = self.chunks
        rounds = self.step_rounds()
        per_phase = []  # [phase][chunk] -> StepPart
        for p, phase in enumerate(self.phases):
            whole = phase._rank_plans.build(rank, dict)  # every stream as one message, in stream order
            capped = self.max_bucket_bytes is not None
            parts = [StepPart(p, RankPlan(rank)) for _ in range(num_chunks)]
            for messages, sending in ((whole.sends, True), (whole.recvs, False)):
                for m in messages:
                    pair = (rank, m.peer) if sending else (m.peer, rank)
                    by_chunk: list[list] = [[] for _ in range(num_chunks)]
                    for c in m.copies:
                        for k, piece in self.split_by_chunk(c):
                            by_chunk[k].append(piece)
                    for k, copies in enumerate(by_chunk):
                        if not copies:
                            continue
                        quota = None  # about step_rounds equal messages
                        if capped:
                            staged = sum(aligned(c.nbytes) for c in copies)
                            quota = max(ALIGN, aligned(-(-staged // rounds[k + p])))
                        into = parts[k].part.sends if sending else parts[k].part.recvs
                        for j, piece in enumerate(chunk_stream(copies, quota)):
                            into.append(Message(m.peer, j, piece))
            for kind in ("local", "fanout"):
                for c in getattr(whole, kind):
                    for k, piece in self.split_by_chunk(c):
                        getattr(parts[k].part, kind).append(piece)
            per_phase.append(parts)
        steps = []
        for s in range(num_chunks + len(self.phases) - 1):
            steps.append([per_phase[p][s - p] for p in range(len(self.phases)) if 0 <= s - p < num_chunks])
        self._steps[rank] = steps
        return steps

    def step_pair_bytes(self) -> list[list[tuple[int, PairArrays]]]:
        """Per step, ``(phase index, {(src, dst): bytes})`` (a :class:`PairArrays`) of every phase in it:
        the bytes of the phase's chunk (from the plan's arrays, no rank's part built); the cost model's input."""
        per_phase = self._chunk_pairs
        return [[(p, per_phase[p][s - p]) for p in range(len(self.phases)) if 0 <= s - p < self.chunks]
                for s in range(self.chunks + len(self.phases) - 1)]


class StepPart(NamedTuple):
    """One phase's part of one step of the pipelined order, on one rank (``part.round(j)`` gives
    the sub-round ``j`` messages; phase 0 reads the source buffers, later phases the destination)."""

    phase: int
    part: RankPlan


def row_bands(rows: int, chunks: int) -> list[tuple[int, int]]:
    """The ``chunks`` bands ``[a, b)`` of a tensor's first dim (``rows`` long), as even as can be.

    >>> row_bands(10, 4)
    [(0, 2), (2, 5), (5, 7), (7, 10)]
    """
    edges = [rows * k // chunks for k in range(chunks + 1)]
    return list(zip(edges[:-1], edges[1:]))


class Bands(NamedTuple):
    """How a tensor's rows are dealt into the chunks of the pipelined order: band ``j`` of
    ``count`` (:func:`row_bands`) is in chunk ``(j + rotation) % chunks``."""

    rotation: int
    count: int

    def chunk_shares(self, rows: int, chunks: int, lo: np.ndarray, size: np.ndarray) -> np.ndarray:
        """``[chunk, item]``: the share of each item's rows ``[lo, lo + size)`` that lies in each
        chunk for rotation 0 (roll by ``rotation`` for this tensor's chunks).

        >>> Bands(0, 4).chunk_shares(8, 2, np.array([0, 2]), np.array([8, 2])).tolist()
        [[0.5, 0.0], [0.5, 1.0]]
        """
        edges = np.array([rows * j // self.count for j in range(self.count + 1)], np.int64)
        owned = np.zeros((chunks, self.count + 1), np.int64)  # rows of bands < j in each chunk
        for c in range(chunks):
            width = np.diff(edges) * (np.arange(self.count) % chunks == c)
            owned[c, 1:] = np.cumsum(width)

        def below(x):  # [chunk, item]: rows of [0, x) in each chunk
            j = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, self.count - 1)
            part = owned[:, j].copy()
            part[j % chunks, np.arange(len(x))] += x - edges[j]
            return part

        hi = np.minimum(lo + size, rows)
        return (below(hi) - below(lo)) / np.maximum(size, 1)[None, :]

    def chunk_pieces(self, rows: int, chunks: int, lo: np.ndarray, size: np.ndarray) -> np.ndarray:
        """``[chunk, item]``: into how many pieces the bands cut each item's rows ``[lo, lo + size)`` in
        each chunk for rotation 0 (the copies :meth:`HierarchicalPlan.split_by_chunk` makes of it).

        >>> Bands(0, 4).chunk_pieces(8, 2, np.array([0, 2]), np.array([8, 2])).tolist()
        [[2, 0], [2, 1]]
        """
        edges = np.array([rows * j // self.count for j in range(self.count + 1)], np.int64)
        hi = np.minimum(lo + size, rows)
        first = np.clip(np.searchsorted(edges, lo, side="right") - 1, 0, self.count - 1)  # band of the first row
        last = np.clip(np.searchsorted(edges, hi - 1, side="right") - 1, 0, self.count - 1)  # of the last
        c = np.arange(chunks)[:, None]  # bands j in [first, last] with j % chunks == c
        return np.where(hi > lo, (last - c) // chunks - (first - 1 - c) // chunks, 0)


def row_splits(layouts) -> dict[str, int]:
    """How finely ``layouts`` cut each tensor's first dim: its rows over the shortest piece's rows, the
    most in any of them; tensors where every piece holds whole rows (1) left out.

    >>> import torch, reshard as rs
    >>> spec = rs.TensorSpec("w", (8, 2), torch.float32)
    >>> halves = rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(0)])
    >>> row_splits([halves]), row_splits([rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(1)])])
    ({'w': 2}, {})
    """
    out: dict[str, int] = {}
    for lay in layouts:
        specs, by_sizes = lay.specs, {}  # tables sharing a sizes array (tensors alike) cut alike
        for name, t in lay.tables.items():
            sizes = t.sizes
            split = by_sizes.get(id(sizes))  # every table stays alive while this runs: ids are unique
            if split is None:
                shape = specs[name].shape
                split = by_sizes[id(sizes)] = (-(-(shape[0] if shape else 1) // max(int(sizes[:, 0].min()), 1))
                                               if len(sizes) and sizes.shape[1] else 1)
            if split > 1 and split > out.get(name, 1):
                out[name] = split
    return out


MAX_ROW_SPLIT = 64  # a tensor's rows are cut into at most chunks * this many bands


def tensor_chunks(destination: Layout, chunks: int, layouts=()) -> dict[str, Bands]:
    """``{tensor: Bands}``: how each destination tensor's rows are dealt into ``chunks`` chunks.

    A tensor's rows are cut into ``chunks * m`` bands (at most its rows), ``m`` being how finely
    ``layouts`` (the phases' layouts; default the destination alone) cut its first dim
    (:func:`row_splits`, at most :data:`MAX_ROW_SPLIT`); band ``j`` goes in chunk
    ``(j + rotation) % chunks``. Every piece of those layouts then spans ``chunks`` bands or more,
    so each chunk holds about 1/chunks of every piece, and every stream (whole tensors, a pipeline
    stage's layers, the row part a source replica sends of an LM head) sends about 1/chunks of its
    bytes in each step. Rotations count up over the tensors of one shape (layer after layer), so
    pieces of a band's size spread over the chunks too. The same on every rank (it reads only
    the layouts); an element is in the same chunk in every phase, so a phase's chunk reads only what
    earlier phases' same chunk wrote.

    >>> import torch, reshard as rs
    >>> specs = [rs.TensorSpec(n, (4,), torch.float32) for n in "abc"] + [rs.TensorSpec("d", (8, 2), torch.float32)]
    >>> dst = rs.Layout.merge([rs.Layout.from_placements(s, [0, 1], (2,), [rs.Replicate()]) for s in specs[:3]]
    ...                       + [rs.Layout.from_placements(specs[3], [0, 1], (2,), [rs.Shard(0)])])
    >>> tensor_chunks(dst, 2)    # d: rows 0-3 on rank 0, 4-7 on rank 1: four bands, each rank's half in both chunks
    {'a': Bands(rotation=0, count=2), 'b': Bands(rotation=1, count=2), 'c': Bands(rotation=0, count=2), 'd': Bands(rotation=0, count=4)}
    """
    chunks = max(int(chunks), 1)
    layouts = tuple(layouts) or (destination,)
    seen: dict[tuple, int] = {}
    splits = row_splits(layouts) if chunks > 1 else {}
    out = {}
    for name, t in destination.tables.items():
        if not len(t):
            continue
        shape = tuple(destination.specs[name].shape)
        rows = shape[0] if shape else 1
        k = seen.get(shape, 0)
        seen[shape] = k + 1
        m = min(splits.get(name, 1), MAX_ROW_SPLIT)
        out[name] = Bands(k % chunks, max(min(rows, chunks * m), 1))
    return out


def chunk_pair_bytes(phase: Plan, chunk_of: Mapping[str, Bands], chunks: int, *, pieces: bool = False
                     ) -> list[PairArrays]:
    """Per chunk, ``{(src, dst): bytes}`` of the phase's copies between distinct ranks, each copy's
    rows counted in the chunk of their band (:func:`tensor_chunks`); sums to ``phase.pair_bytes``.
    ``pieces``: instead of bytes, how many pieces the bands cut the copies into in each chunk (each
    staged aligned to ``ALIGN``: what a stream's padding can add).

    Groups sharing their intersection (:func:`~reshard.planning.geometry_groups.items_key`: the
    experts of every stage), row count and band count are summed together, as arrays stacked
    over the groups; a copy's share of a chunk is a whole number of rows, so the sums are whole
    bytes whatever their order."""
    tensors = phase.tensors
    width = max(set(phase.source.ranks) | set(phase.destination.ranks), default=0) + 1
    w2 = width * width
    rotation = np.fromiter((chunk_of[n].rotation for n in tensors), np.int64, len(tensors))
    band_count = np.fromiter((chunk_of[n].count for n in tensors), np.int64, len(tensors))
    specs = phase.destination.specs
    families: dict[tuple, list] = {}  # (items, rows, band count) -> [(group, its instances of that count)]
    for group in phase._groups:
        counts = band_count[group.tensor_index]
        rows = specs[group.tensors[0]].shape[0]
        first, last = int(counts[0]), int(counts[-1])
        if first == last and (counts == first).all():  # tensors alike in a phase share a band count
            families.setdefault((id(group.items), rows, first), []).append((group, None))
            continue
        for count in np.unique(counts).tolist():
            families.setdefault((id(group.items), rows, count), []).append((group, np.flatnonzero(counts == count)))
    codes: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    for (_, rows, count), members in families.items():  # every group stays alive while this runs: ids are unique
        items = members[0][0].items
        bands = Bands(0, count)
        share = bands.chunk_pieces if pieces else bands.chunk_shares
        frac = share(rows, chunks, items.offsets[:, 0], items.sizes[:, 0])
        _family_codes(members, frac, rotation, chunks, width, codes, weights, pieces)
    keys = out_src = out_dst = out_bytes = np.zeros(0, np.int64)
    if codes:
        code, weight = np.concatenate(codes), np.concatenate(weights)
        if chunks * w2 <= DENSE_CODES:
            sums = np.bincount(code, weights=weight, minlength=chunks * w2)
            keys = np.flatnonzero(sums)
            sums = sums[keys]
        else:
            keys, sums = sum_by_code(code, weight)
        pair = keys % w2
        out_src, out_dst = pair // width, pair % width
        keep = (sums > 0.5) & (out_src != out_dst)
        keys, out_src, out_dst, out_bytes = keys[keep], out_src[keep], out_dst[keep], np.rint(sums[keep]).astype(np.int64)
    edges = np.searchsorted(keys // w2, np.arange(chunks + 1))
    return [PairArrays(out_src[a:b], out_dst[a:b], out_bytes[a:b]) for a, b in zip(edges[:-1], edges[1:])]


def _family_codes(members: list, frac: np.ndarray, rotation: np.ndarray, chunks: int, width: int,
                  codes: list, weights: list, unit: bool = False) -> None:
    """Append the (chunk, pair) codes and byte weights of the remote items of ``members`` (groups
    sharing one intersection, each with the positions of its tensors taken, None: all;
    ``frac[chunk, item]``: an item's share of each chunk at rotation 0; ``unit``: weigh each
    instance's item 1, not its bytes)."""
    from .intersect import REMOTE
    w2 = width * width
    groups = [group for group, _ in members]
    first = groups[0]
    instances = [len(g.tensors) if pick is None else len(pick) for g, pick in members]
    member_of = np.repeat(np.arange(len(members)), instances)  # per instance taken
    rot = np.concatenate([rotation[g.tensor_index if pick is None else g.tensor_index[pick]] for g, pick in members])
    one_row = all(g.nbytes.shape[0] == 1 or g.nbytes.strides[0] == 0 for g in groups)

    def instance_bytes(cols):  # [instance, col]: bytes of each instance's items ``cols`` (unit: 1)
        if unit:
            return np.ones((len(member_of), len(cols)))
        if one_row:
            return np.stack([g.nbytes[0, cols] for g in groups])[member_of]
        return np.concatenate([np.broadcast_to(g.nbytes, (len(g.tensors), g.nbytes.shape[1]))[
            slice(None) if pick is None else pick][:, cols] for g, pick in members])

    fixed = np.flatnonzero((first.items.kind == REMOTE) & (first.choice_of < 0))
    if len(fixed):  # [member, chunk, item]: bytes per rotation, then turned into each chunk
        pair = np.stack([g.rank for g in groups])[:, fixed] * width + np.stack([g.dst_rank for g in groups])[:, fixed]
        per_rot = np.zeros((len(members) * chunks, len(fixed)))
        at, sums = sum_rows_by_code(member_of * chunks + rot, instance_bytes(fixed))
        per_rot[at] = sums
        per_rot = per_rot.reshape(len(members), chunks, len(fixed))
        share = frac[:, fixed]
        total = np.zeros((len(members), chunks, len(fixed)))
        for r in np.flatnonzero(per_rot.any(axis=(0, 2))).tolist():  # chunk c holds band c - r of rotation r
            total += per_rot[:, r, None, :] * np.roll(share, r, axis=0)[None, :, :]
        live = total != 0
        codes.append((np.arange(chunks)[None, :, None] * w2 + pair[:, None, :])[live])
        weights.append(total[live])
    cols = first.choice_cols
    if len(cols):  # instances alike summed first: (member, column, rotation, chosen rank), then [chunk, that]
        ranks = np.concatenate([g.choice_rank if pick is None else g.choice_rank[pick] for g, pick in members])
        alike = (((member_of[:, None] * len(cols) + np.arange(len(cols))[None, :]) * chunks + rot[:, None]) * width
                 + ranks)
        keys, nbytes = sum_by_code(alike, instance_bytes(cols))
        src, rest = keys % width, keys // width
        rot_of, rest = rest % chunks, rest // chunks
        column, member = rest % len(cols), rest // len(cols)
        pair = src * width + np.stack([g.dst_rank[cols] for g in groups])[member, column]
        weight = nbytes[None, :] * frac[:, cols][:, column]  # [chunk, key]
        chunk = (np.arange(chunks)[:, None] + rot_of[None, :]) % chunks
        live = weight != 0
        codes.append((chunk * w2 + pair[None, :])[live])
        weights.append(weight[live])


def cross_domain_bytes(pair_bytes: Mapping[tuple[int, int], int], domains: Mapping[int, int]) -> dict[int, int]:
    """``{domain: bytes}`` that pairs ``{(src, dst): bytes}`` bring into each domain from another."""
    out: dict[int, int] = {}
    for (s, d), b in pair_bytes.items():
        if domains[s] != domains[d]:
            out[domains[d]] = out.get(domains[d], 0) + b
    return out


def domain_need_bytes(destination: Layout, domains: Mapping[int, int]) -> dict[int, int]:
    """Bytes of the distinct boxes each domain's ranks hold (identical boxes counted once).

    >>> import torch, reshard as rs
    >>> spec = rs.TensorSpec("w", (4, 4), torch.float32)
    >>> dst = rs.Layout.from_placements(spec, ranks=[2, 3, 4, 5], mesh_shape=(4,), placements=[rs.Replicate()])
    >>> domain_need_bytes(dst, {2: 0, 3: 0, 4: 1, 5: 1})
    {0: 64, 1: 64}
    """
    dom = domain_array(domains, destination.ranks)
    tensors: dict[tuple, list] = {}  # (geometry, itemsize) -> [a table, how many tensors, its dtypes]; in tensor order
    keys: dict = {}  # tables of the same arrays: one geometry key
    for name, t in destination.tables.items():
        if not len(t.ranks):
            continue
        found = destination.buffer_dtypes(name)
        key = (t.geometry_key(keys), found.uniform.itemsize) if found.uniform is not None else (name,)
        hit = tensors.get(key)
        if hit is None:
            tensors[key] = [t, 1, found]
        else:
            hit[1] += 1
    out: dict[int, int] = {}
    for t, n, found in tensors.values():  # tensors of one geometry and dtype size: the same bytes
        for d, b in _domain_box_bytes(t, dom, found.itemsizes):
            out[d] = out.get(d, 0) + b * n
    return out


def _domain_box_bytes(t: PieceTable, dom: np.ndarray, itemsizes: np.ndarray) -> list[tuple[int, int]]:
    """``(domain, bytes)`` of each distinct box of one table within each domain, in domain order
    (``itemsizes``: bytes per element of each piece, in destination dtypes)."""
    rows = np.concatenate([dom[t.ranks][:, None], t.offsets, t.sizes], axis=1)
    uniq, first = np.unique(rows, axis=0, return_index=True)
    nbytes = t.sizes[first].prod(axis=1) * itemsizes[first]
    return list(zip(uniq[:, 0].tolist(), nbytes.tolist()))


@without_gc
def hierarchical_plan(source: Layout, destination: Layout, domains: Mapping[int, int], *,
                      max_bucket_bytes: int | None = None, split_bytes: int | str | None = AUTO,
                      relay: bool = True) -> HierarchicalPlan:
    """Plan a refit in phases over NVLink ``domains`` (``{rank: domain}``, every rank of both sides).

    ``split_bytes``: boxes at least this big with several source replicas are split across them
    (``"auto"``: 1/8 of the mean bytes per source rank; ``None``: never). ``relay``: boxes that
    more domains need than there are source copies go to as many *seed* domains as there are
    copies, and from the seeds' receivers to the other domains' (see :func:`split_relays`).
    """
    domains = {int(r): int(d) for r, d in domains.items()}
    receivers, rest = split_receivers(destination, domains)
    if split_bytes == AUTO:
        split_bytes = max(_total_bytes(receivers) // (8 * max(len(source.ranks), 1)), 1)
    if split_bytes is not None:
        receivers = split_across_replicas(receivers, source, int(split_bytes))
    seeds, relayed = split_relays(receivers, source, domains) if relay else (receivers, None)
    network = Plan(source, seeds, max_bucket_bytes=max_bucket_bytes, domains=domains)
    relay_plan = None if relayed is None else Plan(seeds, relayed, max_bucket_bytes=max_bucket_bytes, domains=domains)
    forward = Plan(receivers, rest, max_bucket_bytes=max_bucket_bytes, domains=domains)
    return HierarchicalPlan(source, destination, network, forward, domains, relay_plan)


def _total_bytes(layout: Layout) -> int:
    """Bytes of all pieces of ``layout`` (in the tensors' dtypes); tables sharing a sizes array are
    summed once (by identity: every table stays alive while this runs)."""
    elements: dict[int, list] = {}  # id of a sizes array -> [elements of its pieces, {itemsize: tensors}]
    for name, t in layout.tables.items():
        if len(t):
            hit = elements.get(id(t.sizes))
            if hit is None:
                hit = elements[id(t.sizes)] = [int(t.sizes.prod(axis=1).sum()), defaultdict(int)]
            hit[1][itemsize(layout.specs[name].dtype)] += 1
    return sum(n * isz * k for n, by_size in elements.values() for isz, k in by_size.items())


def _source_copies(st: PieceTable, cache: dict | None = None) -> int:
    """How many copies of each region the source holds (pieces per distinct box); ``cache``: see
    :meth:`PieceTable.box_copies`."""
    return len(st) // max(len(st.box_copies(cache)[1]), 1)


def _rows_of(t: PieceTable, rows: np.ndarray, cache: dict | None = None) -> tuple[np.ndarray, ...]:
    """Read-only ranks, offsets, sizes of ``rows``: shared by the tables of every tensor with
    this geometry and receiver choice (later passes then work once per tensors alike); ``cache``: a
    dict kept over one split, where tables sharing offsets and sizes arrays share the restricted ones
    (the cache holds what its keys name)."""
    if cache is None:
        return read_only((t.ranks[rows], t.offsets[rows], t.sizes[rows]))
    key = (id(t.offsets), id(t.sizes), rows.tobytes())
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = (t.offsets, t.sizes) + read_only((t.offsets[rows], t.sizes[rows]))
    return read_only((t.ranks[rows],)) + hit[2:]


@lru_cache(maxsize=4096)
def _kept_rows(num_rows: int, relay_rows: tuple[int, ...], seeds: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(rows a seeds table keeps, rows relayed) of a receivers table of ``num_rows`` rows whose
    ``relay_rows`` need a relay, ``seeds`` of them taking the box from a source (read-only)."""
    keep = np.ones(num_rows, bool)
    keep[list(relay_rows)] = False
    keep[list(seeds)] = True
    return read_only((np.flatnonzero(keep), np.flatnonzero(~keep)))


def _subset(t: PieceTable, rows: np.ndarray, shared: tuple[np.ndarray, ...], cache: dict | None = None
            ) -> PieceTable:
    """``t`` restricted to ``rows`` (whose ranks/offsets/sizes are ``shared``); ``cache``: a dict kept
    over one split, so that tables sharing buffer offsets share the restricted ones too (by identity:
    the cache holds both arrays, so neither id is reused while it lives, even where the caller
    lets ``rows`` go)."""
    b = t.buffers
    if type(b) is Repeated and b.n:  # one buffer name (the common case, once per tensor: kept short)
        names = Repeated(b.name, len(rows))
    else:
        one = t.one_buffer()
        names = Repeated(one, len(rows)) if one is not None else tuple(b[r] for r in rows.tolist())
    if cache is None:
        return PieceTable(shared[0], shared[1], shared[2], names, t.buffer_offsets[rows])
    key = (id(t.buffer_offsets), id(rows))
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = (t.buffer_offsets, rows, read_only((t.buffer_offsets[rows],))[0])
    return PieceTable(shared[0], shared[1], shared[2], names, hit[2])


def split_receivers(destination: Layout, domains: Mapping[int, int]) -> tuple[Layout, Layout]:
    """(receivers, rest): ``destination``'s pieces split so that within each domain every distinct
    box is in ``receivers`` once; ``rest`` holds the other copies, to be forwarded over NVLink.

    Receivers are chosen like sources: biggest boxes first, each to the rank of the domain with
    the least bytes coming in so far; tensors sharing a geometry are dealt round-robin.
    """
    dom = domain_array(domains, destination.ranks)
    by_geometry: dict[bytes, list[str]] = {}
    keys: dict = {}  # tables of the same arrays: one geometry key
    for name, t in destination.tables.items():
        if len(t.ranks):
            by_geometry.setdefault(t.geometry_key(keys), []).append(name)
    load = [0] * len(dom)
    work = []  # (-bytes, geometry index, cluster members)
    geoms = []
    for gi, names in enumerate(by_geometry.values()):
        t = destination.tables[names[0]]
        rows = np.concatenate([dom[t.ranks][:, None], t.offsets, t.sizes], axis=1)
        _, inv = np.unique(rows, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        count = np.bincount(inv)
        vol = t.sizes.prod(axis=1) * itemsize(destination.specs[names[0]].dtype) * len(names)
        single = count[inv] == 1
        for r, b in zip(t.ranks[single].tolist(), vol[single].tolist()):
            load[r] += b
        order = np.argsort(inv, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(count)])
        clusters = [order[bounds[c]: bounds[c + 1]] for c in np.flatnonzero(count > 1).tolist()]
        geoms.append((names, t, single, clusters))
        work.extend((-int(vol[c[0]]), gi, ci) for ci, c in enumerate(clusters))
    work.sort()
    dealt: dict[tuple[int, int], list[int]] = {}
    for negb, gi, ci in work:
        names, t, _, clusters = geoms[gi]
        members = clusters[ci].tolist()
        holders = t.ranks[clusters[ci]].tolist()
        order = sorted(range(len(members)), key=lambda x: (load[holders[x]], holders[x]))
        n, m = len(names), len(order)
        per = -negb // n
        for p, x in enumerate(order):
            load[holders[x]] += per * (n // m + (p < n % m))
        dealt[(gi, ci)] = [members[x] for x in order]
    rec_tables: dict[str, PieceTable] = {}
    rest_tables: dict[str, PieceTable] = {}
    offsets_of: dict = {}  # restricted buffer offsets, shared by tables alike
    for gi, (names, t, single, clusters) in enumerate(geoms):
        cache: dict[tuple[int, ...], tuple] = {}
        orders = [dealt[(gi, ci)] for ci in range(len(clusters))]
        for i, name in enumerate(names):
            chosen = tuple([order[i % len(order)] for order in orders])
            hit = cache.get(chosen)
            if hit is None:
                keep = single.copy()
                keep[list(chosen)] = True
                kr, rr = np.flatnonzero(keep), np.flatnonzero(~keep)
                hit = cache[chosen] = (kr, _rows_of(t, kr), rr, _rows_of(t, rr))
            own = destination.tables[name]
            rec_tables[name] = _subset(own, hit[0], hit[1], offsets_of)
            rest_tables[name] = _subset(own, hit[2], hit[3], offsets_of)
    return destination.with_tables(rec_tables), destination.with_tables(rest_tables)


def _cut_rows(t: PieceTable, nbytes: np.ndarray, split_bytes: int, replicas: int) -> tuple[np.ndarray, ...]:
    """(source row of each part, ranks, offsets, sizes, buffer offsets) of ``t`` with each piece of at
    least ``split_bytes`` (``nbytes`` per piece) cut along its first dim of size >= 2 into
    ``min(replicas, that size)`` parts (read-only: tensors alike share them)."""
    rows = []
    for i in range(len(t)):
        if nbytes[i] < split_bytes:
            rows.append((i, None, 0, 0))
            continue
        dims = np.flatnonzero(t.sizes[i] >= 2)
        if not len(dims):
            rows.append((i, None, 0, 0))
            continue
        d = int(dims[0])
        n = int(t.sizes[i, d])
        k = min(replicas, n)
        edges = [n * j // k for j in range(k + 1)]
        rows.extend((i, d, a, b - a) for a, b in zip(edges[:-1], edges[1:]))
    idx = np.array([r[0] for r in rows], np.int64)
    offsets, sizes, boffs = t.offsets[idx].copy(), t.sizes[idx].copy(), t.buffer_offsets[idx].copy()
    lead = t.buffer_offsets.shape[1] - t.offsets.shape[1]
    for j, (_, d, a, size) in enumerate(rows):
        if d is not None:
            offsets[j, d] += a
            sizes[j, d] = size
            boffs[j, lead + d] += a
    return (idx,) + read_only((t.ranks[idx], offsets, sizes, boffs))


def split_across_replicas(receivers: Layout, source: Layout, split_bytes: int) -> Layout:
    """``receivers`` with each piece of at least ``split_bytes`` cut along its first dim of size
    >= 2 into one part per source replica of its tensor (so the planner can take each part
    from another replica)."""
    tables = dict(receivers.tables)
    copies: dict = {}  # source tables with the same boxes hold as many copies
    replicas_of: dict = {}  # source tables of the same arrays: the same answer, by identity
    cuts: dict = {}  # tables of the same arrays (shared by the receivers' split) are cut alike (None: not cut)
    for name, t in receivers.tables.items():
        if not len(t):
            continue
        st = source.tables[name]
        src_key = (id(st.offsets), id(st.sizes))
        replicas = replicas_of.get(src_key)
        if replicas is None:  # every table stays alive while this runs: ids are unique
            replicas = replicas_of[src_key] = _source_copies(st, copies)
        if replicas < 2:
            continue
        isz = itemsize(receivers.specs[name].dtype)
        key = (id(t.ranks), id(t.offsets), id(t.sizes), id(t.buffer_offsets), replicas, isz)
        if key in cuts:
            cut = cuts[key]
        else:
            nbytes = t.sizes.prod(axis=1) * isz
            big = (nbytes >= split_bytes).any()
            cut = cuts[key] = _cut_rows(t, nbytes, split_bytes, replicas) if big else None
        if cut is None:
            continue
        idx, ranks, offsets, sizes, boffs = cut
        b = t.one_buffer()
        names = Repeated(b, len(idx)) if b is not None else tuple(t.buffers[i] for i in idx.tolist())
        tables[name] = PieceTable(ranks, offsets, sizes, names, boffs)
    return receivers.with_tables(tables)


def seed_count(copies: int, domains: int, gpus: float) -> int:
    """How many seed domains take a box from the sources when ``domains`` domains need it, the
    sources hold ``copies`` of it and a seed domain relays it from ``gpus`` GPUs.

    With ``s`` seeds, each source replica sends ``s / copies`` of the box, and each GPU of a seed
    domain relays ``(domains - s) / (s * gpus)`` of it: the two are equal near
    ``s = sqrt(copies * domains / gpus)``. Fewer seeds load the relays (one seed per box: a seed's
    NIC sends the box to every other domain), more load the sources, whose NICs also carry what
    only they hold (a last pipeline stage: its experts and the LM head). At most ``copies``.

    >>> seed_count(64, 128, 8)    # an LM head on 64 training GPUs, 128 TP8 inference domains
    32
    >>> seed_count(1, 8, 8), seed_count(4, 4, 8)
    (1, 2)
    """
    return int(min(copies, max(1, np.ceil(np.sqrt(copies * domains / max(gpus, 1))))))


def _relay_boxes(t: PieceTable, st: PieceTable, dom: np.ndarray, copies: int, gpus: np.ndarray
                 ) -> list[tuple[np.ndarray, int]]:
    """The boxes of one receivers table that need a relay: per box, its *members* (the rows of the
    domains that hold no source piece of the tensor, one per domain, in domain order) and how
    many of them are seeds (:func:`seed_count` of the source copies not already taken by domains
    that fetch anyway); ``copies``: :func:`_source_copies` of ``st``; ``gpus``: the receivers'
    ranks in each domain."""
    if len(t) <= copies:
        return []
    if len(t) <= SMALL_TABLES:  # a few pieces (an expert at scale): in Python, the same boxes in the same order
        return _relay_boxes_small(t, st, dom, copies, gpus)
    return _relay_boxes_large(t, st, dom, copies, gpus)


def _relay_boxes_large(t: PieceTable, st: PieceTable, dom: np.ndarray, copies: int, gpus: np.ndarray
                       ) -> list[tuple[np.ndarray, int]]:
    """:func:`_relay_boxes` with numpy: its distinct boxes in sorted order (``np.unique``)."""
    boxes = np.concatenate([t.offsets, t.sizes], axis=1)
    _, inv, counts = np.unique(boxes, axis=0, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    # a domain holding any source piece of the tensor fetches directly: no byte it holds crosses the network
    holds = np.isin(dom[t.ranks], dom[st.ranks])
    out = []
    for b in np.flatnonzero(counts > copies).tolist():
        members = np.flatnonzero((inv == b) & ~holds)
        extra = max(copies - int(((inv == b) & holds).sum()), 0)  # seeds besides the domains that fetch anyway
        if extra:
            extra = seed_count(extra, len(members), float(gpus[dom[t.ranks[members]]].mean()))
        if len(members) > extra:
            out.append((members[np.argsort(dom[t.ranks[members]], kind="stable")], extra))
    return out


def _relay_boxes_small(t: PieceTable, st: PieceTable, dom: np.ndarray, copies: int, gpus: np.ndarray
                       ) -> list[tuple[np.ndarray, int]]:
    """:func:`_relay_boxes` in Python, for a table of a few rows: the answer of :func:`_relay_boxes_large`."""
    rows_of: dict[tuple, list[int]] = {}
    for i, box in enumerate(map(tuple, np.concatenate([t.offsets, t.sizes], axis=1).tolist())):
        rows_of.setdefault(box, []).append(i)
    fetching = set(dom[st.ranks].tolist())  # domains holding a source piece fetch directly
    domain = dom[t.ranks].tolist()
    out = []
    for box in sorted(rows_of):
        rows = rows_of[box]
        if len(rows) <= copies:
            continue
        members = [i for i in rows if domain[i] not in fetching]
        extra = max(copies - (len(rows) - len(members)), 0)
        if not members:
            continue
        if extra:
            extra = seed_count(extra, len(members), sum(int(gpus[domain[i]]) for i in members) / len(members))
        if len(members) > extra:
            out.append((np.array(sorted(members, key=domain.__getitem__), np.int64), extra))
    return out


@lru_cache(maxsize=4096)
def _seed_slots(count: int, extra: int, n: int, units: int = SEED_UNITS
                ) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...], tuple[int, ...]]:
    """The ``extra`` seeds of one box for each of the ``n`` tensors of its geometry, as positions among
    its ``count`` members (least loaded first). The tensors form ``min(n, units)`` runs of consecutive
    ones (the fewer runs, the fewer seed patterns: plan geometries); the ``extra`` seed slots of each
    run (run j's k-th at ``k * runs + j``) go to the members in contiguous blocks, as even as can be,
    the first members taking the remainder. A run's seeds are distinct: a block holds at most ``runs``
    slots. The same for every box of these counts.

    Returns (per run, its seeds' positions; per tensor, its run; per run, how many tensors).

    >>> def dealt(*a, **k):
    ...     slots, run, _ = _seed_slots(3, *a, **k)
    ...     return [[(7, 8, 9)[j] for j in slots[r]] for r in run]
    >>> dealt(1, 4)                # 4 tensors over 3 members
    [[7], [7], [8], [9]]
    >>> dealt(2, 3)                # 2 seeds each, all distinct
    [[7, 8], [7, 9], [8, 9]]
    >>> dealt(1, 6, units=3)       # runs of 2 tensors
    [[7], [7], [8], [8], [9], [9]]
    """
    u = min(n, units)
    q, r = divmod(u * extra, count)
    ends = np.cumsum(q + (np.arange(count) < r))
    slots = np.arange(extra)[None, :] * u + np.arange(u)[:, None]
    run = np.arange(n) * u // max(n, 1)
    return (tuple(map(tuple, np.searchsorted(ends, slots, side="right").tolist())), tuple(run.tolist()),
            tuple(np.bincount(run, minlength=u).tolist()))


def split_relays(receivers: Layout, source: Layout, domains: Mapping[int, int]) -> tuple[Layout, Layout | None]:
    """(seeds, relayed): receivers of boxes that more domains need than the sources hold copies of
    are cut into :func:`seed_count` seeds and the rest, which take the box from a seed over the
    network instead of from a source (a training stage holding the LM head on 64 ranks, 128 TP8
    inference domains needing it: the stage sends it 32 times, not once per inference domain).
    ``relayed`` is None when no box needs it.

    A seed sends its box on to (members - seeds) / seeds domains, so seeds are chosen to balance
    those relay sends over the GPUs: biggest boxes first, each to the members with the least relay
    bytes out so far (ties: lowest rank), the tensors sharing a geometry dealt over them in up to
    ``SEED_UNITS`` runs (:func:`_seed_slots`), so that slice t of every expert does not seed on
    one GPU (its NIC would send that slice of the whole model again and again).
    """
    dom = domain_array(domains, receivers.ranks)
    gpus = np.bincount(dom[np.asarray(receivers.ranks, np.int64)]) if len(receivers.ranks) else np.zeros(0, np.int64)
    groups: dict[tuple, list[str]] = {}
    held: dict[int, bytes] = {}
    by_identity: dict[tuple, int] = {}  # tables of the same arrays: one content, looked at once
    interned: dict[tuple, int] = {}  # tensors alike by content: the plan reads what tables hold, not how
    # their arrays are shared (two processes building the same layouts differently plan alike)
    for name, t in receivers.tables.items():
        st = source.tables.get(name)
        if len(t) and st is not None and len(st):
            h = held.get(id(st.ranks))
            if h is None:  # every table stays alive while this runs: ids are unique
                h = held[id(st.ranks)] = np.unique(dom[st.ranks]).tobytes()
            ident = (id(t.ranks), id(t.offsets), id(t.sizes), id(st.offsets), id(st.sizes))  # alive meanwhile
            content = by_identity.get(ident)
            if content is None:
                content = by_identity[ident] = interned.setdefault(
                    (t.geometry_key(), st.offsets.shape, st.offsets.tobytes(), st.sizes.tobytes()), len(interned))
            key = (content, len(st), h)
            groups.setdefault(key, []).append(name)
    load = [0] * len(dom)  # relay bytes each rank sends (estimated)
    work = []  # (-bytes of the box over the group's tensors, group, box)
    found = []  # per group: (names, table, relay boxes)
    copies: dict = {}  # source tables with the same boxes hold as many copies
    relays: dict[tuple, list] = {}  # groups alike (domains of the receivers, boxes, copies, source domains)
    specs = receivers.specs
    for gi, (key, names) in enumerate(groups.items()):
        t, st = receivers.tables[names[0]], source.tables[names[0]]
        n = _source_copies(st, copies)
        alike = (t.offsets.shape, dom[t.ranks].tobytes(), t.offsets.tobytes(), t.sizes.tobytes(), n, key[-1])
        boxes = relays.get(alike)
        if boxes is None:  # its boxes' rows depend on nothing else
            boxes = relays[alike] = _relay_boxes(t, st, dom, n, gpus)
        isz = sum([itemsize(specs[n].dtype) for n in names])
        for bi, (members, _) in enumerate(boxes):
            work.append((-int(t.sizes[members[0]].prod()) * isz, gi, bi))
        found.append((names, t, boxes, []))
    work.sort()
    member_lists: dict[int, list[int]] = {}  # per members array (boxes alike share them, alive meanwhile)
    for negb, gi, bi in work:
        names, t, boxes, dealt = found[gi]
        members, extra = boxes[bi]
        rows = member_lists.get(id(members))
        if rows is None:
            rows = member_lists[id(members)] = members.tolist()
        ranks = t.ranks[members].tolist()
        order = sorted(range(len(ranks)), key=lambda x: (load[ranks[x]], ranks[x]))
        slots, run, run_sizes = _seed_slots(len(members), extra, len(names))
        per_slot = -negb * (len(members) - extra) // (len(names) * max(extra, 1))  # relay bytes one seed sends
        for run_slots, k in zip(slots, run_sizes):
            for j in run_slots:
                load[ranks[order[j]]] += per_slot * k
        seeds_of_run = [tuple([rows[order[j]] for j in run_slots]) for run_slots in slots]
        dealt.append((bi, [seeds_of_run[i] for i in run]))
    empty = np.zeros(0, np.int64)
    shared_rows: dict = {}  # restricted offsets and sizes, shared by tables alike
    cut_of: dict[str, tuple] = {}  # tensor -> (rows kept, their arrays, rows relayed, theirs)
    relays_any = False
    for names, t, boxes, dealt in found:
        if not boxes:  # no piece relayed: the tensors stay whole seeds
            continue
        dealt.sort(key=lambda o: o[0])
        index: dict[tuple, int] = {}  # each tensor's seed rows, the same patterns once
        per_tensor = (dealt[0][1] if len(dealt) == 1 else
                      [sum(rows, ()) for rows in zip(*[seeds for _, seeds in dealt])])
        which = [index.setdefault(rows, len(index)) for rows in per_tensor]
        relay_rows = tuple(row for bi, _ in dealt for row in member_lists[id(boxes[bi][0])])
        cut = []
        for pat in index:
            kr, rr = _kept_rows(len(t), relay_rows, pat)
            cut.append((kr, _rows_of(t, kr, shared_rows), rr, _rows_of(t, rr, shared_rows)))
            relays_any = relays_any or len(rr) > 0
        cut_of.update(zip(names, [cut[w] for w in which]))
    if not relays_any:
        return receivers, None
    seeds: dict[str, PieceTable] = {}
    relayed: dict[str, PieceTable] = {}
    offsets_of: dict = {}  # restricted buffer offsets, shared by tables alike
    for name, t in receivers.tables.items():  # in the receivers' order
        cut = cut_of.get(name)
        if cut is None:  # nothing relayed (or no source piece): the tensor as it is, an empty relayed part
            seeds[name] = t
            relayed[name] = _subset(t, empty, _rows_of(t, empty, shared_rows), offsets_of)
        else:
            seeds[name] = _subset(t, cut[0], cut[1], offsets_of)
            relayed[name] = _subset(t, cut[2], cut[3], offsets_of)
    return receivers.with_tables(seeds), receivers.with_tables(relayed)
