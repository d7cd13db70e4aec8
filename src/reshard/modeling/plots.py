"""Pictures of a refit: bytes per (source, destination) pair, and the load on every link.

Two PNGs (matplotlib, Agg backend: no display needed):

- :func:`plot_pair_bytes`: a heat map, source ranks down, destination ranks across,
  colour = bytes (log scale, blank = nothing). Above ``max_cells`` ranks a side, ranks
  are grouped into blocks of consecutive ranks (one per node when that fits) and a
  cell shows the block's total.
- :func:`plot_link_load`: per GPU, the seconds each link kind needs at its bandwidth
  (NIC out, NIC in, NVLink out, NVLink in; from a :class:`~reshard.modeling.traffic.Traffic`),
  the bottleneck marked. Above ``max_bars`` GPUs, bars show the busiest GPU of each
  block (node or domain).

>>> from reshard.modeling.topology import Placement, Topology
>>> from reshard.modeling.traffic import traffic_from_pairs
>>> place = Placement.contiguous(Topology.preset("dgx-h100"), 2, 2)
>>> tr = traffic_from_pairs([{(0, 2): 10**9, (1, 3): 10**9}], place)
>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> plot_pair_bytes({(0, 2): 10**9, (1, 3): 10**9}, d / "pairs.png").stat().st_size > 1000
True
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .estimate import Estimate
from .topology import Placement, Topology
from .traffic import LINK_LABEL, LINKS, Traffic


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, imported on the first plot (not with the modeling
    package: a command that draws nothing does not pay for it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

_COLORS = {"nic_out": "#1f77b4", "nic_in": "#ff7f0e", "nvlink_out": "#2ca02c", "nvlink_in": "#9467bd"}


def _unit(nbytes: float) -> tuple[float, str]:
    for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if nbytes >= scale:
            return scale, name
    return 1.0, "B"


def _blocks(ranks: Sequence[int], max_cells: int, prefer: int | None) -> list[list[int]]:
    """Consecutive groups of ``ranks`` (at most ``max_cells`` of them); ``prefer`` ranks a block if it fits."""
    ranks = list(ranks)
    if len(ranks) <= max_cells:
        return [[r] for r in ranks]
    size = prefer if prefer and -(-len(ranks) // prefer) <= max_cells else -(-len(ranks) // max_cells)
    return [ranks[i:i + size] for i in range(0, len(ranks), size)]


def _label(block: list[int]) -> str:
    return str(block[0]) if len(block) == 1 else f"{block[0]}-{block[-1]}"


def _tick_every(n: int, target: int = 32) -> int:
    return max(1, -(-n // target))


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Lay ``fig`` out, write it to ``path`` (folders made as needed), close it; the path."""
    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def plot_pair_bytes(pair_bytes: Mapping[tuple[int, int], float], path: str | Path, *,
                    sources: Sequence[int] | None = None, destinations: Sequence[int] | None = None,
                    title: str = "bytes per (source, destination) pair", max_cells: int = 64,
                    block: int | None = None) -> Path:
    """Heat map of ``{(src, dst): bytes}`` written to ``path`` (PNG); returns the path.

    ``sources`` / ``destinations`` default to the ranks that appear; ``block`` is the
    preferred group size when there are more than ``max_cells`` ranks (e.g. GPUs per node).
    """
    path = Path(path)
    srcs = sorted(sources if sources is not None else {s for s, _ in pair_bytes})
    dsts = sorted(destinations if destinations is not None else {d for _, d in pair_bytes})
    sb, db = _blocks(srcs, max_cells, block), _blocks(dsts, max_cells, block)
    row = {r: i for i, b in enumerate(sb) for r in b}
    col = {r: j for j, b in enumerate(db) for r in b}
    grid = np.zeros((len(sb), len(db)))
    for (s, d), b in pair_bytes.items():
        if s in row and d in col:
            grid[row[s], col[d]] += b
    total = grid.sum()
    scale, unit = _unit(grid.max() if grid.size else 0.0)
    fig, ax = pyplot().subplots(figsize=(min(4 + 0.18 * len(db), 16), min(3 + 0.16 * len(sb), 14)))
    shown = np.ma.masked_where(grid <= 0, grid / scale)
    if shown.count():
        lo, hi = shown.min(), shown.max()
        from matplotlib.colors import LogNorm

        norm = LogNorm(vmin=lo, vmax=hi) if hi > lo else None
        im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap="viridis", norm=norm)
        fig.colorbar(im, ax=ax, label=f"{unit} per {'block pair' if len(sb) < len(srcs) or len(db) < len(dsts) else 'pair'}")
    else:
        ax.imshow(np.zeros_like(grid), aspect="auto", cmap="Greys", vmin=0, vmax=1)
    for axis, blocks, setter, labels in ((ax.yaxis, sb, ax.set_yticks, ax.set_yticklabels),
                                         (ax.xaxis, db, ax.set_xticks, ax.set_xticklabels)):
        every = _tick_every(len(blocks))
        idx = list(range(0, len(blocks), every))
        setter(idx)
        labels([_label(blocks[i]) for i in idx], fontsize=7, rotation=90 if axis is ax.xaxis else 0)
    grouped = len(sb) < len(srcs) or len(db) < len(dsts)
    ax.set_ylabel("source rank" + (" (blocks of consecutive ranks)" if grouped else ""))
    ax.set_xlabel("destination rank" + (" (blocks of consecutive ranks)" if grouped else ""))
    tscale, tunit = _unit(total)
    nz = sum(1 for v in pair_bytes.values() if v > 0)
    ax.set_title(f"{title}\n{len(srcs)} sources -> {len(dsts)} destinations, {nz:,} pairs send, "
                 f"{total / tscale:.3g} {tunit} in all", fontsize=10)
    return save_figure(fig, path)


def plot_link_load(traffic: Traffic, path: str | Path, topology: Topology | None = None, *,
                   estimate: Estimate | None = None, title: str = "link load per GPU",
                   max_bars: int = 64) -> Path:
    """Bars of each GPU's seconds on NIC out/in and NVLink out/in (bytes / bandwidth), all phases
    summed, with the bottleneck marked; written to ``path`` (PNG). GPUs that hold no rank are left
    out; above ``max_bars`` GPUs, each bar is the busiest GPU of a node (or domain) block."""
    path = Path(path)
    place: Placement = traffic.placement
    topo = topology or place.topology
    gpus = place.used_gpus()
    bw = {"nic_out": topo.nic_bytes_per_s, "nic_in": topo.nic_bytes_per_s,
          "nvlink_out": topo.nvlink_bytes_per_s, "nvlink_in": topo.nvlink_bytes_per_s}
    secs = {k: traffic.total(k)[gpus] / bw[k] for k in LINKS}
    kinds = [k for k in LINKS if secs[k].any()] or ["nic_out", "nic_in"]
    # blocks of GPUs: node, else domain, else even chunks
    if len(gpus) > max_bars:
        key = None
        for size in (topo.gpus_per_node, topo.gpus_per_domain):
            if len(np.unique(gpus // size)) <= max_bars:
                key = gpus // size
                break
        if key is None:
            key = np.arange(len(gpus)) // -(-len(gpus) // max_bars)
        groups = [np.flatnonzero(key == v) for v in np.unique(key)]
    else:
        groups = [np.array([i]) for i in range(len(gpus))]
    labels = [str(gpus[g[0]]) if len(g) == 1 else f"{gpus[g[0]]}-{gpus[g[-1]]}" for g in groups]
    vals = {k: np.array([secs[k][g].max() for g in groups]) for k in kinds}
    n, w = len(groups), 0.8 / len(kinds)
    fig, ax = pyplot().subplots(figsize=(min(5 + 0.28 * n * len(kinds) / 2, 18), 5))
    x = np.arange(n)
    for i, k in enumerate(kinds):
        ax.bar(x + (i - (len(kinds) - 1) / 2) * w, vals[k], w, label=LINK_LABEL[k], color=_COLORS[k])
    # the bottleneck: the estimate's if it is a link, else the busiest link here
    bk, bg = None, None
    b = estimate.bottleneck if estimate is not None else None
    if b is not None and b.kind in kinds and b.where in set(gpus.tolist()):
        bk, bg = b.kind, b.where
    else:
        k = max(kinds, key=lambda k: secs[k].max())
        bk, bg = k, int(gpus[int(np.argmax(secs[k]))])
    gi = int(np.flatnonzero(gpus == bg)[0])
    bar = next(i for i, g in enumerate(groups) if gi in g)
    xb = bar + (kinds.index(bk) - (len(kinds) - 1) / 2) * w
    yb = secs[bk][gi]
    ax.plot([xb], [yb], marker="v", color="red", markersize=12, zorder=5)
    ax.annotate(f"bottleneck: GPU {bg} {LINK_LABEL[bk]}, {yb:.3g} s", (xb, yb), xytext=(0, 14),
                textcoords="offset points", ha="center", color="red", fontsize=9)
    every = _tick_every(n, 48)
    ax.set_xticks(x[::every])
    ax.set_xticklabels(labels[::every], rotation=90, fontsize=7)
    ax.set_xlabel("GPU" + (" (busiest of each block)" if n < len(gpus) else ""))
    ax.set_ylabel("seconds at link bandwidth")
    ax.set_ylim(0, max(v.max() for v in vals.values()) * 1.25 or 1.0)
    # shade training and inference GPUs
    tr = set(place.gpu_of[list(place.train_ranks)].tolist())
    inf = set(place.gpu_of[list(place.infer_ranks)].tolist())
    for i, g in enumerate(groups):
        gs = set(gpus[g].tolist())
        if gs & inf and not gs & tr:
            ax.axvspan(i - 0.5, i + 0.5, color="#f2f2f2", zorder=0)
    head = f"{title} on {topo.name}"
    if estimate is not None:
        head += f": modeled {estimate.method} {estimate.seconds:.3g} s"
    ax.set_title(head + "\n(grey: inference GPUs; NIC "
                 f"{topo.nic_bytes_per_s / 1e9:.3g} GB/s, NVLink {topo.nvlink_bytes_per_s / 1e9:.3g} GB/s per direction)",
                 fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    return save_figure(fig, path)
