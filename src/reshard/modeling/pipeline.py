"""One pipeline for every modeled refit: placement -> plans -> traffic -> modeled time -> plots.

``reshard plan --plot``, ``reshard simulate`` and the benchmarks all go through
:class:`RefitModel`::

    m = RefitModel.build(source, destination, Topology.preset("dgx-h100"), infer_start="domain")
    m.placement                      which GPU each rank runs on (training ranks first)
    m.direct, m.hierarchical         the plans: one point-to-point phase; phases over NVLink domains
                                     (None on a machine whose domains are single GPUs)
    m.reshard                        what reshard runs on this machine (hierarchical when it exists)
    m.estimate(m.reshard)            (traffic, modeled time) of a plan's phases on the machine
    m.gather_broadcast(bucket_bytes) the baseline as RL stacks run it, on the same links
    m.lower_bound()                  what no refit can beat on these links
    m.write_plots(out_dir, stem)     bytes per rank pair (heat map) and link load per GPU (bars)

Rounds: a plan with a staging cap is modeled with its own per-stream quotas; an uncapped plan
with ``rounds_cap`` (the planner's quota rule on its payload bytes), else as one round.

>>> import torch, reshard as rs
>>> spec = rs.TensorSpec("w", (1024, 1024), torch.bfloat16)
>>> src = rs.Layout.from_placements(spec, ranks=[0, 1], mesh_shape=(2,), placements=[rs.Shard(0)])
>>> dst = rs.Layout.from_placements(spec, ranks=[2, 3], mesh_shape=(2,), placements=[rs.Replicate()])
>>> m = RefitModel.build(src, dst, Topology.preset("dgx-h100"), infer_start="domain")
>>> m.reshard.phase_names, m.placement.gpu_of.tolist()
(['network', 'NVLink forward'], [0, 1, 8, 9])
>>> m.hierarchical.cross_domain_bytes    # w (2 MiB) enters the inference domain once: half to each rank,
{1: 2097152}
>>> traffic, est = m.estimate(m.reshard)  # which then sends its half to the other over NVLink
>>> [p.name for p in est.phases], traffic.network_bytes(), traffic.nvlink_bytes()
(['network', 'NVLink forward'], 2097152.0, 2097152.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..layout import Layout
from ..planning.hierarchy import HierarchicalPlan, domain_need_bytes, hierarchical_plan
from ..planning.plan import PhasedPlan, Plan
from .cost import (Bound, Demand, Estimate, Traffic, gather_broadcast_time_of, lower_bound, model_time,
                   traffic_from_pairs)
from .plots import plot_link_load, plot_pair_bytes
from .topology import Placement, Topology


@dataclass
class RefitModel:
    """A refit placed on a machine, with its plans (see module doc)."""

    source: Layout
    destination: Layout
    topology: Topology
    placement: Placement
    direct: Plan
    hierarchical: HierarchicalPlan | None
    _estimates: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, source: Layout, destination: Layout, topology: Topology, *, placement: Placement | None = None,
              infer_start: str = "next", max_bucket_bytes: int | None = None, direct: Plan | None = None
              ) -> "RefitModel":
        """Place the ranks (default: training ranks on GPUs ``0..M-1``, inference ranks from
        ``infer_start``, see :meth:`Placement.contiguous`) and plan the refit both ways, with the
        staging cap ``max_bucket_bytes``; ``direct`` reuses a direct plan already made."""
        if placement is None:
            placement = Placement.contiguous(topology, len(source.ranks), len(destination.ranks),
                                             infer_start=infer_start)
        if direct is None:
            direct = Plan(source, destination, max_bucket_bytes=max_bucket_bytes)
        hier = None
        if topology.gpus_per_domain > 1:
            domains = dict(enumerate(placement.domain_of.tolist()))
            hier = hierarchical_plan(source, destination, domains, max_bucket_bytes=max_bucket_bytes)
        return cls(source, destination, topology, placement, direct, hier)

    @property
    def reshard(self) -> PhasedPlan:
        """What reshard runs on this machine: network once per domain, then NVLink, where there are domains."""
        return self.hierarchical if self.hierarchical is not None else self.direct

    def traffic(self, plan: PhasedPlan, *, rounds_cap: int | None = None) -> Traffic:
        """Link load of ``plan``'s phases on the placement (rounds: see module doc)."""
        quotas = [p.quotas for p in plan.phases] if plan.max_bucket_bytes is not None else None
        return traffic_from_pairs([p.pair_bytes for p in plan.phases], self.placement, self.topology,
                                  names=plan.phase_names, quotas=quotas, max_bucket_bytes=rounds_cap)

    def estimate(self, plan: PhasedPlan, *, rounds_cap: int | None = None, method: str = "reshard"
                 ) -> tuple[Traffic, Estimate]:
        """(traffic, modeled time) of ``plan`` on this machine; cached per plan and arguments."""
        key = (id(plan), rounds_cap, method)
        hit = self._estimates.get(key)
        if hit is None:
            traffic = self.traffic(plan, rounds_cap=rounds_cap)
            hit = self._estimates[key] = (traffic, model_time(traffic, self.topology, method=method))
        return hit

    def gather_broadcast(self, bucket_bytes: int | None = None) -> Estimate:
        """Gather-and-broadcast modeled on the same links (see :func:`~reshard.modeling.cost.gather_broadcast_time`)."""
        return gather_broadcast_time_of(self.direct, self.placement, self.topology, bucket_bytes=bucket_bytes)

    def demand(self) -> Demand:
        """What any refit of these layouts must move (the lower bound's inputs).

        * per domain: the bytes the hierarchical plan brings in from other domains: every distinct
          box its ranks need, minus what sources inside it hold (the planner takes a replica inside
          the domain when there is one; tests check this against numpy masks);
        * per destination rank: the bytes it receives in the direct plan (each element it needs and
          does not hold, once: the minimum, as the property tests check);
        * sources: with no source in any destination domain, every distinct box must leave the
          sources once; bytes only one source rank holds leave through that rank's NIC.
        """
        direct, dom = self.direct, self.placement.domain_of
        dst_domains = {int(dom[r]) for r in direct.destination.ranks}
        src_domains = {int(dom[r]) for r in direct.source.ranks}
        egress = 0.0
        exclusive: dict[int, float] = {}
        if not dst_domains & src_domains:  # every distinct box some destination holds leaves the sources
            one_domain = {r: 0 for r in direct.destination.ranks}
            egress = float(sum(domain_need_bytes(direct.destination, one_domain).values()))
            exclusive = exclusive_source_bytes(direct)
        ingress = dict(self.hierarchical.cross_domain_bytes) if self.hierarchical is not None else {}
        return Demand(domain_ingress_bytes=ingress, dest_need_bytes=dict(direct.recv_bytes),
                      source_egress_bytes=egress, source_exclusive_bytes=exclusive)

    def lower_bound(self) -> Bound:
        return lower_bound(self.demand(), self.placement, self.topology)

    def write_plots(self, out_dir: str | Path, stem: str, title: str = "refit", *,
                    rounds_cap: int | None = None) -> list[Path]:
        """``{stem}-pairs.png`` (bytes per source/destination pair of the direct plan) and
        ``{stem}-links.png`` (each GPU's link load in the plan reshard runs, bottleneck marked)."""
        out = Path(out_dir)
        traffic, est = self.estimate(self.reshard, rounds_cap=rounds_cap)
        d = self.direct
        return [plot_pair_bytes(d.pair_bytes, out / f"{stem}-pairs.png", sources=d.source.ranks,
                                destinations=d.destination.ranks, block=self.topology.gpus_per_node,
                                title=f"{title}: bytes per (source, destination) pair"),
                plot_link_load(traffic, out / f"{stem}-links.png", self.topology, estimate=est,
                               title=f"{title}: link load per GPU")]


def exclusive_source_bytes(p: Plan) -> dict[int, float]:
    """Per source rank, bytes of the source regions it alone holds that a destination needs
    (every destination rank taken to lie in another domain)."""
    out: dict[int, float] = {}
    for name in p.tensors:
        st = p.source.tables[name]
        if not len(st):
            continue
        inv, count = st.box_copies()
        alone = count[inv] == 1
        if not alone.any():
            continue
        isz = p.destination.uniform_itemsize(name) or p.destination.specs[name].dtype.itemsize
        for r, v in zip(st.ranks[alone].tolist(), st.sizes[alone].prod(axis=1).tolist()):
            out[r] = out.get(r, 0.0) + v * isz
    return out


__all__ = ["RefitModel", "exclusive_source_bytes"]
