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

from .layout import LayoutError, PieceTable, box_str

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


def _cell_ranges(edges: list[np.ndarray], lo, hi) -> list[tuple[int, int]]:
    """Grid cells per dim that overlap the box [lo, hi)."""
    out = []
    for e, a, b in zip(edges, lo, hi):
        i = max(int(np.searchsorted(e, a, "right")) - 1, 0)
        j = min(int(np.searchsorted(e, b, "left")), len(e) - 1)
        out.append((i, max(i, j)))
    return out


class _Regions:
    """Disjoint source regions of one tensor with their holders, on a lookup grid."""

    def __init__(self, lo: np.ndarray, hi: np.ndarray, holders: list[np.ndarray]):
        self.lo, self.hi, self.holders = lo, hi, holders
        self.edges = _edges(lo, hi) if len(lo) else [np.zeros(1, np.int64) for _ in range(lo.shape[1])]
        shape = tuple(max(len(e) - 1, 0) for e in self.edges)
        self.cell_region = np.full(shape, -1, np.int64)
        self.overlapping = False
        for r in range(len(lo)):
            sl = tuple(slice(i, j) for i, j in _cell_ranges(self.edges, lo[r], hi[r]))
            view = self.cell_region[sl]
            if (view >= 0).any():
                self.overlapping = True
            view[...] = r

    def touching(self, lo, hi) -> np.ndarray:
        sl = tuple(slice(i, j) for i, j in _cell_ranges(self.edges, lo, hi))
        ids = np.unique(self.cell_region[sl]) if self.cell_region.size else np.zeros(0, np.int64)
        return ids[ids >= 0]


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
    """Per destination rank, disjoint boxes with the pieces that want them: (rank, lo, hi, pieces)."""
    d = dt.offsets.shape[1]
    live = np.flatnonzero((dt.sizes > 0).all(axis=1))
    keys = np.concatenate([dt.ranks[live, None], dt.offsets[live], dt.offsets[live] + dt.sizes[live]], axis=1)
    rows, groups = _unique_rows(keys)
    by_rank: dict[int, list[int]] = {}
    for i, r in enumerate(rows[:, 0].tolist()):
        by_rank.setdefault(r, []).append(i)
    out = []
    for r, idx in by_rank.items():
        lo, hi = rows[idx, 1:1 + d], rows[idx, 1 + d:]
        pieces = [live[groups[i]] for i in idx]
        if len(idx) > 1 and _any_overlap(lo, hi):
            lo, hi, pieces = _cut_into_cells(lo, hi, pieces)
        out.extend((r, lo[j], hi[j], pieces[j]) for j in range(len(lo)))
    return out


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
    kind, dst_piece, source, offs, sizes, cstart, ccount, cands = [], [], [], [], [], [], [], []
    for rank, lo, hi, pieces in _needs(dt):
        primary = int(pieces[0])
        covered = 0
        for reg in regions.touching(lo, hi).tolist():
            ilo = np.maximum(lo, regions.lo[reg])
            ihi = np.minimum(hi, regions.hi[reg])
            if (ihi <= ilo).any():
                continue
            covered += int(np.prod(ihi - ilo))
            holders = regions.holders[reg]
            holder_ranks = st.ranks[holders]
            mine = holders[holder_ranks == rank]
            offs.append(ilo)
            sizes.append(ihi - ilo)
            dst_piece.append(primary)
            if len(mine):
                kind.append(LOCAL)
                source.append(int(mine[0]))
                cstart.append(len(cands))
                ccount.append(0)
            else:
                _, first = np.unique(holder_ranks, return_index=True)  # one candidate piece per rank
                kind.append(REMOTE)
                source.append(-1)
                cstart.append(len(cands))
                ccount.append(len(first))
                cands.extend(holders[np.sort(first)].tolist())
        if covered != int(np.prod(hi - lo)):
            missing = _uncovered(lo, hi, regions)
            raise LayoutError(
                f"tensor {name!r} rank {rank}: destination box {box_str(lo, hi - lo)} is not fully held by any "
                f"source; uncovered: {', '.join(missing)}"
            )
        for other in pieces[1:].tolist():
            kind.append(FANOUT)
            source.append(primary)
            dst_piece.append(int(other))
            offs.append(lo)
            sizes.append(hi - lo)
            cstart.append(len(cands))
            ccount.append(0)
    items = TensorItems(
        np.array(kind, np.int8), np.array(dst_piece, np.int64), np.array(source, np.int64),
        np.array(offs, np.int64).reshape(-1, d), np.array(sizes, np.int64).reshape(-1, d),
        np.array(cstart, np.int64), np.array(ccount, np.int64), np.array(cands, np.int64),
    )
    return _coalesce(items) if regions.overlapping else items


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
