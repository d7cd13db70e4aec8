"""One pipeline for every modeled refit: placement -> plans -> traffic -> modeled time -> plots.

``reshard plan --plot``, ``reshard simulate`` and the benchmarks all go through
:class:`RefitModel`::

    m = RefitModel.build(source, destination, Topology.preset("dgx-h100"), infer_start="domain")
    m.placement                      which GPU each rank runs on (training ranks first)
    m.direct, m.hierarchical         the plans: one point-to-point phase; phases over NVLink domains
                                     (None on a machine whose domains are single GPUs)
    m.reshard                        what reshard runs on this machine (hierarchical when it exists)
    m.estimate(m.reshard)            (traffic, modeled time) of a plan's phases on the machine
    m.gather_broadcast(bucket_bytes) the baseline as its best implementations run it (a root per
                                     pipeline stage, multi-rail NCCL rings, buckets overlapped);
                                     variant="naive": one root, one NIC, nothing overlapped
    m.hybrid(bucket_bytes)           NeMo RL's hybrid: FFN / expert weights by reshard, the rest by
                                     the fair packed broadcast, one after the other
    m.lower_bound()                  what no refit can beat on these links (ingress="job": using
                                     only the NICs of the job's GPUs)
    m.write_plots(out_dir, stem)     bytes per rank pair (heat map) and link load per GPU (bars)

Destination precision (``RefitModel.build(..., policy="fp8")``, :mod:`reshard.planning.precision`):
``m.precision`` is the :class:`~reshard.planning.precision.PrecisionPlan` and ``m.direct`` /
``m.hierarchical`` plan its wire (FP8 values and scales of blocks a source holds whole, raw
blocks in the source's precision, the kept tensors), so reshard's modeled times and the lower
bound are those of the FP8 refit. The baselines (gather-and-broadcast, the hybrid) are modeled
moving the source's precision (BF16) whole, the engine quantizing on load, as vLLM does when
an FP8 model is given BF16 weights. Quantization's compute time is not modeled
(``benchmarks/bench_fp8.py`` measures it).

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

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..layout import Layout
from ..options import RefitOptions
from ..planning.baseline import stage_sends
from ..planning.hierarchy import HierarchicalPlan, domain_need_bytes
from ..planning.hybrid import HybridRule, split_layout
from ..planning.methods import HIERARCHICAL, METHODS, RESHARD
from ..planning.plan import PhasedPlan, Plan
from ..planning.precision import PrecisionPlan
from .baseline_time import gather_broadcast_fair_time, gather_broadcast_time_of
from .bound import Bound, Demand, lower_bound
from .estimate import Estimate
from .plots import plot_link_load, plot_pair_bytes
from .reshard_time import model_time
from .topology import Placement, Topology
from .traffic import PhaseTraffic, Traffic, traffic_from_pairs


PIPELINE_CHUNKS = 8  # tensor chunks of the pipelined order in the model (and reshard simulate)


@dataclass
class RefitModel:
    """A refit placed on a machine, with its plans (see module doc)."""

    source: Layout
    destination: Layout
    topology: Topology
    placement: Placement
    direct: Plan
    hierarchical: HierarchicalPlan | None
    precision: PrecisionPlan | None = None  # set when built with a policy: direct / hierarchical plan its wire
    _estimates: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, source: Layout, destination: Layout, topology: Topology, *, placement: Placement | None = None,
              infer_start: str = "next", max_bucket_bytes: int | None = None, direct: Plan | None = None,
              policy=None, precision: PrecisionPlan | None = None, options: RefitOptions | None = None,
              plan_hierarchical: bool = True) -> "RefitModel":
        """Place the ranks (default: training ranks on GPUs ``0..M-1``, inference ranks from
        ``infer_start``, see :meth:`Placement.contiguous`) and plan the refit both ways, as the
        methods of the registry plan it (:mod:`reshard.planning.methods`), under ``options`` (a
        :class:`~reshard.options.RefitOptions`: its staging cap and dtype policy; default: the
        staging cap ``max_bucket_bytes`` and the dtype policy ``policy``, a
        :class:`~reshard.planning.precision.DtypePolicy` or a name, ``"fp8"``: see module doc).
        ``direct`` reuses a direct plan already made; ``precision`` a precision plan (its direct wire
        plan); ``plan_hierarchical=False`` leaves the hierarchical plan out (a model asked only for the
        baselines' estimates, :meth:`baseline_estimates`)."""
        if options is None:
            options = RefitOptions(max_bucket_bytes=max_bucket_bytes, precision=policy)
        if placement is None:
            placement = Placement.contiguous(topology, len(source.ranks), len(destination.ranks),
                                             infer_start=infer_start)
        direct_options = options.replace(method=RESHARD, domains=None, hybrid_rule=None)
        if precision is None and options.precision is not None:
            precision = METHODS[RESHARD].make(source, destination, direct_options)
        if precision is not None:  # plan the wire: its layouts hold the staging buffers of the quantization
            if not isinstance(precision.wire, Plan):
                raise ValueError("RefitModel.build takes a PrecisionPlan with a direct wire (method reshard); it "
                                 "plans the hierarchical wire itself")
            direct = precision.wire
            plan_src, plan_dst = direct.source, direct.destination
        else:
            plan_src, plan_dst = source, destination
            if direct is None:
                direct = METHODS[RESHARD].make(source, destination, direct_options)
        hier = None
        if topology.gpus_per_domain > 1 and plan_hierarchical:  # a precision plan's wire: planned as raw layouts
            domains = dict(enumerate(placement.domain_of.tolist()))
            hier = METHODS[HIERARCHICAL].make(plan_src, plan_dst, direct_options.replace(
                method=HIERARCHICAL, precision=None, domains=domains))
        return cls(source, destination, topology, placement, direct, hier, precision)

    @property
    def reshard(self) -> PhasedPlan:
        """What reshard runs on this machine: network once per domain, then NVLink, where there are domains."""
        return self.hierarchical if self.hierarchical is not None else self.direct

    def pipelined(self, chunks: int | None = None) -> HierarchicalPlan | None:
        """The hierarchical plan in its pipelined order (:meth:`HierarchicalPlan.pipelined`, same
        copies; ``chunks`` default :data:`PIPELINE_CHUNKS`), None where there is no hierarchical plan."""
        if self.hierarchical is None:
            return None
        key = ("pipelined", chunks)
        hit = self._estimates.get(key)
        if hit is None:
            hit = self._estimates[key] = self.hierarchical.pipelined(chunks or PIPELINE_CHUNKS)
        return hit

    def fastest_order(self, chunks=(1, 4, 8, PIPELINE_CHUNKS), *, rounds_cap: int | None = None) -> PhasedPlan:
        """The hierarchical plan in whichever order models fastest on this machine: sequential
        (``chunks=1``) or pipelined over each of ``chunks`` (the same copies either way); the direct
        plan where there is no hierarchical one. Pipelining costs rounds (each step is a round
        boundary) and can be unbalanced per chunk, so on a latency-bound plan the sequential order
        can win; choosing by the model keeps the faster."""
        if self.hierarchical is None:
            return self.direct
        options = [self.hierarchical if c == 1 else self.pipelined(c) for c in chunks]
        return min(options, key=lambda p: self.estimate(p, rounds_cap=rounds_cap)[1].seconds)

    def traffic(self, plan: PhasedPlan, *, rounds_cap: int | None = None) -> Traffic:
        """Link load of ``plan``'s phases on the placement (rounds: see module doc); a pipelined
        hierarchical plan as its steps (:func:`pipelined_traffic`)."""
        if getattr(plan, "is_pipelined", False):
            return pipelined_traffic(plan, self.placement, self.topology, rounds_cap=rounds_cap)
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

    def gather_broadcast(self, bucket_bytes: int | None = None, *, variant: str = "fair") -> Estimate:
        """Gather-and-broadcast modeled on the same links, per bucket of ``bucket_bytes`` (``None``: one
        tensor a bucket). ``variant="fair"``: as its best implementations run it, a root per pipeline
        stage, multi-rail NCCL rings, buckets overlapped (:func:`~reshard.modeling.baseline_time.gather_broadcast_fair_time`);
        ``"naive"``: one root gathers everything and broadcasts it from its one NIC, bucket after bucket
        (:func:`~reshard.modeling.baseline_time.gather_broadcast_time`)."""
        if variant not in ("fair", "naive"):
            raise ValueError(f"variant must be 'fair' or 'naive', got {variant!r}")
        key = ("gather-broadcast", variant, bucket_bytes)
        hit = self._estimates.get(key)
        if hit is None:
            if variant == "fair":
                hit = gather_broadcast_fair_time(stage_sends(self.source, self.destination), self.destination.ranks,
                                                 self.placement, self.topology, bucket_bytes=bucket_bytes)
            else:
                hit = gather_broadcast_time_of(self._whole_refit(), self.placement, self.topology,
                                               bucket_bytes=bucket_bytes)
            self._estimates[key] = hit
        return hit

    def _whole_refit(self):
        """What the naive baseline gathers and broadcasts: the direct plan, or with a precision plan
        the source and destination layouts in the source's precision (the engine quantizes on load)."""
        if self.precision is None:
            return self.direct
        return _Refit(self.source, self.destination,
                      [n for n, t in self.destination.tables.items() if len(t) and n in self.source.specs])

    def hybrid(self, bucket_bytes: int | None = None, *, rounds_cap: int | None = None,
               rule: HybridRule | None = None) -> Estimate:
        """NeMo RL's hybrid refit: the tensors ``rule`` picks (default :class:`~reshard.planning.hybrid.HybridRule`:
        FFN and expert weights) by reshard (hierarchical where there are NVLink domains, else direct;
        ``rounds_cap`` as in :meth:`estimate`), then the others by the fair packed broadcast (buckets of
        ``bucket_bytes``). The two parts run one after the other: both are bound by the same inference
        NICs, so running them at once would share those links rather than save time."""
        key = ("hybrid", bucket_bytes, rounds_cap, rule)
        hit = self._estimates.get(key)
        if hit is not None:
            return hit
        src_r, src_b = split_layout(self.source, rule)
        dst_r, dst_b = split_layout(self.destination, rule)
        parts: list[tuple[str, Estimate]] = []
        if any(len(t) for t in dst_r.tables.values()):
            # the hybrid's reshard part, as the hybrid method plans it (hierarchical where there are domains)
            domains = dict(enumerate(self.placement.domain_of.tolist())) if self.topology.gpus_per_domain > 1 else None
            method = HIERARCHICAL if domains else RESHARD
            plan = METHODS[method].make(src_r, dst_r, RefitOptions(
                method=method, max_bucket_bytes=self.direct.max_bucket_bytes, domains=domains))
            parts.append(("reshard", model_time(self.traffic(plan, rounds_cap=rounds_cap), self.topology)))
        if any(len(t) for t in dst_b.tables.values()):
            parts.append(("broadcast", gather_broadcast_fair_time(stage_sends(src_b, dst_b), dst_b.ranks,
                                                                  self.placement, self.topology,
                                                                  bucket_bytes=bucket_bytes)))
        phases = []
        for label, est in parts:
            for p in est.phases:
                bn = replace(p.bottleneck, phase=f"{label} {p.bottleneck.phase}") if p.bottleneck else None
                phases.append(replace(p, name=f"{label} {p.name}", bottleneck=bn))
        n_r = sum(1 for t in dst_r.tables.values() if len(t))
        n_b = sum(1 for t in dst_b.tables.values() if len(t))
        notes = tuple(f"{label}: {est.seconds:.4g} s ({est.method}{', phases pipelined' if est.pipelined else ''})"
                      for label, est in parts)
        notes += (f"{n_r} tensors by reshard, {n_b} by packed broadcast; the parts run one after the other",)
        hit = self._estimates[key] = Estimate("hybrid", self.topology.name, sum(e.seconds for _, e in parts),
                                              tuple(phases), False, notes)
        return hit

    def baseline_estimates(self) -> dict:
        """The baselines' estimates this model has made (the hybrid, gather-and-broadcast), for another model
        of the same refit to take with :meth:`adopt_estimates`: a forked child models baselines while the
        parent plans reshard's own phases (``reshard plan --topology``). Baselines need no hierarchical plan
        (see ``plan_hierarchical`` in :meth:`build`)."""
        return {key: hit for key, hit in self._estimates.items() if key[0] in ("hybrid", "gather-broadcast")}

    def adopt_estimates(self, estimates: dict) -> None:
        """Take the estimates :meth:`baseline_estimates` returned on a model of the same refit."""
        self._estimates.update(estimates)

    def demand(self) -> Demand:
        """What any refit of these layouts must move (the lower bound's inputs; computed once).

        * per domain: the bytes it must take from other domains. With no source in any destination
          domain: the distinct boxes its destination ranks hold (identical boxes once,
          :func:`~reshard.planning.hierarchy.domain_need_bytes`); else what the hierarchical plan brings
          in (every distinct box its ranks need, minus what sources inside it hold: the planner takes a
          replica inside the domain when there is one; tests check this against numpy masks);
        * per destination rank: the bytes it receives in the direct plan (each element it needs and
          does not hold, once: the minimum, as the property tests check);
        * sources: with no source in any destination domain, every distinct box must leave the
          sources once; bytes only one source rank holds must leave its domain.
        """
        hit = self._estimates.get("demand")
        if hit is not None:
            return hit
        direct, dom = self.direct, self.placement.domain_of
        dst_domains = {int(dom[r]) for r in direct.destination.ranks}
        src_domains = {int(dom[r]) for r in direct.source.ranks}
        egress = 0.0
        exclusive: dict[int, float] = {}
        ingress: dict[int, float] = {}
        if not dst_domains & src_domains:  # every distinct box some destination holds leaves the sources
            one_domain = {r: 0 for r in direct.destination.ranks}
            egress = float(sum(domain_need_bytes(direct.destination, one_domain).values()))
            exclusive = exclusive_source_bytes(direct)
            if self.topology.gpus_per_domain > 1:
                ingress = dict(domain_need_bytes(direct.destination,
                                                 {r: int(dom[r]) for r in direct.destination.ranks}))
        elif self.hierarchical is not None:
            ingress = dict(self.hierarchical.cross_domain_bytes)
        hit = self._estimates["demand"] = Demand(domain_ingress_bytes=ingress, dest_need_bytes=dict(direct.recv_bytes),
                                                 source_egress_bytes=egress, source_exclusive_bytes=exclusive)
        return hit

    def lower_bound(self, *, ingress: str = "domain") -> Bound:
        """What no refit can beat on these links (:func:`~reshard.modeling.bound.lower_bound`): ``ingress="domain"``
        lets a refit use every NIC of an NVLink domain it touches, ``"job"`` only its own GPUs' NICs."""
        return lower_bound(self.demand(), self.placement, self.topology, ingress=ingress)

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


def pipelined_traffic(plan: HierarchicalPlan, placement: Placement, topology: Topology | None = None, *,
                      rounds_cap: int | None = None) -> Traffic:
    """Link load of a pipelined hierarchical plan as the executor runs it: one modeled "phase" per
    step, holding every phase that runs in the step (phase p of chunk s - p), whose streams move
    their chunk's bytes (:meth:`HierarchicalPlan.step_pair_bytes`) in the step's sub-rounds
    (the phases sharing the staging cap); sub-round
    j of a step carries message j of every stream of every phase in it, each stream's bytes spread
    over the step's sub-rounds (:meth:`HierarchicalPlan.step_rounds`), so links of different phases
    are busy in the same rounds. An uncapped plan is modeled at the staging cap ``rounds_cap``
    (the planner's quota rule), else one sub-round per step."""
    names = plan.phase_names
    cap = rounds_cap if plan.max_bucket_bytes is None else None
    steps = []
    for s, (members, rounds) in enumerate(zip(plan.step_pair_bytes(), plan.step_rounds(cap))):
        one = traffic_from_pairs([pairs for _, pairs in members], placement, topology,
                                 names=[names[p] for p, _ in members], rounds=rounds)
        label = f"step {s} (" + ", ".join(f"{names[p]} chunk {s - p}" for p, _ in members) + ")"
        steps.append(_sum_phases(label, one.phases))
    return Traffic(placement, steps)


def _sum_phases(name: str, parts: list[PhaseTraffic]) -> PhaseTraffic:
    """Phases that run in the same rounds, added round by round (the shorter ones padded)."""
    rounds = max(p.rounds for p in parts)
    gpus = parts[0].bytes.shape[2]
    out = PhaseTraffic.empty(name, rounds, gpus)
    for p in parts:
        n = p.rounds
        for field_name in ("bytes", "messages", "pack_bytes", "unpack_bytes", "pack_copies", "unpack_copies"):
            getattr(out, field_name)[:n] += getattr(p, field_name)
    return out


@dataclass(frozen=True)
class _Refit:
    """The layouts and tensors of a refit, all :func:`~reshard.modeling.baseline_time.gather_broadcast_time_of`
    reads of a plan."""

    source: Layout
    destination: Layout
    tensors: list


def exclusive_source_bytes(p: Plan) -> dict[int, float]:
    """Per source rank, bytes of the source regions it alone holds that a destination needs
    (every destination rank taken to lie in another domain)."""
    tensors: dict[tuple[bytes, int], list] = {}  # (geometry, itemsize) -> [a source table, how many tensors]
    keys: dict = {}  # tables of the same arrays: one geometry key
    for name in p.tensors:
        st = p.source.tables[name]
        if not len(st.ranks):
            continue
        isz = p.destination.buffer_dtypes(name).itemsize or p.destination.specs[name].dtype.itemsize
        geometry = st.geometry_key(keys)
        hit = tensors.get((geometry, isz))
        if hit is None:
            tensors[(geometry, isz)] = [st, 1]
        else:
            hit[1] += 1
    out: dict[int, float] = {}
    copies: dict = {}
    for (_, isz), (st, n) in tensors.items():  # in tensor order: ranks come in as they did tensor by tensor
        inv, count = st.box_copies(copies)
        alone = count[inv] == 1
        if not alone.any():
            continue
        for r, v in zip(st.ranks[alone].tolist(), st.sizes[alone].prod(axis=1).tolist()):
            out[r] = out.get(r, 0.0) + v * isz * n  # whole numbers far below 2**53: exact, as n additions were
    return out


__all__ = ["PIPELINE_CHUNKS", "RefitModel", "exclusive_source_bytes", "pipelined_traffic"]
