"""Modeled time of a refit's :class:`~reshard.modeling.traffic.Traffic` as the Reshard executors run it.

Every formula and assumption is in ``docs/cost_model.md``; the short version:

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

**Phases** run one after another, as the executor runs them. A pipelined hierarchical plan
(:meth:`~reshard.planning.hierarchy.HierarchicalPlan.pipelined`) reaches this model as one phase per
step, every phase of the step in the same rounds (:func:`reshard.modeling.pipeline.pipelined_traffic`),
which is what the executor runs. ``pipeline=True`` is an idealized wavefront instead, which no
executor runs: round j of phase p starts when round j of phase p-1 and round j-1 of phase p are
both done (``F[p,j] = max(F[p-1,j], F[p,j-1]) + t[p,j]``).

>>> from reshard.modeling.topology import Placement, Topology
>>> from reshard.modeling.traffic import traffic_from_pairs
>>> topo = Topology.preset("dgx-h100").with_(net_latency_s=0, launch_latency_s=0, message_overhead_s=0)
>>> place = Placement.contiguous(topo, 8, 8)           # training on node 0, inference on node 1
>>> tr = traffic_from_pairs([{(0, 8): 50_000_000_000}], place, topo)
>>> round(model_time(tr, topo).seconds, 4)           # 50 GB over one 50 GB/s NIC, + pack and unpack
1.0597
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .estimate import Bottleneck, Estimate, PhaseEstimate
from .topology import Placement, Topology
from .traffic import LINKS, NIC_IN, NIC_OUT, NVL_IN, NVL_OUT, PhaseTraffic, Traffic, link_seconds


def model_time(traffic: Traffic, topology: Topology | None = None, *, pipeline: bool = False,
               overlap: bool = True, method: str = "reshard") -> Estimate:
    """Modeled seconds of a refit's traffic (formulas in the module doc and docs/cost_model.md).

    ``overlap``: rounds overlapped as the executor runs them by default (``False``: its sequential
    order); ``pipeline=True``: round j of phase p overlaps round j+1 of phase p-1 (``False``,
    as the executor runs them: phases in turn).
    """
    placement = traffic.placement
    topology = placement.check_topology(topology)
    round_times, phases = [], []
    for phase in traffic.phases:
        times, latency, bottleneck = _phase_times(phase, topology, placement, overlap)
        round_times.append(times)
        phases.append(PhaseEstimate(phase.name, phase.rounds, float(times.sum()), float(latency.sum()), bottleneck))
    pipelined = pipeline and len(round_times) > 1
    if pipelined:
        total = _pipelined_seconds(round_times)
    else:
        total = float(sum(times.sum() for times in round_times))
    return Estimate(method, topology.name, total, tuple(phases), pipelined)


def _pipelined_seconds(round_times: list[np.ndarray]) -> float:
    """When the last round of the last phase is done, round j of phase p starting once round j of
    phase p-1 and round j-1 of phase p are."""
    num_rounds = max(len(times) for times in round_times)
    finish = np.zeros(num_rounds)  # when each round of the previous phase is done
    for times in round_times:
        times = np.concatenate([times, np.zeros(num_rounds - len(times))])
        current = np.zeros(num_rounds)
        for j in range(num_rounds):
            current[j] = max(finish[j], current[j - 1] if j else 0.0) + times[j]
        finish = current
    return float(finish[-1])


# ---------------------------------------------------------------------------------------------- one phase
@dataclass
class _RoundWork:
    """Seconds each resource is busy in one round: ``link`` [4, G], ``pack`` and ``unpack`` [G], and
    ``loopback`` [nodes] of hosts whose ranks share one network (empty elsewhere)."""

    link: np.ndarray
    pack: np.ndarray
    unpack: np.ndarray
    loopback: np.ndarray


@dataclass
class _Busy:
    """Seconds each resource is busy over all rounds of a phase (``host`` empty on GPUs)."""

    link: np.ndarray
    pack: np.ndarray
    unpack: np.ndarray
    host: np.ndarray


def _phase_times(phase: PhaseTraffic, topology: Topology, placement: Placement, overlap: bool = True):
    """Per-round seconds (overlapped: the first also packs round 0, the last unpacks the last round),
    their latency part, and the phase's bottleneck (the resource with the most seconds summed
    over the rounds)."""
    node_of_gpu = placement.gpu_node()
    work = [_round_work(phase, j, topology, node_of_gpu) for j in range(phase.rounds)]
    times, latency, busy = _round_times(phase, work, topology, node_of_gpu, placement.num_gpus, overlap)
    return times, latency, _bottleneck(phase, busy, placement, node_of_gpu)


def _round_work(phase: PhaseTraffic, j: int, topology: Topology, node_of_gpu: np.ndarray) -> _RoundWork:
    """What round ``j`` of ``phase`` keeps each resource busy for."""
    link = link_seconds(phase.bytes[j], topology)
    per_message, per_copy = topology.message_overhead_s, topology.copy_overhead_s
    copy_bw = topology.copy_bytes_per_s
    messages = phase.messages[j]
    pack = (phase.pack_bytes[j] / copy_bw + (messages[NIC_OUT] + messages[NVL_OUT]) * per_message
            + phase.pack_copies[j] * per_copy)
    unpack = (phase.unpack_bytes[j] / copy_bw + (messages[NIC_IN] + messages[NVL_IN]) * per_message
              + phase.unpack_copies[j] * per_copy)
    loopback = np.zeros(0)
    if topology.host_cores is not None and topology.host_bytes_per_s is not None and len(pack):
        num_nodes = int(node_of_gpu.max()) + 1
        sent = np.bincount(node_of_gpu, weights=phase.bytes[j, NIC_OUT], minlength=num_nodes)
        received = np.bincount(node_of_gpu, weights=phase.bytes[j, NIC_IN], minlength=num_nodes)
        loopback = np.maximum(sent, received) / topology.host_bytes_per_s
    return _RoundWork(link, pack, unpack, loopback)


def _round_times(phase: PhaseTraffic, work: list[_RoundWork], topology: Topology, node_of_gpu: np.ndarray,
                 num_gpus: int, overlap: bool) -> tuple[np.ndarray, np.ndarray, _Busy]:
    """Seconds of each round, their latency part, and what each resource did over the phase."""
    num_rounds = phase.rounds
    times, latency = np.zeros(num_rounds), np.zeros(num_rounds)
    busy = _Busy(np.zeros((len(LINKS), num_gpus)), np.zeros(num_gpus), np.zeros(num_gpus), np.zeros(0))
    idle = np.zeros(num_gpus)
    packs = [round_work.pack for round_work in work] + [idle]
    unpacks = [idle] + [round_work.unpack for round_work in work]  # unpacks[j + 1] is round j's
    for j, round_work in enumerate(work):
        latency[j] = _latency(phase.messages[j], topology)
        if overlap:  # round j on the wire while round j+1 is packed and round j-1 unpacked
            host = _host(packs[j + 1] + unpacks[j], round_work.loopback, topology, node_of_gpu)
            body = max(_peak(round_work.link), _peak(packs[j + 1]) + _peak(unpacks[j]), _peak(host))
        else:
            host = _host(round_work.pack + round_work.unpack, round_work.loopback, topology, node_of_gpu)
            body = max(_peak(round_work.pack) + _peak(round_work.link) + _peak(round_work.unpack), _peak(host))
        times[j] = latency[j] + body
        busy.link += round_work.link
        busy.pack += round_work.pack
        busy.unpack += round_work.unpack
        busy.host = host if not len(busy.host) else busy.host + host
    if overlap and num_rounds:  # round 0's pack before anything is on the wire, the last round's unpack after
        for j, edge_work in ((0, packs[0]), (num_rounds - 1, unpacks[num_rounds])):
            host = _host(edge_work, np.zeros(0), topology, node_of_gpu)
            times[j] += max(_peak(edge_work), _peak(host))
            if len(host):
                busy.host = busy.host + host
    return times, latency, busy


def _peak(seconds: np.ndarray) -> float:
    return float(seconds.max()) if len(seconds) else 0.0


def _host(work: np.ndarray, loopback: np.ndarray, topology: Topology, node_of_gpu: np.ndarray) -> np.ndarray:
    """Seconds per node of CPU ``work`` [G] on shared cores, plus its loopback; empty on GPUs."""
    if topology.host_cores is None or not len(work):
        return np.zeros(0)
    host = np.bincount(node_of_gpu, weights=work, minlength=int(node_of_gpu.max()) + 1) / topology.host_cores
    return host + loopback if len(loopback) else host


def _latency(messages: np.ndarray, topology: Topology) -> float:
    """Fixed cost of a round: the network's latency if it sends a network message, else NVLink's."""
    if messages[NIC_OUT].any() or messages[NIC_IN].any():
        return topology.launch_latency_s + topology.net_latency_s
    if messages[NVL_OUT].any() or messages[NVL_IN].any():
        return topology.launch_latency_s + topology.nvlink_latency_s
    return 0.0


def _bottleneck(phase: PhaseTraffic, busy: _Busy, placement: Placement,
                node_of_gpu: np.ndarray) -> Bottleneck | None:
    """The resource busy longest over the phase (a link, packing, unpacking or a shared host); None if none is."""
    candidates = []  # (seconds, kind, GPU or node, bytes)
    if placement.num_gpus:
        link, gpu = np.unravel_index(int(np.argmax(busy.link)), busy.link.shape)
        candidates.append((float(busy.link[link, gpu]), LINKS[link], int(gpu), float(phase.bytes[:, link, gpu].sum())))
        for kind, seconds, work_bytes in (("pack", busy.pack, phase.pack_bytes),
                                          ("unpack", busy.unpack, phase.unpack_bytes)):
            gpu = int(np.argmax(seconds))
            candidates.append((float(seconds[gpu]), kind, gpu, float(work_bytes[:, gpu].sum())))
    if len(busy.host):
        node = int(np.argmax(busy.host))
        on_node = node_of_gpu == node
        candidates.append((float(busy.host[node]), "host", node, float(phase.bytes[:, NIC_OUT][:, on_node].sum())))
    if not candidates or not max(candidate[0] for candidate in candidates) > 0:
        return None
    seconds, kind, where, nbytes = max(candidates, key=lambda candidate: candidate[0])
    ranks = (np.flatnonzero(placement.node_of == where).tolist() if kind == "host"
             else placement.ranks_on(where))
    return Bottleneck(phase.name, kind, where, tuple(ranks), nbytes, seconds)
