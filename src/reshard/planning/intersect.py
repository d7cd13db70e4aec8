"""Box intersections of one tensor's source and destination pieces.

The planner calls :func:`tensor_items` once per *geometry* (a tensor's shape plus the
ranks and boxes of its pieces on both sides); tensors that share a geometry (every
layer's ``q_proj``, say) share the result.

Method, never all pairs of pieces:

1. Source pieces with identical boxes are replicas of one *region*. Regions of real
   layouts are disjoint; when they are not (hand-made layouts), they are cut into the
   cells of the grid their edges make, each cell held by every piece covering it.
2. The regions' edges make a grid per dim; a dense array maps each grid cell to its
   region. A destination box finds the regions it touches by ``searchsorted`` on each
   dim and a slice of that array, then intersects with each of them.
3. Destination pieces of one rank with the same box are filled once (the *primary*)
   and copied locally to the others (*fan-out*), so an element crosses the wire once
   per rank.

Every result item is one box of the tensor: a *local* copy (the destination rank
holds a source replica), a *remote* copy with its candidate source pieces, or a
*fan-out* copy between two destination pieces of one rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ..layout import PieceTable
from ..tensors import LayoutError, box_str

LOCAL, REMOTE, FANOUT = 0, 1, 2
KIND_NAMES = {LOCAL: "local", REMOTE: "remote", FANOUT: "fanout"}


@dataclass(frozen=True, eq=False)
class TensorItems:
    """The copies one tensor geometry needs (row i = item i).

    ``source`` is a source piece index for local items, a destination (primary) piece
    index for fan-out items, and -1 for remote items, whose candidate source pieces are
    ``candidates[cand_start[i]: cand_start[i] + cand_count[i]]`` (one per rank).
    """

    kind: np.ndarray  # int8 [n]
    dst_piece: np.ndarray  # int64 [n]
    source: np.ndarray  # int64 [n]
    offsets: np.ndarray  # int64 [n, ndim]
    sizes: np.ndarray  # int64 [n, ndim]
    cand_start: np.ndarray  # int64 [n]
    cand_count: np.ndarray  # int64 [n]
    candidates: np.ndarray  # int64 [total candidates]

    def __len__(self) -> int:
        return len(self.kind)


def _unique_rows(a: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Unique rows (sorted) and, for each, the indices of ``a`` equal to it (ascending)."""
    if len(a) == 0:
        return a, []
    uniq, inv = np.unique(a, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    order = np.argsort(inv, kind="stable")
    bounds = np.searchsorted(inv[order], np.arange(len(uniq) + 1))
    return uniq, [order[bounds[i]: bounds[i + 1]] for i in range(len(uniq))]


def _edges(lo: np.ndarray, hi: np.ndarray) -> list[np.ndarray]:
    return [np.unique(np.concatenate([lo[:, d], hi[:, d]])) for d in range(lo.shape[1])]


def _cell_ranges(edges: list[np.ndarray], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per box and dim, the half-open range of grid cells overlapping boxes [lo, hi): ``[n, ndim, 2]``."""
    out = np.zeros((len(lo), len(edges), 2), np.int64)
    for k, e in enumerate(edges):
        out[:, k, 0] = np.maximum(np.searchsorted(e, lo[:, k], "right") - 1, 0)
        out[:, k, 1] = np.minimum(np.searchsorted(e, hi[:, k], "left"), len(e) - 1)
    return out


def _expand_ranges(ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of per-dim cell ranges ``[n, ndim, 2]``: (row index, cell coords [m, ndim]) of every cell."""
    n, d, _ = ranges.shape
    owner = np.arange(n)
    coords = np.zeros((n, 0), np.int64)
    for k in range(d):
        lo, hi = ranges[owner, k, 0], ranges[owner, k, 1]
        count = np.maximum(hi - lo, 0)
        rep = np.repeat(np.arange(len(owner)), count)
        step = np.arange(len(rep)) - np.repeat(np.cumsum(count) - count, count)
        coords = np.concatenate([coords[rep], (lo[rep] + step)[:, None]], axis=1)
        owner = owner[rep]
    return owner, coords


class _Regions:
    """Disjoint source regions of one tensor with their holders, on a lookup grid."""

    def __init__(self, lo: np.ndarray, hi: np.ndarray, holders: list[np.ndarray]):
        self.lo, self.hi, self.holders = lo, hi, holders
        self.edges = _edges(lo, hi) if len(lo) else [np.zeros(1, np.int64) for _ in range(lo.shape[1])]
        shape = tuple(max(len(e) - 1, 0) for e in self.edges)
        self.cell_region = np.full(shape, -1, np.int64)
        owner, coords = _expand_ranges(_cell_ranges(self.edges, lo, hi))
        flat = np.ravel_multi_index(tuple(coords.T), shape) if len(shape) else np.zeros(len(owner), np.int64)
        self.overlapping = len(np.unique(flat)) < len(flat)
        self.cell_region.reshape(-1)[flat] = owner


def _source_regions(st: PieceTable) -> _Regions:
    lo = st.offsets
    hi = st.offsets + st.sizes
    live = np.flatnonzero((st.sizes > 0).all(axis=1))
    boxes, groups = _unique_rows(np.concatenate([lo[live], hi[live]], axis=1))
    d = lo.shape[1]
    holders = [live[g] for g in groups]
    regions = _Regions(boxes[:, :d], boxes[:, d:], holders)
    if not regions.overlapping:
        return regions
    # Partially overlapping source boxes: cut into grid cells, each held by all covering boxes.
    edges = regions.edges
    cell_lo, cell_hi, cell_holders = [], [], []
    for cell in itertools.product(*(range(len(e) - 1) for e in edges)):
        clo = np.array([e[c] for e, c in zip(edges, cell)], np.int64)
        chi = np.array([e[c + 1] for e, c in zip(edges, cell)], np.int64)
        cover = np.flatnonzero(((boxes[:, :d] <= clo) & (boxes[:, d:] >= chi)).all(axis=1))
        if len(cover):
            cell_lo.append(clo)
            cell_hi.append(chi)
            cell_holders.append(np.sort(np.concatenate([holders[i] for i in cover])))
    return _Regions(np.array(cell_lo, np.int64).reshape(-1, d), np.array(cell_hi, np.int64).reshape(-1, d),
                    cell_holders)


def _needs(dt: PieceTable):
    """Per destination rank, disjoint boxes and the pieces that want them.

    Returns ``rank [n]``, ``lo [n, d]``, ``hi [n, d]`` and a list of piece-index arrays
    (the first piece of each is the primary one).
    """
    d = dt.offsets.shape[1]
    live = np.flatnonzero((dt.sizes > 0).all(axis=1))
    keys = np.concatenate([dt.ranks[live, None], dt.offsets[live], dt.offsets[live] + dt.sizes[live]], axis=1)
    rows, groups = _unique_rows(keys)
    rows = rows.reshape(-1, 1 + 2 * d)
    pieces = [live[g] for g in groups]
    ranks, first, counts = np.unique(rows[:, 0], return_index=True, return_counts=True)
    crowded = [(int(a), int(a + c)) for a, c in zip(first, counts) if c > 1]
    if not any(_any_overlap(rows[a:b, 1:1 + d], rows[a:b, 1 + d:]) for a, b in crowded):
        return rows[:, 0], rows[:, 1:1 + d], rows[:, 1 + d:], pieces
    out_r, out_lo, out_hi, out_p = [], [], [], []
    for a, c in zip(first.tolist(), counts.tolist()):
        lo, hi, ps = rows[a:a + c, 1:1 + d], rows[a:a + c, 1 + d:], pieces[a:a + c]
        if c > 1 and _any_overlap(lo, hi):
            lo, hi, ps = _cut_into_cells(lo, hi, ps)
        out_r.extend([rows[a, 0]] * len(lo))
        out_lo.extend(lo)
        out_hi.extend(hi)
        out_p.extend(ps)
    return (np.array(out_r, np.int64), np.array(out_lo, np.int64).reshape(-1, d),
            np.array(out_hi, np.int64).reshape(-1, d), out_p)


def _any_overlap(lo: np.ndarray, hi: np.ndarray) -> bool:
    ov = ((lo[:, None] < hi[None]) & (lo[None] < hi[:, None])).all(axis=2)
    np.fill_diagonal(ov, False)
    return bool(ov.any())


def _cut_into_cells(lo, hi, pieces):
    edges = _edges(lo, hi)
    out_lo, out_hi, out_p = [], [], []
    for cell in itertools.product(*(range(len(e) - 1) for e in edges)):
        clo = np.array([e[c] for e, c in zip(edges, cell)], np.int64)
        chi = np.array([e[c + 1] for e, c in zip(edges, cell)], np.int64)
        cover = np.flatnonzero(((lo <= clo) & (hi >= chi)).all(axis=1))
        if len(cover):
            out_lo.append(clo)
            out_hi.append(chi)
            out_p.append(np.sort(np.concatenate([pieces[i] for i in cover])))
    return np.array(out_lo), np.array(out_hi), out_p


def _uncovered(lo, hi, regions: _Regions, limit: int = 3) -> list[str]:
    """Up to ``limit`` boxes inside [lo, hi) that no source region covers."""
    cut = [np.unique(np.concatenate([e[(e > a) & (e < b)], [a, b]])) for e, a, b in zip(regions.edges, lo, hi)]
    out = []
    for cell in itertools.product(*(range(len(c) - 1) for c in cut)):
        clo = np.array([c[i] for c, i in zip(cut, cell)])
        chi = np.array([c[i + 1] for c, i in zip(cut, cell)])
        covered = len(regions.lo) and ((regions.lo <= clo) & (regions.hi >= chi)).all(axis=1).any()
        if not covered:
            out.append(box_str(clo, chi - clo))
            if len(out) >= limit:
                break
    return out


def tensor_items(name: str, st: PieceTable, dt: PieceTable) -> TensorItems:
    """All copies that fill ``dt``'s pieces from ``st``'s (see module doc).

    Raises :class:`LayoutError` naming the tensor, rank and box of the first
    destination piece that no source covers.
    """
    d = dt.offsets.shape[1]
    regions = _source_regions(st)
    need_rank, need_lo, need_hi, need_pieces = _needs(dt)
    n_need = len(need_rank)
    # which regions each need touches: cells of the region grid, then their region ids
    ranges = _cell_ranges(regions.edges, need_lo, need_hi)
    owner, cells = _expand_ranges(ranges)
    reg = regions.cell_region[tuple(cells.T)] if d else np.broadcast_to(regions.cell_region, owner.shape)
    keep = reg >= 0
    n_reg = max(len(regions.lo), 1)
    pair = np.unique(owner[keep] * n_reg + reg[keep])
    need_of, reg_of = pair // n_reg, pair % n_reg
    ilo = np.maximum(need_lo[need_of], regions.lo[reg_of])
    ihi = np.minimum(need_hi[need_of], regions.hi[reg_of])
    live = (ihi > ilo).all(axis=1)
    need_of, reg_of, ilo, ihi = need_of[live], reg_of[live], ilo[live], ihi[live]
    covered = np.bincount(need_of, weights=np.prod(ihi - ilo, axis=1), minlength=n_need)
    short = np.flatnonzero(covered != np.prod(need_hi - need_lo, axis=1))
    if len(short):
        i = int(short[0])
        missing = _uncovered(need_lo[i], need_hi[i], regions)
        raise LayoutError(
            f"tensor {name!r} rank {int(need_rank[i])}: destination box {box_str(need_lo[i], need_hi[i] - need_lo[i])} "
            f"is not fully held by any source; uncovered: {', '.join(missing)}"
        )
    # candidate source pieces per region, one per rank, as CSR; and (region, rank) -> local piece
    width = int(max(st.ranks.max(initial=0), dt.ranks.max(initial=0))) + 1
    candidates, counts, lk = _candidates(regions.holders, st.ranks, width)
    starts = np.cumsum(counts) - counts
    lp = candidates
    order = np.argsort(lk, kind="stable")
    lk, lp = lk[order], lp[order]
    want = reg_of * width + need_rank[need_of]
    pos = np.minimum(np.searchsorted(lk, want), max(len(lk) - 1, 0))
    is_local = (lk[pos] == want) if len(lk) else np.zeros(len(want), bool)
    primary, fan_need, fan_piece = _fan_out(need_pieces)
    kind = np.where(is_local, LOCAL, REMOTE).astype(np.int8)
    source = np.where(is_local, lp[pos] if len(lp) else -1, -1)
    cstart = starts[reg_of]
    ccount = np.where(is_local, 0, counts[reg_of])
    n_fan = len(fan_need)
    items = TensorItems(
        np.concatenate([kind, np.full(n_fan, FANOUT, np.int8)]),
        np.concatenate([primary[need_of], fan_piece]),
        np.concatenate([source, primary[fan_need]]),
        np.concatenate([ilo, need_lo[fan_need]]).reshape(-1, d),
        np.concatenate([ihi - ilo, need_hi[fan_need] - need_lo[fan_need]]).reshape(-1, d),
        np.concatenate([cstart, np.zeros(n_fan, np.int64)]),
        np.concatenate([ccount, np.zeros(n_fan, np.int64)]),
        candidates,
    )
    return _coalesce(items) if regions.overlapping else items


def _candidates(holders: list[np.ndarray], ranks: np.ndarray, width: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per region, its holder pieces one per rank (the first piece of each rank, in holder order),
    all regions at once: (candidate pieces, how many per region, region * width + rank of each)."""
    if not holders:
        none = np.zeros(0, np.int64)
        return none, none, none
    flat = np.concatenate(holders).astype(np.int64)
    region = np.repeat(np.arange(len(holders), dtype=np.int64), [len(h) for h in holders])
    keys = region * width + ranks[flat]
    _, first = np.unique(keys, return_index=True)
    first = np.sort(first)  # by region (holders are concatenated region by region), then holder order
    return flat[first], np.bincount(region[first], minlength=len(holders)).astype(np.int64), keys[first]


def _fan_out(need_pieces: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(primary piece of each need, the need and the piece of each extra piece: fan-out copies)."""
    if not need_pieces:
        none = np.zeros(0, np.int64)
        return none, none, none
    lens = np.array([len(p) for p in need_pieces], np.int64)
    flat = np.concatenate(need_pieces).astype(np.int64)
    starts = np.cumsum(lens) - lens
    extra = np.ones(len(flat), bool)
    extra[starts] = False
    return flat[starts], np.repeat(np.arange(len(lens), dtype=np.int64), lens - 1), flat[extra]


def _coalesce(items: TensorItems) -> TensorItems:
    """Merge items that differ only in being adjacent along one dim (after cell cutting)."""
    rows = []
    for i in range(len(items)):
        c = items.candidates[items.cand_start[i]: items.cand_start[i] + items.cand_count[i]]
        rows.append([int(items.kind[i]), int(items.dst_piece[i]), int(items.source[i]), tuple(c.tolist()),
                     items.offsets[i].copy(), items.sizes[i].copy()])
    ndim = items.offsets.shape[1]
    changed = True
    while changed:
        changed = False
        for dim in range(ndim):
            others = [k for k in range(ndim) if k != dim]

            def key(r):
                return (r[0], r[1], r[2], r[3], tuple(r[4][others]), tuple(r[5][others]), int(r[4][dim]))

            rows.sort(key=key)
            merged = []
            for r in rows:
                if merged:
                    p = merged[-1]
                    if (key(p)[:6] == key(r)[:6]) and p[4][dim] + p[5][dim] == r[4][dim]:
                        p[5][dim] += r[5][dim]
                        changed = True
                        continue
                merged.append(r)
            rows = merged
    rows.sort(key=lambda r: (r[1], tuple(r[4]), r[0]))
    cands: list[int] = []
    cstart, ccount = [], []
    for r in rows:
        cstart.append(len(cands))
        ccount.append(len(r[3]))
        cands.extend(r[3])
    return TensorItems(
        np.array([r[0] for r in rows], np.int8), np.array([r[1] for r in rows], np.int64),
        np.array([r[2] for r in rows], np.int64), np.array([r[4] for r in rows], np.int64).reshape(-1, ndim),
        np.array([r[5] for r in rows], np.int64).reshape(-1, ndim), np.array(cstart, np.int64),
        np.array(ccount, np.int64), np.array(cands, np.int64),
    )
