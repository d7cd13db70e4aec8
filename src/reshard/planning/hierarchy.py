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
of it (:func:`split_relays`): the sources send it to as many *seed* domains as they hold
copies, and the seeds' receivers send it on to the other domains' over the network, whose
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

from dataclasses import dataclass
from functools import cached_property
from typing import Mapping

import numpy as np

from ..gc_pause import without_gc
from ..layout import Layout, PieceTable, Repeated, read_only
from ..tensors import itemsize
from .plan import Plan, domain_array

AUTO = "auto"
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
        return "".join(p.fingerprint() for p in self.phases)

    def summary(self) -> dict:
        out = {name: p.summary() for name, p in zip(self.phase_names, self.phases)}
        out["cross_domain_bytes"] = sum(self.cross_domain_bytes.values())
        return out


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
    for name, t in destination.tables.items():
        if not len(t):
            continue
        found = destination.buffer_dtypes(name)
        key = (t.geometry_key(), found.uniform.itemsize) if found.uniform is not None else (name,)
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
        total = sum(int((t.sizes.prod(axis=1)).sum()) * itemsize(receivers.specs[n].dtype)
                    for n, t in receivers.tables.items() if len(t))
        split_bytes = max(total // (8 * max(len(source.ranks), 1)), 1)
    if split_bytes is not None:
        receivers = split_across_replicas(receivers, source, int(split_bytes))
    seeds, relayed = split_relays(receivers, source, domains) if relay else (receivers, None)
    network = Plan(source, seeds, max_bucket_bytes=max_bucket_bytes, domains=domains)
    relay_plan = None if relayed is None else Plan(seeds, relayed, max_bucket_bytes=max_bucket_bytes, domains=domains)
    forward = Plan(receivers, rest, max_bucket_bytes=max_bucket_bytes, domains=domains)
    return HierarchicalPlan(source, destination, network, forward, domains, relay_plan)


def _source_copies(st: PieceTable, cache: dict | None = None) -> int:
    """How many copies of each region the source holds (pieces per distinct box); ``cache``: see
    :meth:`PieceTable.box_copies`."""
    return len(st) // max(len(st.box_copies(cache)[1]), 1)


def _with_tables(layout: Layout, tables: Mapping[str, PieceTable]) -> Layout:
    """``layout``'s specs and buffers with other (subset) tables; not validated: they come from it."""
    return Layout(layout.specs, tables, {r: layout.buffers(r) for r in layout.ranks}, validate=False)


def _rows_of(t: PieceTable, rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """Read-only ranks, offsets, sizes of ``rows``: shared by the tables of every tensor with
    this geometry and receiver choice (the planner then sees one geometry by identity)."""
    return read_only((t.ranks[rows], t.offsets[rows], t.sizes[rows]))


def _subset(t: PieceTable, rows: np.ndarray, shared: tuple[np.ndarray, ...]) -> PieceTable:
    """``t`` restricted to ``rows`` (whose ranks/offsets/sizes are ``shared``)."""
    b = t.one_buffer()
    names = Repeated(b, len(rows)) if b is not None else tuple(t.buffers[r] for r in rows.tolist())
    return PieceTable(*shared, names, t.buffer_offsets[rows])


def split_receivers(destination: Layout, domains: Mapping[int, int]) -> tuple[Layout, Layout]:
    """(receivers, rest): ``destination``'s pieces split so that within each domain every distinct
    box is in ``receivers`` once; ``rest`` holds the other copies, to be forwarded over NVLink.

    Receivers are chosen like sources: biggest boxes first, each to the rank of the domain with
    the least bytes coming in so far; tensors sharing a geometry are dealt round-robin.
    """
    dom = domain_array(domains, destination.ranks)
    by_geometry: dict[bytes, list[str]] = {}
    for name, t in destination.tables.items():
        if len(t):
            by_geometry.setdefault(t.geometry_key(), []).append(name)
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
    for gi, (names, t, single, clusters) in enumerate(geoms):
        cache: dict[tuple[int, ...], tuple] = {}
        for i, name in enumerate(names):
            chosen = tuple(dealt[(gi, ci)][i % len(dealt[(gi, ci)])] for ci in range(len(clusters)))
            hit = cache.get(chosen)
            if hit is None:
                keep = single.copy()
                keep[list(chosen)] = True
                kr, rr = np.flatnonzero(keep), np.flatnonzero(~keep)
                hit = cache[chosen] = (kr, _rows_of(t, kr), rr, _rows_of(t, rr))
            own = destination.tables[name]
            rec_tables[name] = _subset(own, hit[0], hit[1])
            rest_tables[name] = _subset(own, hit[2], hit[3])
    return _with_tables(destination, rec_tables), _with_tables(destination, rest_tables)


def split_across_replicas(receivers: Layout, source: Layout, split_bytes: int) -> Layout:
    """``receivers`` with each piece of at least ``split_bytes`` cut along its first dim of size
    >= 2 into one part per source replica of its tensor (so the planner can take each part
    from another replica)."""
    tables = dict(receivers.tables)
    copies: dict = {}  # source tables with the same boxes hold as many copies
    for name, t in receivers.tables.items():
        if not len(t):
            continue
        st = source.tables[name]
        replicas = _source_copies(st, copies)
        if replicas < 2:
            continue
        nbytes = t.sizes.prod(axis=1) * itemsize(receivers.specs[name].dtype)
        big = np.flatnonzero(nbytes >= split_bytes)
        if not len(big):
            continue
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
        tables[name] = PieceTable(t.ranks[idx], offsets, sizes, tuple(t.buffers[i] for i in idx.tolist()), boffs)
    return _with_tables(receivers, tables)


def _relay_boxes(t: PieceTable, st: PieceTable, dom: np.ndarray, copies: int) -> list[tuple[np.ndarray, int]]:
    """The boxes of one receivers table that need a relay: per box, its *members* (the rows of the
    domains that hold no source piece of the tensor, one per domain, in domain order) and how
    many of them are seeds (the source copies not already taken by domains that fetch anyway);
    ``copies``: :func:`_source_copies` of ``st``."""
    if len(t) <= copies:
        return []
    boxes = np.concatenate([t.offsets, t.sizes], axis=1)
    _, inv, counts = np.unique(boxes, axis=0, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    # a domain holding any source piece of the tensor fetches directly: no byte it holds crosses the network
    holds = np.isin(dom[t.ranks], dom[st.ranks])
    out = []
    for b in np.flatnonzero(counts > copies).tolist():
        members = np.flatnonzero((inv == b) & ~holds)
        extra = max(copies - int(((inv == b) & holds).sum()), 0)  # seeds besides the domains that fetch anyway
        if len(members) > extra:
            out.append((members[np.argsort(dom[t.ranks[members]], kind="stable")], extra))
    return out


def _dealt_seeds(members: np.ndarray, extra: int, n: int, units: int = SEED_UNITS
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The ``extra`` seed rows of one box for each of the ``n`` tensors of its geometry, from
    ``members`` least loaded first. The tensors form ``min(n, units)`` runs of consecutive ones (the fewer
    runs, the fewer seed patterns: plan geometries); the ``extra`` seed slots of each run (run j's
    k-th at ``k * runs + j``) go to the members in contiguous blocks, as even as can be, the first
    members taking the remainder. A run's seeds are distinct: a block holds at most ``runs`` slots.

    Returns (seeds of each run ``[runs, extra]``, the run of each tensor ``[n]``).

    >>> def dealt(*a, **k):
    ...     seeds, run = _dealt_seeds(np.array([7, 8, 9]), *a, **k)
    ...     return seeds[run].tolist()
    >>> dealt(1, 4)                # 4 tensors over 3 members
    [[7], [7], [8], [9]]
    >>> dealt(2, 3)                # 2 seeds each, all distinct
    [[7, 8], [7, 9], [8, 9]]
    >>> dealt(1, 6, units=3)       # runs of 2 tensors
    [[7], [7], [8], [8], [9], [9]]
    """
    c, u = len(members), min(n, units)
    q, r = divmod(u * extra, c)
    ends = np.cumsum(q + (np.arange(c) < r))
    slots = np.arange(extra)[None, :] * u + np.arange(u)[:, None]
    return members[np.searchsorted(ends, slots, side="right")], np.arange(n) * u // max(n, 1)


def split_relays(receivers: Layout, source: Layout, domains: Mapping[int, int]) -> tuple[Layout, Layout | None]:
    """(seeds, relayed): receivers of boxes that more domains need than the sources hold copies of
    are cut into as many seeds as there are copies and the rest, which take the box from a seed
    over the network instead of from a source (a training stage holding the LM head on 64 ranks
    then sends it 64 times, not once per inference domain). ``relayed`` is None when no box needs it.

    A seed sends its box on to (members - seeds) / seeds domains, so seeds are chosen to balance
    those relay sends over the GPUs: biggest boxes first, each to the members with the least relay
    bytes out so far (ties: lowest rank), the tensors sharing a geometry dealt over them in up to
    ``SEED_UNITS`` runs (:func:`_dealt_seeds`), so that slice t of every expert does not seed on
    one GPU (its NIC would send that slice of the whole model again and again).
    """
    dom = domain_array(domains, receivers.ranks)
    groups: dict[tuple, list[str]] = {}
    held: dict[int, bytes] = {}
    for name, t in receivers.tables.items():
        st = source.tables.get(name)
        if len(t) and st is not None and len(st):
            h = held.get(id(st.ranks))
            if h is None:  # every table stays alive while this runs: ids are unique
                h = held[id(st.ranks)] = np.unique(dom[st.ranks]).tobytes()
            key = (id(t.ranks), id(t.offsets), id(t.sizes), id(st.offsets), id(st.sizes), len(st), h)
            groups.setdefault(key, []).append(name)
    load = [0] * len(dom)  # relay bytes each rank sends (estimated)
    work = []  # (-bytes of the box over the group's tensors, group, box)
    found = []  # per group: (names, table, relay boxes)
    copies: dict = {}  # source tables with the same boxes hold as many copies
    relays: dict[tuple, list] = {}  # groups alike (domains of the receivers, boxes, copies, source domains)
    for gi, (key, names) in enumerate(groups.items()):
        t, st = receivers.tables[names[0]], source.tables[names[0]]
        n = _source_copies(st, copies)
        alike = (t.offsets.shape, dom[t.ranks].tobytes(), t.offsets.tobytes(), t.sizes.tobytes(), n, key[-1])
        boxes = relays.get(alike)
        if boxes is None:  # its boxes' rows depend on nothing else
            boxes = relays[alike] = _relay_boxes(t, st, dom, n)
        isz = sum(itemsize(receivers.specs[n].dtype) for n in names)
        for bi, (members, _) in enumerate(boxes):
            work.append((-int(t.sizes[members[0]].prod()) * isz, gi, bi))
        found.append((names, t, boxes, []))
    work.sort()
    for negb, gi, bi in work:
        names, t, boxes, dealt = found[gi]
        members, extra = boxes[bi]
        ranks = t.ranks[members].tolist()
        order = sorted(range(len(ranks)), key=lambda x: (load[ranks[x]], ranks[x]))
        seeds_of_run, run = _dealt_seeds(members[order], extra, len(names))
        per_slot = -negb * (len(members) - extra) // (len(names) * max(extra, 1))  # relay bytes one seed sends
        for row_seeds, k in zip(t.ranks[seeds_of_run].tolist(), np.bincount(run).tolist()):
            for r in row_seeds:
                load[r] += per_slot * k
        dealt.append((bi, seeds_of_run[run]))
    seeds: dict[str, PieceTable] = {}
    relayed: dict[str, PieceTable] = {}
    empty = np.zeros(0, np.int64)
    for names, t, boxes, dealt in found:
        if not boxes:
            for name in names:
                seeds[name] = receivers.tables[name]
                relayed[name] = _subset(receivers.tables[name], empty, _rows_of(t, empty))
            continue
        dealt.sort(key=lambda o: o[0])
        patterns, which = np.unique(np.concatenate([rows for _, rows in dealt], axis=1), axis=0, return_inverse=True)
        which = which.reshape(-1)
        relay_rows = np.concatenate([boxes[bi][0] for bi, _ in dealt])
        cut = []
        for pat in patterns:
            keep = np.ones(len(t), bool)
            keep[relay_rows] = False
            keep[pat] = True
            kr, rr = np.flatnonzero(keep), np.flatnonzero(~keep)
            cut.append((kr, _rows_of(t, kr), rr, _rows_of(t, rr)))
        for name, w in zip(names, which.tolist()):
            own = receivers.tables[name]
            seeds[name] = _subset(own, cut[w][0], cut[w][1])
            relayed[name] = _subset(own, cut[w][2], cut[w][3])
    if all(not len(t) for t in relayed.values()):
        return receivers, None
    for name, t in receivers.tables.items():  # in the receivers' order; tensors with no source piece as they are
        seeds[name] = seeds.pop(name, t)
        relayed[name] = relayed.pop(name) if name in relayed else _subset(t, empty, _rows_of(t, empty))
    return _with_tables(receivers, seeds), _with_tables(receivers, relayed)
