"""Cost model: how long a refit takes on a topology, the gather-and-broadcast baselines, the lower bound.

Pure numpy: plain data in (bytes per rank pair, a :class:`~reshard.modeling.topology.Placement`,
a :class:`~reshard.modeling.topology.Topology`), plain data out. Every formula and assumption
is in ``docs/cost_model.md``; the short version:

**Traffic.** A refit is a list of phases (a plain plan has one; a hierarchical one
has a network phase and an NVLink fan-out phase), each a list of rounds. A pair of
ranks in one NVLink domain moves its bytes over NVLink, any other pair over both
GPUs' NICs; two ranks on one GPU copy locally.

**Rounds** of a phase run as :class:`~reshard.execution.executor.ReshardExecutor` runs them
(overlapped, its default): one round on the wire at a time, and while round j is, every rank
packs round j+1 and unpacks round j-1 ::

    t[j] = launch + latency + max( wire[j], pack[j+1] + unpack[j-1], host[j] )
    wire[j]   = max_g max_k bytes[j,k,g] / bw[k]
    pack[j]   = max_g (packed bytes / copy_bw + messages out * message_overhead + copies out * copy_overhead)
    unpack[j] = the same for what the GPUs receive
    host[j]   = max_n ( sum_{g in n} (pack[j,g] + unpack[j,g]) / host_cores
                        + max(sum_{g in n} nic_out[j,g], sum_{g in n} nic_in[j,g]) / host_bw )
    phase     = pack[0] + sum_j t[j] + unpack[last]

with k over NIC out, NIC in, NVLink out, NVLink in (full duplex, all links at once),
``latency`` the network latency if the round sends any network message (else the
NVLink latency), and the host term only for topologies whose ranks share CPU cores.
``overlap=False`` models the sequential order instead: ``t[j] = launch + latency +
max(pack[j] + wire[j] + unpack[j], host[j])``.

**Phases** run one after another, as the executor runs them; ``pipeline=True`` models a
pipelined executor instead: round j of phase p starts when round j of phase p-1 and round
j-1 of phase p are both done (``F[p,j] = max(F[p-1,j], F[p,j-1]) + t[p,j]``).

**Gather-and-broadcast**, two ways: :func:`gather_broadcast_fair_time` as its best implementations
run it (a gather into each pipeline stage's root and an NCCL ring broadcast from it, all stages
at once, multi-rail: a domain's traffic spread over all its NICs; each bucket's broadcast
overlapping the next one's gather), and :func:`gather_broadcast_time`, the naive form (one root
gathers everything and broadcasts it through its one NIC, bucket after bucket).

**The lower bound** (:func:`lower_bound`): the slowest of each domain's ingress over its NICs
(every NIC of the domain, or with ``ingress="job"`` the job's only), the sources' egress, the
bytes only one source holds (out of its domain; out of its GPU over its NIC or one NVLink hop),
and each GPU's need over its NIC and NVLink.

>>> from reshard.modeling.topology import Placement, Topology
>>> topo = Topology.preset("dgx-h100").with_(net_latency_s=0, launch_latency_s=0, message_overhead_s=0)
>>> place = Placement.contiguous(topo, 8, 8)           # training on node 0, inference on node 1
>>> tr = traffic_from_pairs([{(0, 8): 50_000_000_000}], place, topo)
>>> round(model_time(tr, topo).seconds, 4)           # 50 GB over one 50 GB/s NIC, + pack and unpack
1.0597
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..planning import baseline, schedule
from .topology import Placement, Topology

#: link kinds, in the order of the ``bytes``/``messages`` arrays
LINKS = ("nic_out", "nic_in", "nvlink_out", "nvlink_in")
NIC_OUT, NIC_IN, NVL_OUT, NVL_IN = range(4)
LINK_LABEL = {"nic_out": "NIC out", "nic_in": "NIC in", "nvlink_out": "NVLink out", "nvlink_in": "NVLink in",
              "pack": "pack + post sends", "unpack": "unpack + post receives",
              "host": "shared host cores + loopback"}

PairBytes = Mapping[tuple[int, int], int]


# ============================================================================================ traffic
@dataclass(eq=False)
class PhaseTraffic:
    """One phase: per round and per GPU, bytes and messages on each link kind, and local work.

    ``bytes[j, k, g]`` / ``messages[j, k, g]``: round j, link kind k (see :data:`LINKS`), GPU g.
    ``pack_bytes[j, g]``: bytes GPU g packs before sending (local copies count here);
    ``unpack_bytes[j, g]``: bytes it unpacks after receiving (fan-out copies count here);
    ``pack_copies`` / ``unpack_copies``: how many boxes that is (0 when unknown).
    """

    name: str
    bytes: np.ndarray
    messages: np.ndarray
    pack_bytes: np.ndarray
    unpack_bytes: np.ndarray
    pack_copies: np.ndarray
    unpack_copies: np.ndarray

    @classmethod
    def empty(cls, name: str, rounds: int, gpus: int) -> "PhaseTraffic":
        z = lambda *shape: np.zeros(shape)  # noqa: E731
        return cls(name, z(rounds, 4, gpus), z(rounds, 4, gpus), z(rounds, gpus), z(rounds, gpus),
                   z(rounds, gpus), z(rounds, gpus))

    @property
    def rounds(self) -> int:
        return self.bytes.shape[0]

    def total(self, kind: str) -> np.ndarray:
        """Bytes per GPU over all rounds on one link kind (:data:`LINKS`), or ``"pack"`` / ``"unpack"``."""
        if kind in ("pack", "unpack"):
            return getattr(self, f"{kind}_bytes").sum(axis=0)
        return self.bytes[:, LINKS.index(kind)].sum(axis=0)


@dataclass(eq=False)
class Traffic:
    """Link load of a refit, phase by phase (see :func:`traffic_from_pairs`)."""

    placement: Placement
    phases: list[PhaseTraffic]

    @property
    def num_gpus(self) -> int:
        return self.placement.num_gpus

    def total(self, kind: str) -> np.ndarray:
        """Bytes per GPU on one link kind (or ``"pack"``/``"unpack"``), all phases summed."""
        out = np.zeros(self.num_gpus)
        for p in self.phases:
            out += p.total(kind)
        return out

    def network_bytes(self) -> float:
        """Bytes that cross the network (each counted once, at the sender)."""
        return float(self.total("nic_out").sum())

    def nvlink_bytes(self) -> float:
        return float(self.total("nvlink_out").sum())


def _pairs_arrays(pairs: PairBytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not pairs:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros(0)
    keys = np.array(list(pairs.keys()), np.int64).reshape(-1, 2)
    vals = np.fromiter(pairs.values(), np.float64, len(pairs))
    keep = vals > 0
    return keys[keep, 0], keys[keep, 1], vals[keep]


def _check_topology(placement: Placement, topology: Topology | None) -> Topology:
    if topology is None:
        return placement.topology
    pt = placement.topology
    if (topology.gpus_per_domain, topology.gpus_per_node) != (pt.gpus_per_domain, pt.gpus_per_node):
        raise ValueError(f"topology {topology.name!r} groups GPUs differently from the placement's "
                         f"{pt.name!r}; build the placement with the same topology")
    return topology


def _link_kind(placement: Placement, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(GPU of src, GPU of dst, kind) with kind 0 = same GPU, 1 = NVLink, 2 = network."""
    gpu = placement.gpu_of
    n = len(gpu)
    both = np.concatenate([src, dst])
    bad = both[(both < 0) | (both >= n)]
    if len(bad):
        raise ValueError(f"rank {int(bad[0])} is not placed (the placement has ranks 0..{n - 1})")
    gs, gd = gpu[src], gpu[dst]
    dom = placement.topology.gpus_per_domain
    kind = np.where(gs == gd, 0, np.where(gs // dom == gd // dom, 1, 2))
    return gs, gd, kind


def _staging_quotas(pairs: PairBytes, max_bucket_bytes: int) -> dict[tuple[int, int], int | None]:
    """Per-round quota of each pair under the planner's rule (:func:`reshard.planning.schedule.pair_quotas`), from
    payload bytes alone (the planner also counts each copy's alignment padding, unknown here)."""
    return schedule.pair_quotas({p: int(b) for p, b in pairs.items()}, max_bucket_bytes)


def traffic_from_pairs(phases: Sequence[PairBytes], placement: Placement, topology: Topology | None = None, *,
                       names: Sequence[str] | None = None, max_bucket_bytes: int | None = None,
                       rounds: Sequence[int | None] | int | None = None,
                       quotas: Sequence[Mapping[tuple[int, int], int] | None] | None = None) -> Traffic:
    """Link load of a refit given as phases of ``{(src_rank, dst_rank): bytes}`` (``Plan.pair_bytes``).

    Rounds, per phase: with ``quotas`` (per phase, ``{(s, d): bytes per round}``, e.g. the
    planner's own), or with ``max_bucket_bytes`` and the planner's quota rule applied to the
    phase's pairs, pair (s, d) sends ``ceil(bytes / quota)`` messages, one per round; with
    ``rounds=R`` each pair's bytes are spread evenly over R rounds; else one round. Pairs on
    one GPU become local copies. Copy counts stay 0 (unknown here; :func:`traffic_from_plan`
    has them).

    >>> from reshard.modeling.topology import Placement, Topology
    >>> place = Placement.contiguous(Topology.preset("dgx-h100"), 2, 2, infer_start="domain")
    >>> place.gpu_of.tolist()                          # ranks 2, 3 infer on the second node
    [0, 1, 8, 9]
    >>> tr = traffic_from_pairs([{(0, 2): 100, (1, 3): 100}, {(2, 3): 40}], place)
    >>> tr.total("nic_in")[[8, 9]].tolist(), float(tr.total("nvlink_in")[9])
    ([100.0, 100.0], 40.0)
    """
    topology = _check_topology(placement, topology)
    names = list(names) if names is not None else (["transfer"] if len(phases) == 1 else
                                                     [f"phase {i + 1}" for i in range(len(phases))])
    if len(names) != len(phases):
        raise ValueError(f"{len(names)} names for {len(phases)} phases")
    per_phase_rounds = [rounds] * len(phases) if rounds is None or isinstance(rounds, int) else list(rounds)
    per_phase_quotas = [None] * len(phases) if quotas is None else list(quotas)
    if len(per_phase_rounds) != len(phases) or len(per_phase_quotas) != len(phases):
        raise ValueError(f"{len(phases)} phases but {len(per_phase_rounds)} round counts / "
                         f"{len(per_phase_quotas)} quota maps")
    G = placement.num_gpus
    out = []
    for name, pairs, r, given in zip(names, phases, per_phase_rounds, per_phase_quotas):
        s, d, b = _pairs_arrays(pairs)
        gs, gd, kind = _link_kind(placement, s, d)
        quota = None
        if r is None and (given is not None or max_bucket_bytes is not None):
            q = given if given is not None else _staging_quotas(
                {(a, c): v for a, c, v in zip(s.tolist(), d.tolist(), b.tolist())}, max_bucket_bytes)
            quota = np.array([q[(a, c)] if q.get((a, c)) is not None else np.inf
                              for a, c in zip(s.tolist(), d.tolist())], np.float64)
            quota = np.where(np.isinf(quota), np.maximum(b, 1), quota)  # unbounded: one chunk
            if (quota <= 0).any():
                raise ValueError(f"max_bucket_bytes={max_bucket_bytes} leaves no room for some pair's messages")
            R = int(np.ceil(b / quota).max()) if len(b) else 1
        else:
            R = max(1, int(r or 1))
        ph = PhaseTraffic.empty(name, R, G)
        for j in range(R):
            bj = b / R if quota is None else np.clip(b - j * quota, 0, quota)
            live = bj > 0
            for k_out, k_in, sel in ((NVL_OUT, NVL_IN, kind == 1), (NIC_OUT, NIC_IN, kind == 2)):
                m = sel & live
                ph.bytes[j, k_out] += np.bincount(gs[m], weights=bj[m], minlength=G)
                ph.bytes[j, k_in] += np.bincount(gd[m], weights=bj[m], minlength=G)
                ph.messages[j, k_out] += np.bincount(gs[m], minlength=G)
                ph.messages[j, k_in] += np.bincount(gd[m], minlength=G)
            remote = (kind > 0) & live
            local = (kind == 0) & live
            ph.pack_bytes[j] += np.bincount(gs[remote | local], weights=bj[remote | local], minlength=G)
            ph.unpack_bytes[j] += np.bincount(gd[remote], weights=bj[remote], minlength=G)
        out.append(ph)
    return Traffic(placement, out)


def traffic_from_plan(plan, placement: Placement, topology: Topology | None = None) -> Traffic:
    """Exact link load of a plan as :class:`~reshard.execution.executor.ReshardExecutor` runs it: one phase,
    every rank's messages by round (``plan.for_rank``), copy counts, local copies with round 0's
    packing and fan-out copies with the last round's unpacking. Builds every rank's part: meant
    for plans a test or a benchmark runs."""
    topology = _check_topology(placement, topology)
    ranks = sorted(set(plan.source.ranks) | set(plan.destination.ranks))
    parts = {r: plan.for_rank(r) for r in ranks}
    R = max([p.num_rounds for p in parts.values()] + [1])
    ph = PhaseTraffic.empty("transfer", R, placement.num_gpus)
    gpu = placement.gpu_of
    dom = topology.gpus_per_domain
    for r, part in parts.items():
        g = int(gpu[r])
        for outgoing, msgs in ((True, part.sends), (False, part.recvs)):
            for m in msgs:
                h = int(gpu[m.peer])
                if h != g:
                    k = (NVL_OUT if outgoing else NVL_IN) if h // dom == g // dom else (NIC_OUT if outgoing else NIC_IN)
                    ph.bytes[m.round, k, g] += m.payload_bytes
                    ph.messages[m.round, k, g] += 1
                side_bytes, side_copies = (ph.pack_bytes, ph.pack_copies) if outgoing else (ph.unpack_bytes,
                                                                                           ph.unpack_copies)
                side_bytes[m.round, g] += m.payload_bytes
                side_copies[m.round, g] += len(m.copies)
        ph.pack_bytes[0, g] += sum(c.nbytes for c in part.local)
        ph.pack_copies[0, g] += len(part.local)
        ph.unpack_bytes[R - 1, g] += sum(c.nbytes for c in part.fanout)
        ph.unpack_copies[R - 1, g] += len(part.fanout)
    return Traffic(placement, [ph])


# ============================================================================================ estimates
@dataclass(frozen=True)
class Bottleneck:
    """The resource that took longest in a phase: a link of one GPU, its packing or unpacking,
    or a shared host."""

    phase: str
    kind: str  # one of LINKS, "pack", "unpack" or "host"
    where: int  # GPU (or node for "host")
    ranks: tuple[int, ...]
    bytes: float
    seconds: float

    def describe(self) -> str:
        place = f"node {self.where}" if self.kind == "host" else f"GPU {self.where}"
        ranks = ""
        if self.ranks:
            shown = ", ".join(map(str, self.ranks[:4])) + (", ..." if len(self.ranks) > 4 else "")
            ranks = f" (rank{'s' if len(self.ranks) > 1 else ''} {shown})"
        return (f"{place}{ranks} {LINK_LABEL[self.kind]}: {self.bytes / 1e9:.4g} GB, {self.seconds:.4g} s "
                f"in {self.phase}")


@dataclass(frozen=True)
class PhaseEstimate:
    name: str
    rounds: int
    seconds: float  # this phase alone, its rounds one after another
    latency_s: float  # of which fixed per-round / per-call costs
    bottleneck: Bottleneck | None


@dataclass(frozen=True)
class Estimate:
    """Modeled time of one refit method on one topology, with a printable breakdown."""

    method: str
    topology: str
    seconds: float
    phases: tuple[PhaseEstimate, ...]
    pipelined: bool = False
    notes: tuple[str, ...] = ()

    @property
    def bottleneck(self) -> Bottleneck | None:
        """The bottleneck of the phase that took longest."""
        best = max(self.phases, key=lambda p: p.seconds, default=None)
        return best.bottleneck if best else None

    def rows(self) -> list[dict]:
        return [{"phase": p.name, "rounds": p.rounds, "seconds": p.seconds, "latency_s": p.latency_s,
                 "bottleneck": p.bottleneck.describe() if p.bottleneck else "-"} for p in self.phases]

    def format(self) -> str:
        """A few lines a person can read."""
        how = ""
        if len(self.phases) > 1:
            how = " (phases pipelined by round)" if self.pipelined else " (phases one after another)"
        lines = [f"{self.method} on {self.topology}: {self.seconds:.4g} s{how}"]
        width = max([len(p.name) for p in self.phases] + [5])
        lines.append(f"  {'phase':<{width}}  {'rounds':>6}  {'alone s':>9}  {'latency s':>9}  bottleneck")
        for p in self.phases:
            lines.append(f"  {p.name:<{width}}  {p.rounds:>6}  {p.seconds:>9.4g}  {p.latency_s:>9.3g}  "
                         f"{p.bottleneck.describe() if p.bottleneck else '-'}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    __str__ = format


def _link_seconds(nbytes: np.ndarray, topology: Topology) -> np.ndarray:
    """[4, G] bytes -> seconds on each link kind."""
    bw = np.array([topology.nic_bytes_per_s, topology.nic_bytes_per_s, topology.nvlink_bytes_per_s,
                   topology.nvlink_bytes_per_s])
    return nbytes / bw[:, None]


def _round(ph: PhaseTraffic, j: int, topology: Topology, node_of_gpu: np.ndarray):
    """Round j: (link s [4, G], pack s [G], unpack s [G], loopback s [nodes] of hosts whose ranks
    share one network; empty elsewhere)."""
    link = _link_seconds(ph.bytes[j], topology)
    o, oc, cbw = topology.message_overhead_s, topology.copy_overhead_s, topology.copy_bytes_per_s
    msgs = ph.messages[j]
    pack = ph.pack_bytes[j] / cbw + (msgs[NIC_OUT] + msgs[NVL_OUT]) * o + ph.pack_copies[j] * oc
    unpack = ph.unpack_bytes[j] / cbw + (msgs[NIC_IN] + msgs[NVL_IN]) * o + ph.unpack_copies[j] * oc
    loop = np.zeros(0)
    if topology.host_cores is not None and topology.host_bytes_per_s is not None and len(pack):
        n_nodes = int(node_of_gpu.max()) + 1
        out = np.bincount(node_of_gpu, weights=ph.bytes[j, NIC_OUT], minlength=n_nodes)
        inn = np.bincount(node_of_gpu, weights=ph.bytes[j, NIC_IN], minlength=n_nodes)
        loop = np.maximum(out, inn) / topology.host_bytes_per_s
    return link, pack, unpack, loop


def _host(work: np.ndarray, loop: np.ndarray, topology: Topology, node_of_gpu: np.ndarray) -> np.ndarray:
    """Seconds per node of CPU ``work`` [G] on shared cores, plus its loopback; empty on GPUs."""
    if topology.host_cores is None or not len(work):
        return np.zeros(0)
    host = np.bincount(node_of_gpu, weights=work, minlength=int(node_of_gpu.max()) + 1) / topology.host_cores
    return host + loop if len(loop) else host


def _latency(msgs: np.ndarray, topology: Topology) -> float:
    if msgs[NIC_OUT].any() or msgs[NIC_IN].any():
        return topology.launch_latency_s + topology.net_latency_s
    if msgs[NVL_OUT].any() or msgs[NVL_IN].any():
        return topology.launch_latency_s + topology.nvlink_latency_s
    return 0.0


def _phase_times(ph: PhaseTraffic, topology: Topology, placement: Placement, overlap: bool = True):
    """Per-round seconds (overlapped: the first also packs round 0, the last unpacks the last round),
    their latency part, and the phase's bottleneck (the resource with the most seconds summed
    over the rounds)."""
    node_of_gpu = placement.gpu_node()
    R, G = ph.rounds, placement.num_gpus
    times, lat = np.zeros(R), np.zeros(R)
    acc_link, acc_pack, acc_unpack = np.zeros((4, G)), np.zeros(G), np.zeros(G)
    acc_host = np.zeros(0)
    parts = [_round(ph, j, topology, node_of_gpu) for j in range(R)]
    peak = lambda a: float(a.max()) if len(a) else 0.0  # noqa: E731
    zero = np.zeros(G)
    packs = [p for _, p, _, _ in parts] + [zero]
    unpacks = [zero] + [u for _, _, u, _ in parts]  # unpacks[j + 1] is round j's
    for j, (link, pk, up, loop) in enumerate(parts):
        lat[j] = _latency(ph.messages[j], topology)
        if overlap:  # round j on the wire while round j+1 is packed and round j-1 unpacked
            host = _host(packs[j + 1] + unpacks[j], loop, topology, node_of_gpu)
            body = max(peak(link), peak(packs[j + 1]) + peak(unpacks[j]), peak(host))
        else:
            host = _host(pk + up, loop, topology, node_of_gpu)
            body = max(peak(pk) + peak(link) + peak(up), peak(host))
        times[j] = lat[j] + body
        acc_link += link
        acc_pack += pk
        acc_unpack += up
        acc_host = host if not len(acc_host) else acc_host + host
    if overlap and R:  # round 0's pack before anything is on the wire, the last round's unpack after
        for j, work in ((0, packs[0]), (R - 1, unpacks[R])):
            host = _host(work, np.zeros(0), topology, node_of_gpu)
            times[j] += max(peak(work), peak(host))
            if len(host):
                acc_host = acc_host + host
    cands = []
    if G:
        k, g = np.unravel_index(int(np.argmax(acc_link)), acc_link.shape)
        cands.append((float(acc_link[k, g]), LINKS[k], int(g), float(ph.bytes[:, k, g].sum())))
        for kind, acc, arr in (("pack", acc_pack, ph.pack_bytes), ("unpack", acc_unpack, ph.unpack_bytes)):
            g = int(np.argmax(acc))
            cands.append((float(acc[g]), kind, g, float(arr[:, g].sum())))
    if len(acc_host):
        n = int(np.argmax(acc_host))
        on = node_of_gpu == n
        cands.append((float(acc_host[n]), "host", n, float(ph.bytes[:, NIC_OUT][:, on].sum())))
    bottleneck = None
    if cands and max(c[0] for c in cands) > 0:
        secs, kind, where, nbytes = max(cands, key=lambda c: c[0])
        ranks = (np.flatnonzero(placement.node_of == where).tolist() if kind == "host"
                 else placement.ranks_on(where))
        bottleneck = Bottleneck(ph.name, kind, where, tuple(ranks), nbytes, secs)
    return times, lat, bottleneck


def model_time(traffic: Traffic, topology: Topology | None = None, *, pipeline: bool = False,
               overlap: bool = True, method: str = "reshard") -> Estimate:
    """Modeled seconds of a refit's traffic (formulas in the module doc and docs/cost_model.md).

    ``overlap``: rounds overlapped as the executor runs them by default (``False``: its sequential
    order); ``pipeline=True``: round j of phase p overlaps round j+1 of phase p-1 (``False``,
    as the executor runs them: phases in turn).
    """
    placement = traffic.placement
    topology = _check_topology(placement, topology)
    per_phase, phases = [], []
    for ph in traffic.phases:
        times, lat, bott = _phase_times(ph, topology, placement, overlap)
        per_phase.append(times)
        phases.append(PhaseEstimate(ph.name, ph.rounds, float(times.sum()), float(lat.sum()), bott))
    pipelined = pipeline and len(per_phase) > 1
    if pipelined:
        R = max(len(t) for t in per_phase)
        finish = np.zeros(R)  # when each round of the previous phase is done
        for t in per_phase:
            t = np.concatenate([t, np.zeros(R - len(t))])
            cur = np.zeros(R)
            for j in range(R):
                cur[j] = max(finish[j], cur[j - 1] if j else 0.0) + t[j]
            finish = cur
        total = float(finish[-1])
    else:
        total = float(sum(t.sum() for t in per_phase))
    return Estimate(method, topology.name, total, tuple(phases), pipelined)


# ============================================================================================ gather-and-broadcast
def broadcast_chain(root: int, receivers: Sequence[int], placement: Placement, channels: int) -> tuple[dict, float]:
    """NCCL's ring broadcast as point-to-point hops, for 1 byte: ``({(a, b): bytes}, hop latency s)``.

    Each of ``channels`` rings carries ``1/channels`` of the data. A ring visits the domains in
    GPU order and, inside each, its members (root among them) in GPU order rotated by the
    channel number, so the channels enter and leave a domain through different GPUs (and NICs),
    as NCCL's rings do; the broadcast runs along the ring from root to the member before it.
    Latency: one network or NVLink hop latency per step of channel 0's chain.
    """
    topo = placement.topology
    gpu, dom = placement.gpu_of, placement.domain_of
    members = [r for r in dict.fromkeys(receivers) if r != root and gpu[r] != gpu[root]]
    if not members:
        return {}, 0.0
    by_dom: dict[int, list[int]] = defaultdict(list)
    for r in sorted(members + [root], key=lambda r: (gpu[r], r)):
        by_dom[int(dom[r])].append(r)
    order = sorted(by_dom)
    hops: dict[tuple[int, int], float] = defaultdict(float)
    share = 1.0 / channels
    chain0: list[int] = []
    for c in range(channels):
        ring = []
        for d in order:
            grp = by_dom[d]
            k = c % len(grp)
            ring += grp[k:] + grp[:k]
        i = ring.index(root)
        chain = ring[i:] + ring[:i]
        for a, b in zip(chain, chain[1:]):
            hops[(a, b)] += share
        if c == 0:
            chain0 = chain
    latency = sum(topo.nvlink_latency_s if dom[a] == dom[b] else topo.net_latency_s
                  for a, b in zip(chain0, chain0[1:]))
    return dict(hops), latency


def gather_broadcast_time(tensor_bytes: Sequence[int], gather_sends: Sequence[Mapping[int, int]], root: int,
                          receivers: Sequence[int], placement: Placement, topology: Topology | None = None, *,
                          bucket_bytes: int | None = None, channels: int = 16) -> Estimate:
    """Gather-and-broadcast as the RL stacks run it, over NCCL on the same links.

    Per bucket of consecutive tensors (``bucket_bytes=None``: one tensor per bucket), one after
    another: (1) *gather*: every source rank ``s`` sends ``gather_sends[i][s]`` bytes of tensor i
    to ``root`` at once (NVLink inside root's domain, else NICs) and root unpacks them:
    ``launch + latency + max_s pack_s + max(NIC in, NVLink in of root) + unpack``; (2)
    *broadcast*: the bucket's bytes go from ``root`` to every receiver as NCCL's ring broadcast
    (NCCL runs Broadcast only with the ring algorithm: a pipelined chain over ``channels`` rings;
    see :func:`broadcast_chain`): ``launch + hop latencies + bytes x (seconds per byte of the
    chain's slowest link)``.

    >>> from reshard.modeling.topology import Placement, Topology
    >>> topo = Topology.preset("dgx-h100").with_(net_latency_s=0, nvlink_latency_s=0, launch_latency_s=0,
    ...                                         message_overhead_s=0, copy_bytes_per_s=float("inf"))
    >>> place = Placement.contiguous(topo, 8, 8)
    >>> est = gather_broadcast_time([100e9], [{1: 50e9}], 0, range(8, 16), place, topo)
    >>> [round(p.seconds, 3) for p in est.phases]      # 50 GB in over NVLink, 100 GB out of one NIC
    [0.111, 2.0]
    """
    topology = _check_topology(placement, topology)
    if len(tensor_bytes) != len(gather_sends):
        raise ValueError(f"{len(tensor_bytes)} tensor sizes but {len(gather_sends)} gather maps")
    gpu, dom = placement.gpu_of, placement.domain_of
    root_gpu = int(gpu[root])
    root_ranks = tuple(placement.ranks_on(root_gpu))
    nic_bw, nvl_bw, cbw, o = (topology.nic_bytes_per_s, topology.nvlink_bytes_per_s, topology.copy_bytes_per_s,
                              topology.message_overhead_s)
    # broadcast: seconds per byte on every link of the chain, computed once
    hops, hop_latency = broadcast_chain(root, receivers, placement, channels)
    bc_lat = topology.launch_latency_s + hop_latency if hops else 0.0
    bc_per_byte, bc_kind, bc_gpu = 0.0, None, -1
    if hops:
        link = _link_seconds(traffic_from_pairs([hops], placement, topology).phases[0].bytes[0], topology)
        k, g = np.unravel_index(int(np.argmax(link)), link.shape)
        bc_per_byte, bc_kind, bc_gpu = float(link[k, g]), LINKS[k], int(g)
    gather_s = gather_lat = bcast_s = total = 0.0
    root_in = np.zeros(2)  # bytes into root over NICs / NVLink, all buckets
    buckets = baseline.buckets(tensor_bytes, bucket_bytes)
    for bucket in buckets:
        size = float(sum(tensor_bytes[i] for i in bucket))
        total += size
        sends: dict[int, float] = defaultdict(float)
        for i in bucket:
            for s, b in gather_sends[i].items():
                if b > 0 and s != root:
                    sends[s] += b
        nic = nvl = local = pack = 0.0
        nmsg = 0
        for s, b in sends.items():
            g = int(gpu[s])
            if g == root_gpu:
                local += b
                continue
            if dom[s] == dom[root]:
                nvl += b
            else:
                nic += b
            nmsg += 1
            pack = max(pack, b / cbw + o)
        body = pack + max(nic / nic_bw, nvl / nvl_bw) + (nic + nvl + local) / cbw + nmsg * o
        if topology.host_cores is not None:
            cpu = (2 * (nic + nvl) + local) / cbw + 2 * nmsg * o
            host = cpu / topology.host_cores + (nic / topology.host_bytes_per_s if topology.host_bytes_per_s else 0.0)
            body = max(body, host)
        lat = 0.0
        if nmsg:
            lat = topology.launch_latency_s + (topology.net_latency_s if nic else topology.nvlink_latency_s)
        gather_s += lat + body
        gather_lat += lat
        root_in += (nic, nvl)
        bcast_s += bc_lat + size * bc_per_byte
    g_bn = None
    if root_in.any():
        k = int(np.argmax(root_in / (nic_bw, nvl_bw)))
        g_bn = Bottleneck("gather", (NIC_IN_NAME, NVL_IN_NAME)[k], root_gpu, root_ranks, float(root_in[k]),
                          float(root_in[k] / (nic_bw, nvl_bw)[k]))
    b_bn = None
    if bc_kind is not None:
        per = nic_bw if bc_kind.startswith("nic") else nvl_bw
        b_bn = Bottleneck("broadcast", bc_kind, bc_gpu, tuple(placement.ranks_on(bc_gpu)),
                          total * bc_per_byte * per, total * bc_per_byte)
    phases = (PhaseEstimate("gather", len(buckets), gather_s, gather_lat, g_bn),
              PhaseEstimate("broadcast", len(buckets), bcast_s, bc_lat * len(buckets), b_bn))
    n_recv = len({r for r in receivers if int(gpu[r]) != root_gpu})
    notes = (f"{len(buckets)} bucket(s) in turn, each a gather to rank {root} then an NCCL ring broadcast "
             f"({channels} channels) to {n_recv} ranks; NCCL runs Broadcast only as a ring",)
    return Estimate("gather-broadcast (naive)", topology.name, gather_s + bcast_s, phases, False, notes)


NIC_IN_NAME, NVL_IN_NAME = LINKS[NIC_IN], LINKS[NVL_IN]


def _spread(load: np.ndarray, g: int, helpers: np.ndarray, b: float, out_kind: int) -> None:
    """``b`` bytes held by GPU ``g`` cross a domain boundary spread evenly over the NICs of
    ``helpers`` (the domain's GPUs in the communicator, ``g`` among them): ``g`` hands each other
    helper its share over NVLink, each helper moves its share over its NIC (``out_kind`` NIC out
    or NIC in; for NIC in, read "hands" the other way: the helpers forward to ``g``)."""
    n = len(helpers)
    share = b / n
    load[out_kind, helpers] += share
    others = helpers[helpers != g]
    if out_kind == NIC_OUT:
        load[NVL_OUT, g] += share * len(others)
        load[NVL_IN, others] += share
    else:
        load[NVL_OUT, others] += share
        load[NVL_IN, g] += share * len(others)


def gather_broadcast_fair_time(stages: Sequence[baseline.Stage], receivers: Sequence[int], placement: Placement,
                               topology: Topology | None = None, *, bucket_bytes: int | None = None,
                               channels: int = 32, relays: Sequence[int] | None = None) -> Estimate:
    """Gather-and-broadcast as its best implementations run it, over NCCL on the same links.

    Every pipeline stage (:func:`reshard.planning.baseline.stage_sends`) works on its own, all at
    once, bucket by bucket (``bucket_bytes``; ``None``: one tensor per bucket), and a bucket's
    broadcast overlaps the next bucket's gather:

    1. *gather* into the stage's root: senders in root's NVLink domain send over NVLink; bytes
       from another domain leave it over the NICs of all its ``relays`` GPUs (default: the
       training ranks) and enter root's domain over all of its ``relays`` GPUs' NICs, NVLink
       taking them to and from those GPUs (what NCCL's multi-rail all-gather rings do);
    2. *broadcast* from root to every receiver on an NCCL ring (:func:`broadcast_chain`) whose
       members also include the ``relays`` GPUs of root's domain, so that root's domain is left
       through all their NICs, not root's alone; ``channels`` rings enter and leave every domain
       through different GPUs, so each domain takes each byte once over all of its NICs and
       each GPU gets every byte over NVLink. ``channels=32`` is NCCL's channel limit
       (``MAXCHANNELS``): enough for every NIC of a DGX node, 32 of an NVL72 domain's 72.

    Round ``j`` holds the ``j``-th bucket of every stage; its time is ``launch + latency +
    max over links (bytes / bandwidth)``, latency the network (or NVLink) latency for the gather
    and the longest ring's hop latencies for the broadcast. Gather and broadcast pipeline by
    bucket, ``F_b[j] = max(F_g[j], F_b[j-1]) + t_b[j]`` (they use different link directions).

    >>> from reshard.modeling.topology import Placement, Topology
    >>> from reshard.planning.baseline import Stage
    >>> topo = Topology.preset("dgx-h100").with_(net_latency_s=0, nvlink_latency_s=0, launch_latency_s=0)
    >>> place = Placement.contiguous(topo, 8, 8)      # training on node 0, inference on node 1
    >>> st = Stage(0, tuple(range(8)), ["w"] * 10, [10e9] * 10, [{r: 1.25e9 for r in range(8)}] * 10)
    >>> est = gather_broadcast_fair_time([st], range(8, 16), place, topo)
    >>> [round(p.seconds, 4) for p in est.phases]    # 8.75 GB in over NVLink, 10 GB over 8 NICs, per bucket
    [0.1944, 0.25]
    >>> round(est.seconds, 4)                         # the first gather, then the broadcasts back to back
    0.2694
    """
    topology = _check_topology(placement, topology)
    G = placement.num_gpus
    gpu = placement.gpu_of
    dsize = topology.gpus_per_domain
    relay_ranks = placement.train_ranks if relays is None else relays
    relay_gpus = np.unique(gpu[list(relay_ranks)]) if len(relay_ranks) else np.zeros(0, np.int64)
    helpers_of: dict[int, np.ndarray] = {}

    def helpers(g: int) -> np.ndarray:
        d = g // dsize
        h = helpers_of.get(d)
        if h is None:
            h = relay_gpus[relay_gpus // dsize == d]
            helpers_of[d] = h
        return h if g in h else np.append(h, g)

    bw = np.array([topology.nic_bytes_per_s] * 2 + [topology.nvlink_bytes_per_s] * 2)[:, None]
    # per stage: buckets, and the broadcast ring's link load per byte and hop latency
    plans = []
    for st in stages:
        root_gpu = int(gpu[st.root])
        peers = [r for r in relay_ranks if gpu[r] // dsize == root_gpu // dsize and r != st.root]
        members = list(dict.fromkeys(peers + list(receivers)))
        hops, hop_lat = broadcast_chain(st.root, members, placement, channels)
        per_byte = traffic_from_pairs([hops], placement, topology).phases[0].bytes[0] if hops else np.zeros((4, G))
        plans.append((st, root_gpu, baseline.buckets(st.sizes, bucket_bytes), per_byte, hop_lat))
    R = max([len(p[2]) for p in plans] + [0])
    t_g, t_b, lat_g, lat_b = np.zeros(R), np.zeros(R), np.zeros(R), np.zeros(R)
    acc_g, acc_b = np.zeros((4, G)), np.zeros((4, G))
    bytes_g, bytes_b = np.zeros((4, G)), np.zeros((4, G))
    total = 0.0
    for j in range(R):
        lg, lb = np.zeros((4, G)), np.zeros((4, G))
        net = nvl = False
        ring_lat = 0.0
        for st, root_gpu, buckets, per_byte, hop_lat in plans:
            if j >= len(buckets):
                continue
            size = float(sum(st.sizes[i] for i in buckets[j]))
            total += size
            if per_byte.any() and size:
                lb += size * per_byte
                ring_lat = max(ring_lat, hop_lat)
            sends: dict[int, float] = defaultdict(float)
            for i in buckets[j]:
                for s, b in st.sends[i].items():
                    if b > 0:
                        sends[int(gpu[s])] += b
            for g, b in sends.items():
                if g == root_gpu:
                    continue
                if g // dsize == root_gpu // dsize:
                    lg[NVL_OUT, g] += b
                    lg[NVL_IN, root_gpu] += b
                    nvl = True
                else:
                    _spread(lg, g, helpers(g), b, NIC_OUT)
                    _spread(lg, root_gpu, helpers(root_gpu), b, NIC_IN)
                    net = True
        sg, sb = lg / bw, lb / bw
        if net or nvl:
            lat_g[j] = topology.launch_latency_s + (topology.net_latency_s if net else topology.nvlink_latency_s)
        if lb.any():
            lat_b[j] = topology.launch_latency_s + ring_lat
        t_g[j] = lat_g[j] + float(sg.max(initial=0.0))
        t_b[j] = lat_b[j] + float(sb.max(initial=0.0))
        acc_g += sg
        acc_b += sb
        bytes_g += lg
        bytes_b += lb
    f_g = f_b = 0.0
    for j in range(R):
        f_g += t_g[j]
        f_b = max(f_g, f_b) + t_b[j]
    phases = []
    for name, t, lat, acc, nb in (("gather", t_g, lat_g, acc_g, bytes_g), ("broadcast", t_b, lat_b, acc_b, bytes_b)):
        bn = None
        if acc.any():
            k, g = np.unravel_index(int(np.argmax(acc)), acc.shape)
            bn = Bottleneck(name, LINKS[k], int(g), tuple(placement.ranks_on(int(g))), float(nb[k, g]),
                            float(acc[k, g]))
        phases.append(PhaseEstimate(name, R, float(t.sum()), float(lat.sum()), bn))
    n_recv = len({int(gpu[r]) for r in receivers})
    notes = ((f"{len(stages)} pipeline stage(s) at once, each gathering into its root and broadcasting on an NCCL "
              f"ring ({channels} channels) to {n_recv} GPUs, with the training GPUs of each domain as its NICs' "
              f"relays; {R} bucket round(s), each bucket's broadcast overlapping the next one's gather"),)
    return Estimate("gather-broadcast (fair)", topology.name, float(f_b), tuple(phases), True, notes)


def gather_broadcast_time_of(plan, placement: Placement, topology: Topology | None = None, *,
                             root: int | None = None, bucket_bytes: int | None = None,
                             channels: int | None = None, variant: str = "naive") -> Estimate:
    """Gather-and-broadcast of a :class:`~reshard.planning.plan.Plan` (its source and destination
    layouts; :mod:`reshard.planning.baseline` gives the roots and per-tensor gather bytes):
    ``variant="naive"`` (:func:`gather_broadcast_time`, one root, the default here for old callers) or
    ``"fair"`` (:func:`gather_broadcast_fair_time`, a root per pipeline stage; ``root`` unused).
    ``channels``: NCCL rings (default: each function's own)."""
    if variant == "fair":
        return gather_broadcast_fair_time(baseline.stage_sends(plan.source, plan.destination),
                                          plan.destination.ranks, placement, topology, bucket_bytes=bucket_bytes,
                                          channels=channels or 32)
    if variant != "naive":
        raise ValueError(f"variant must be 'fair' or 'naive', got {variant!r}")
    root = baseline.default_root(plan) if root is None else root
    _, sizes, sends = baseline.gather_sends(plan, root)
    return gather_broadcast_time(sizes, sends, root, plan.destination.ranks, placement, topology,
                                 bucket_bytes=bucket_bytes, channels=channels or 16)


# ============================================================================================ lower bound
@dataclass(frozen=True)
class Demand:
    """What any refit must move, in bytes (the inputs of :func:`lower_bound`).

    domain_ingress_bytes     NVLink domain -> bytes its destination ranks need that no GPU of the
                             domain holds as a source (each byte counted once per domain)
    dest_need_bytes          destination rank -> bytes it needs and does not hold itself
    source_egress_bytes      bytes that must leave the source side over the network at least once
                             (distinct bytes some domain needs and holds no copy of)
    source_exclusive_bytes   source rank -> bytes only that rank holds that another domain needs
                             (they must leave its domain: disjoint between ranks, so they add up)
    """

    domain_ingress_bytes: Mapping[int, float] = field(default_factory=dict)
    dest_need_bytes: Mapping[int, float] = field(default_factory=dict)
    source_egress_bytes: float = 0.0
    source_exclusive_bytes: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class BoundTerm:
    name: str
    where: str
    bytes: float
    bytes_per_s: float

    @property
    def seconds(self) -> float:
        return self.bytes / self.bytes_per_s if self.bytes else 0.0


@dataclass(frozen=True)
class Bound:
    """The physical lower bound: the largest of its terms."""

    seconds: float
    terms: tuple[BoundTerm, ...]

    @property
    def binding(self) -> BoundTerm | None:
        return max(self.terms, key=lambda t: t.seconds, default=None)

    def format(self) -> str:
        b = self.binding
        head = f"lower bound {self.seconds:.4g} s"
        if b is not None:
            head += f": {b.name} at {b.where}, {b.bytes / 1e9:.3f} GB at {b.bytes_per_s / 1e9:.4g} GB/s"
        return head


def lower_bound(demand: Demand, placement: Placement, topology: Topology | None = None, *,
                ingress: str = "domain") -> Bound:
    """Seconds no refit can beat on these links (bandwidth only: no latency, no copies)::

        max( max_d  ingress[d]                 / (NICs(d) x nic_bw),                         domain NIC ingress
                    source_egress              / (NICs of the source domains x nic_bw),      source NIC egress
             max_d  sum_{s in d} exclusive[s]  / (NICs(d) x nic_bw),                         source domain egress
             max_s  exclusive[s]               / (nic_bw + nvlink_bw if s has a peer, else nic_bw),   source-only bytes
             max_g  need[g]                    / (nic_bw + nvlink_bw if g has a peer, else nic_bw) )  GPU ingress

    ``NICs(d)`` and "a peer" (another GPU of the same NVLink domain) depend on ``ingress``:
    ``"domain"`` (default) counts every GPU of the domain, the job's or idle, whose NIC a refit
    could use by handing bytes over NVLink first; ``"job"`` only the GPUs the placement uses (a
    refit that may not touch other GPUs). ``need[g]`` sums the needs of the destination ranks on
    GPU g. Source bytes may take one NVLink hop to a peer before a NIC, so only the source's
    domain, not its own NIC, bounds its exclusive bytes tightly.

    >>> from reshard.modeling.topology import Placement, Topology
    >>> place = Placement.contiguous(Topology.preset("dgx-h100"), 8, 12)   # inference on domains 1, 2
    >>> d = Demand(domain_ingress_bytes={1: 400e9, 2: 300e9})
    >>> lower_bound(d, place).seconds                    # 400 GB / (8 x 50 GB/s)
    1.0
    >>> lower_bound(d, place, ingress="job").seconds     # domain 2: 300 GB / (the job's 4 NICs x 50 GB/s)
    1.5
    """
    if ingress not in ("domain", "job"):
        raise ValueError(f"ingress must be 'domain' or 'job', got {ingress!r}")
    topology = _check_topology(placement, topology)
    nic, nvl = topology.nic_bytes_per_s, topology.nvlink_bytes_per_s
    size = topology.gpus_per_domain
    used = placement.used_gpus()
    used_dom = used // size
    job = ingress == "job"

    def nics(d: int) -> int:
        return int((used_dom == d).sum()) if job else size

    def has_peer(g: int) -> bool:
        return (int((used_dom == g // size).sum()) if job else size) > 1

    whose = "the job's " if job else ""
    terms: list[BoundTerm] = []
    for d, b in sorted(demand.domain_ingress_bytes.items()):
        if b and not (used_dom == d).any():
            raise ValueError(f"domain {d} must receive {b} bytes but holds no GPU of the placement")
        if b:
            terms.append(BoundTerm("domain NIC ingress", f"domain {d} ({nics(d)} {whose}NICs)", float(b), nics(d) * nic))
    src_gpus = np.unique(placement.gpu_of[list(placement.train_ranks)])
    if demand.source_egress_bytes and not len(src_gpus):
        raise ValueError("source_egress_bytes given but the placement has no training (source) ranks")
    if demand.source_egress_bytes:
        src_doms = np.unique(src_gpus // size).tolist()
        n = sum(nics(d) for d in src_doms)
        terms.append(BoundTerm("source NIC egress", f"{len(src_doms)} source domain(s) ({n} {whose}NICs)",
                               float(demand.source_egress_bytes), n * nic))
    by_dom: dict[int, float] = defaultdict(float)
    for s, b in sorted(demand.source_exclusive_bytes.items()):
        if not b:
            continue
        g = int(placement.gpu_of[s])
        by_dom[g // size] += b
        peer = has_peer(g)
        terms.append(BoundTerm(f"source-only bytes ({'NIC + NVLink' if peer else 'NIC'})", f"rank {s} (GPU {g})",
                               float(b), nic + (nvl if peer else 0.0)))
    for d, b in sorted(by_dom.items()):
        terms.append(BoundTerm("source domain egress", f"domain {d} ({nics(d)} {whose}NICs)", float(b), nics(d) * nic))
    need: dict[int, float] = defaultdict(float)
    for r, b in demand.dest_need_bytes.items():
        need[int(placement.gpu_of[r])] += b
    for g, b in sorted(need.items()):
        if not b:
            continue
        peer = has_peer(g)
        how = "NIC + NVLink" if peer else "NIC"
        terms.append(BoundTerm(f"GPU ingress ({how})", f"GPU {g} (ranks {', '.join(map(str, placement.ranks_on(g)))})",
                               float(b), nic + (nvl if peer else 0.0)))
    return Bound(max((t.seconds for t in terms), default=0.0), tuple(terms))
