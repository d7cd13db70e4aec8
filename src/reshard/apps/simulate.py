"""``reshard simulate``: modeled refit times of whole models at cluster scale, beside published figures.

For each case the real layouts are built (Megatron-Core training, vLLM inference), planned
twice, and the plans' bytes per link fed to the cost model (:mod:`reshard.modeling.pipeline`):

    ours, hierarchical   each NVLink domain takes what it lacks over the network once
                         (from a source, or relayed by another domain when the sources hold
                         too few copies), then forwards over NVLink (:mod:`reshard.planning.hierarchy`)
    ours, direct         one point-to-point phase, every destination from a source
    gather-broadcast     per bucket of tensors: gather on one training rank, NCCL ring
                         broadcast to every inference rank
    lower bound          the slowest of: each domain's unique network ingress over its NICs,
                         the sources' egress, one source's only copies, each GPU's need

Inference ranks start on a fresh NVLink domain (``infer_start="domain"``): training and
inference pools on separate machines, as in the published setups. Pure: no process group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..frameworks.parallel import model_layouts
from ..modeling.pipeline import RefitModel
from ..modeling.topology import Placement, Topology

GiB = 1 << 30


@dataclass(frozen=True)
class Case:
    """One row: a model, both parallel configurations, a machine, and what was published."""

    key: str
    model: str
    train: str
    infer: str
    topology: str
    published: str  # the figure as reported, for the table
    published_s: tuple[float, ...] = ()  # seconds to compare with (one figure or a range)
    source: str = ""


CASES = (
    Case("dsv3-gb200", "deepseek-v3", "tp1,cp1,ep16,dp2,pp4", "tp8,dp16", "gb200-nvl72",
         "NCCL M2N: hierarchical 1447 ms, direct 3838 ms", (1.447,), "NCCL M2N resharding on GB200"),
    Case("qwen235-gb200", "qwen3-235b-a22b", "tp2,cp2,ep16,pp4", "tp8,dp8", "gb200-nvl72",
         "NCCL M2N: hierarchical 989 ms, direct 2175 ms", (0.989,), "NCCL M2N resharding on GB200"),
    Case("dsv3-h100", "deepseek-v3", "pp16,ep16", "tp32,dp8", "dgx-h100",
         "NeMo RL: 2.39-2.83 s", (2.39, 2.83), "NeMo RL refit on H100"),
    Case("qwen30-h100", "qwen3-30b-a3b", "ep8,pp2", "tp8,dp2", "dgx-h100",
         "NeMo RL: 0.74-1.00 s", (0.74, 1.00), "NeMo RL refit on H100"),
    Case("kimi-h100", "kimi-k2", "tp1,ep32,pp4,dp2", "tp8,dp16", "dgx-h100",
         "1.3 s (point-to-point RDMA design)", (1.3,), "Kimi-K2 checkpoint engine"),
    Case("moe2.4t-h100", "moe-2.4t", "tp1,ep64,pp16", "tp8,dp128,ep", "dgx-h100",
         "4.3 s (refit only, 2.4 T BF16 MoE)", (4.3,), "reported 2.4 T-parameter MoE refit"),
)
CLAIM = (2.7, 5.7)  # published speedup of reshard over gather-and-broadcast


@dataclass
class Result:
    case: Case
    hierarchical_s: float
    direct_s: float
    gather_broadcast_s: float
    lower_bound_s: float
    bound_term: str
    bottleneck: str
    network_gb: float  # bytes the hierarchical plan moves between domains
    plan_s: float  # wall time to build layouts and plans here
    notes: list[str] = field(default_factory=list)

    @property
    def ratio_to_bound(self) -> float:
        return self.hierarchical_s / self.lower_bound_s if self.lower_bound_s else float("nan")

    @property
    def speedup(self) -> float:
        return self.gather_broadcast_s / self.hierarchical_s if self.hierarchical_s else float("nan")


def simulate_case(case: Case, *, max_bucket_bytes: int = GiB, gather_bucket_bytes: int | None = GiB,
                  topology: Topology | None = None) -> Result:
    """Build, plan and model one case (tens of seconds for the biggest)."""
    t0 = time.perf_counter()
    topo = topology or Topology.preset(case.topology)
    lay = model_layouts(case.model, case.train, case.infer)
    placement = Placement.contiguous(topo, lay.train_world, lay.infer_world, infer_start="domain")
    m = RefitModel.build(lay.source, lay.destination, topo, placement=placement)
    if m.hierarchical is None:
        raise ValueError(f"case {case.key}: topology {topo.name} has no NVLink domains of several GPUs")
    plan_s = time.perf_counter() - t0
    _, est_h = m.estimate(m.hierarchical, rounds_cap=max_bucket_bytes, method="reshard hierarchical")
    _, est_d = m.estimate(m.direct, rounds_cap=max_bucket_bytes, method="reshard direct")
    est_g = m.gather_broadcast(gather_bucket_bytes)
    bound = m.lower_bound()
    b = bound.binding
    return Result(case, est_h.seconds, est_d.seconds, est_g.seconds, bound.seconds,
                  f"{b.name} ({b.where})" if b else "-",
                  est_h.bottleneck.describe() if est_h.bottleneck else "-",
                  sum(m.hierarchical.cross_domain_bytes.values()) / 1e9, plan_s)


def render(results: list[Result], console, title: str = "modeled refit time") -> None:
    from rich.table import Table

    t = Table(title=title)
    for col in ("case", "topology", "ours hier. s", "ours direct s", "gather-bcast s", "lower bound s",
                "ours / bound", "speedup vs g-b", "published"):
        t.add_column(col, justify="left" if col in ("case", "topology", "published") else "right")
    for r in results:
        c = r.case
        t.add_row(f"{c.model} {c.train} -> {c.infer}", c.topology, f"{r.hierarchical_s:.3f}", f"{r.direct_s:.3f}",
                  f"{r.gather_broadcast_s:.2f}", f"{r.lower_bound_s:.3f}", f"{r.ratio_to_bound:.2f}x",
                  f"{r.speedup:.1f}x", c.published)
    console.print(t)
    for r in results:
        console.print(f"[bold]{r.case.key}[/]: bound set by {r.bound_term}; our bottleneck: {r.bottleneck}; "
                      f"{r.network_gb:,.0f} GB cross domains; planned in {r.plan_s:.1f} s")


def plot(results: list[Result], path: str | Path) -> Path:
    """Grouped bars per case (ours hierarchical / direct, gather-and-broadcast, lower bound), with
    the published figures as markers, on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.case.key for r in results]
    series = [("ours, hierarchical", [r.hierarchical_s for r in results], "#2b7bba"),
              ("ours, direct", [r.direct_s for r in results], "#8fbde0"),
              ("gather-and-broadcast", [r.gather_broadcast_s for r in results], "#d9534f"),
              ("lower bound", [r.lower_bound_s for r in results], "#555555")]
    x = np.arange(len(results))
    width = 0.2
    fig, ax = plt.subplots(figsize=(max(8, 1.8 * len(results)) + 2, 5))
    for i, (name, vals, color) in enumerate(series):
        ax.bar(x + (i - 1.5) * width, vals, width, label=name, color=color)
    for i, r in enumerate(results):
        for k, v in enumerate(r.case.published_s):
            ax.scatter([x[i] - 1.5 * width], [v], marker="*", s=140, color="#f0ad4e", edgecolor="black", zorder=5,
                       label="published" if i == 0 and k == 0 else None)
    ax.set_yscale("log")
    ax.set_xticks(x, labels, rotation=15)
    ax.set_ylabel("seconds per refit (modeled)")
    ax.set_title("refit time: reshard vs gather-and-broadcast vs the lower bound")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["CASES", "Case", "Result", "plot", "render", "simulate_case"]
