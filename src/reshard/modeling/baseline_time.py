"""Modeled time of gather-and-broadcast, the baseline (:mod:`reshard.planning.baseline`), on the same links.

Two ways: :func:`gather_broadcast_fair_time` as its best implementations run it (a gather into
each pipeline stage's root and an NCCL ring broadcast from it, all stages at once, multi-rail:
a domain's traffic spread over all its NICs; each bucket's broadcast overlapping the next one's
gather), and :func:`gather_broadcast_time`, the naive form (one root gathers everything and
broadcasts it through its one NIC, bucket after bucket). :func:`gather_broadcast_time_of` runs
either on a :class:`~reshard.planning.plan.Plan`'s layouts. Formulas in ``docs/cost_model.md``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..planning import baseline
from .estimate import Bottleneck, Estimate, PhaseEstimate
from .topology import Placement, Topology
from .traffic import LINKS, NIC_IN, NIC_OUT, NVL_IN, NVL_OUT, link_seconds, traffic_from_pairs


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


def broadcast_chain(root: int, receivers: Sequence[int], placement: Placement, channels: int) -> tuple[dict, float]:
    """NCCL's ring broadcast as point-to-point hops, for 1 byte: ``({(a, b): bytes}, hop latency s)``.

    Each of ``channels`` rings carries ``1/channels`` of the data. A ring visits the domains in
    GPU order and, inside each, its members (root among them) in GPU order rotated by the
    channel number, so the channels enter and leave a domain through different GPUs (and NICs),
    as NCCL's rings do; the broadcast runs along the ring from root to the member before it.
    Latency: one network or NVLink hop latency per step of channel 0's chain.
    """
    topology = placement.topology
    gpu_of, domain_of = placement.gpu_of, placement.domain_of
    members = [rank for rank in dict.fromkeys(receivers) if rank != root and gpu_of[rank] != gpu_of[root]]
    if not members:
        return {}, 0.0
    by_domain: dict[int, list[int]] = defaultdict(list)
    for rank in sorted(members + [root], key=lambda rank: (gpu_of[rank], rank)):
        by_domain[int(domain_of[rank])].append(rank)
    hops: dict[tuple[int, int], float] = defaultdict(float)
    share = 1.0 / channels
    first_chain: list[int] = []
    for channel in range(channels):
        ring = []
        for domain in sorted(by_domain):
            group = by_domain[domain]
            shift = channel % len(group)
            ring += group[shift:] + group[:shift]
        start = ring.index(root)
        chain = ring[start:] + ring[:start]
        for sender, receiver in zip(chain, chain[1:]):
            hops[(sender, receiver)] += share
        if channel == 0:
            first_chain = chain
    latency = sum(topology.nvlink_latency_s if domain_of[sender] == domain_of[receiver] else topology.net_latency_s
                  for sender, receiver in zip(first_chain, first_chain[1:]))
    return dict(hops), latency


# ---------------------------------------------------------------------------------------------- naive
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
    topology = placement.check_topology(topology)
    if len(tensor_bytes) != len(gather_sends):
        raise ValueError(f"{len(tensor_bytes)} tensor sizes but {len(gather_sends)} gather maps")
    root_gpu = int(placement.gpu_of[root])
    ring = _ring_link(root, receivers, placement, topology, channels)  # computed once, for every bucket
    gather_s = gather_latency = broadcast_s = total = 0.0
    root_in = np.zeros(2)  # bytes into root over NICs / NVLink, all buckets
    buckets = baseline.buckets(tensor_bytes, bucket_bytes)
    for bucket in buckets:
        size = float(sum(tensor_bytes[i] for i in bucket))
        total += size
        gather = _gather_bucket(bucket, gather_sends, root, placement, topology)
        gather_s += gather.latency + gather.body
        gather_latency += gather.latency
        root_in += (gather.nic_bytes, gather.nvlink_bytes)
        broadcast_s += ring.latency + size * ring.seconds_per_byte
    phases = (PhaseEstimate("gather", len(buckets), gather_s, gather_latency,
                            _root_ingress_bottleneck(root_in, root_gpu, placement, topology)),
              PhaseEstimate("broadcast", len(buckets), broadcast_s, ring.latency * len(buckets),
                            ring.bottleneck(total, placement, topology)))
    num_receivers = len({rank for rank in receivers if int(placement.gpu_of[rank]) != root_gpu})
    notes = (f"{len(buckets)} bucket(s) in turn, each a gather to rank {root} then an NCCL ring broadcast "
             f"({channels} channels) to {num_receivers} ranks; NCCL runs Broadcast only as a ring",)
    return Estimate("gather-broadcast (naive)", topology.name, gather_s + broadcast_s, phases, False, notes)


@dataclass(frozen=True)
class _RingLink:
    """A broadcast ring's slowest link: per broadcast ``latency`` (launch + hop latencies; 0 with no
    hop), ``seconds_per_byte`` broadcast, and which link of which GPU that is (``kind`` None: no hop)."""

    latency: float
    seconds_per_byte: float
    kind: str | None
    gpu: int

    def bottleneck(self, total_bytes: float, placement: Placement, topology: Topology) -> Bottleneck | None:
        """That link as the broadcast phase's bottleneck, after ``total_bytes`` broadcast."""
        if self.kind is None:
            return None
        bandwidth = topology.nic_bytes_per_s if self.kind.startswith("nic") else topology.nvlink_bytes_per_s
        return Bottleneck("broadcast", self.kind, self.gpu, tuple(placement.ranks_on(self.gpu)),
                          total_bytes * self.seconds_per_byte * bandwidth, total_bytes * self.seconds_per_byte)


def _ring_link(root: int, receivers: Sequence[int], placement: Placement, topology: Topology,
               channels: int) -> _RingLink:
    hops, hop_latency = broadcast_chain(root, receivers, placement, channels)
    if not hops:
        return _RingLink(0.0, 0.0, None, -1)
    link = link_seconds(traffic_from_pairs([hops], placement, topology).phases[0].bytes[0], topology)
    kind, gpu = np.unravel_index(int(np.argmax(link)), link.shape)
    return _RingLink(topology.launch_latency_s + hop_latency, float(link[kind, gpu]), LINKS[kind], int(gpu))


@dataclass(frozen=True)
class _GatherStep:
    """One bucket's gather into root: fixed ``latency``, the rest (``body``) in seconds, and the bytes
    root took in over its NIC and over NVLink."""

    latency: float
    body: float
    nic_bytes: float
    nvlink_bytes: float


def _gather_bucket(bucket: Sequence[int], gather_sends: Sequence[Mapping[int, int]], root: int,
                   placement: Placement, topology: Topology) -> _GatherStep:
    """Every source sends root its bytes of the bucket's tensors at once; root unpacks them."""
    alike: dict[int, list] = {}  # tensors alike share one sends dict (whole bytes: any order sums them exactly)
    for i in bucket:
        hit = alike.get(id(gather_sends[i]))
        if hit is None:
            alike[id(gather_sends[i])] = [gather_sends[i], 1]
        else:
            hit[1] += 1
    sends: dict[int, int] = defaultdict(int)
    for per_source, count in alike.values():
        for src, nbytes in per_source.items():
            if nbytes > 0 and src != root:
                sends[src] += nbytes * count
    gpu_of, domain_of = placement.gpu_of, placement.domain_of
    copy_bw, per_message = topology.copy_bytes_per_s, topology.message_overhead_s
    nic = nvlink = local = pack = 0.0
    num_messages = 0
    for src, nbytes in sends.items():
        if int(gpu_of[src]) == int(gpu_of[root]):
            local += nbytes
            continue
        if domain_of[src] == domain_of[root]:
            nvlink += nbytes
        else:
            nic += nbytes
        num_messages += 1
        pack = max(pack, nbytes / copy_bw + per_message)
    body = (pack + max(nic / topology.nic_bytes_per_s, nvlink / topology.nvlink_bytes_per_s)
            + (nic + nvlink + local) / copy_bw + num_messages * per_message)
    if topology.host_cores is not None:
        cpu = (2 * (nic + nvlink) + local) / copy_bw + 2 * num_messages * per_message
        host = cpu / topology.host_cores + (nic / topology.host_bytes_per_s if topology.host_bytes_per_s else 0.0)
        body = max(body, host)
    latency = 0.0
    if num_messages:
        latency = topology.launch_latency_s + (topology.net_latency_s if nic else topology.nvlink_latency_s)
    return _GatherStep(latency, body, nic, nvlink)


def _root_ingress_bottleneck(root_in: np.ndarray, root_gpu: int, placement: Placement,
                             topology: Topology) -> Bottleneck | None:
    """The slower of root's NIC in and NVLink in over the whole gather; None if nothing came in."""
    if not root_in.any():
        return None
    bandwidth = (topology.nic_bytes_per_s, topology.nvlink_bytes_per_s)
    link = int(np.argmax(root_in / bandwidth))
    return Bottleneck("gather", (LINKS[NIC_IN], LINKS[NVL_IN])[link], root_gpu, tuple(placement.ranks_on(root_gpu)),
                      float(root_in[link]), float(root_in[link] / bandwidth[link]))


# ---------------------------------------------------------------------------------------------- fair
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
    topology = placement.check_topology(topology)
    relay_ranks = placement.train_ranks if relays is None else relays
    relays_of = _Relays(placement, relay_ranks)
    rings = [_stage_ring(stage, receivers, relay_ranks, placement, topology, channels, bucket_bytes)
             for stage in stages]
    num_rounds = max([len(ring.buckets) for ring in rings] + [0])
    gather = _PhaseTally("gather", num_rounds, placement.num_gpus)
    broadcast = _PhaseTally("broadcast", num_rounds, placement.num_gpus)
    cells = _GatherCells(placement)
    for j in range(num_rounds):
        load = _fair_round(j, rings, placement, relays_of, cells)
        gather_latency = 0.0
        if load.network or load.nvlink:
            gather_latency = topology.launch_latency_s + (topology.net_latency_s if load.network
                                                          else topology.nvlink_latency_s)
        broadcast_latency = topology.launch_latency_s + load.ring_latency if load.broadcast.any() else 0.0
        gather.add(j, load.gather, gather_latency, topology)
        broadcast.add(j, load.broadcast, broadcast_latency, topology)
    gather_done = broadcast_done = 0.0
    for j in range(num_rounds):  # bucket j's broadcast starts once its gather and bucket j-1's broadcast are done
        gather_done += gather.seconds[j]
        broadcast_done = max(gather_done, broadcast_done) + broadcast.seconds[j]
    num_receivers = len({int(placement.gpu_of[rank]) for rank in receivers})
    notes = ((f"{len(stages)} pipeline stage(s) at once, each gathering into its root and broadcasting on an NCCL "
              f"ring ({channels} channels) to {num_receivers} GPUs, with the training GPUs of each domain as its "
              f"NICs' relays; {num_rounds} bucket round(s), each bucket's broadcast overlapping the next one's "
              f"gather"),)
    return Estimate("gather-broadcast (fair)", topology.name, float(broadcast_done),
                    (gather.estimate(placement), broadcast.estimate(placement)), True, notes)


class _Relays:
    """The GPUs whose NICs carry a domain's bytes across its boundary: the relay ranks' GPUs in it."""

    def __init__(self, placement: Placement, relay_ranks: Sequence[int]):
        self._gpus = np.unique(placement.gpu_of[list(relay_ranks)]) if len(relay_ranks) else np.zeros(0, np.int64)
        self._domain_size = placement.topology.gpus_per_domain
        self._of_domain: dict[int, np.ndarray] = {}

    def of(self, gpu: int) -> np.ndarray:
        """The relay GPUs of ``gpu``'s domain, ``gpu`` among them."""
        domain = gpu // self._domain_size
        relays = self._of_domain.get(domain)
        if relays is None:
            relays = self._gpus[self._gpus // self._domain_size == domain]
            self._of_domain[domain] = relays
        return relays if gpu in relays else np.append(relays, gpu)


@dataclass(frozen=True)
class _StageRing:
    """A pipeline stage as the fair model runs it: its root's GPU, its buckets, and its broadcast
    ring's link load per byte ``[4, G]`` and hop latency."""

    stage: baseline.Stage
    root_gpu: int
    buckets: list[list[int]]
    load_per_byte: np.ndarray
    hop_latency: float


def _stage_ring(stage: baseline.Stage, receivers: Sequence[int], relay_ranks: Sequence[int], placement: Placement,
                topology: Topology, channels: int, bucket_bytes: int | None) -> _StageRing:
    """The ring a stage broadcasts on: root, the relays of root's domain, then the receivers."""
    gpu_of, domain_size = placement.gpu_of, topology.gpus_per_domain
    root_gpu = int(gpu_of[stage.root])
    peers = [rank for rank in relay_ranks if gpu_of[rank] // domain_size == root_gpu // domain_size
             and rank != stage.root]
    members = list(dict.fromkeys(peers + list(receivers)))
    hops, hop_latency = broadcast_chain(stage.root, members, placement, channels)
    load_per_byte = (traffic_from_pairs([hops], placement, topology).phases[0].bytes[0] if hops
                     else np.zeros((len(LINKS), placement.num_gpus)))
    return _StageRing(stage, root_gpu, baseline.buckets(stage.sizes, bucket_bytes), load_per_byte, hop_latency)


@dataclass
class _RoundLoad:
    """Bytes ``[4, G]`` one bucket round puts on each link, for the gather and for the broadcast;
    whether the gather crosses the network or NVLink, and the longest ring's hop latency."""

    gather: np.ndarray
    broadcast: np.ndarray
    network: bool = False
    nvlink: bool = False
    ring_latency: float = 0.0


def _fair_round(j: int, rings: Sequence[_StageRing], placement: Placement, relays: _Relays,
                cells: "_GatherCells") -> _RoundLoad:
    """Round ``j``: the ``j``-th bucket of every stage that has one, gathered and broadcast at once."""
    shape = (len(LINKS), placement.num_gpus)
    load = _RoundLoad(np.zeros(shape), np.zeros(shape))
    flat = load.gather.reshape(-1)
    for ring in rings:
        if j >= len(ring.buckets):
            continue
        bucket = ring.buckets[j]
        size = float(sum(ring.stage.sizes[i] for i in bucket))
        if ring.load_per_byte.any() and size:
            load.broadcast += size * ring.load_per_byte
            load.ring_latency = max(load.ring_latency, ring.hop_latency)
        gpus, sent = cells.sends(ring.stage.sends, bucket)
        if not len(gpus):
            continue
        index, divisor, factor, counts, network, nvlink = cells.pattern(ring.root_gpu, gpus, relays)
        # each GPU's bytes on its cells (_GatherCells.spread), added in the order the GPUs first send
        np.add.at(flat, index, np.repeat(sent, counts) / divisor * factor)
        load.network |= network
        load.nvlink |= nvlink
    return load


class _GatherCells:
    """What a gather round adds to the links, worked out once per tensor and per set of sending GPUs
    (the same few recur in every round): per tensor its sending GPUs and bytes, per (root, GPUs) the
    link cells each GPU's bytes go on (:meth:`spread`, or the NVLink hop inside root's domain), in order."""

    def __init__(self, placement: Placement):
        self._gpu_of = placement.gpu_of
        self._num_gpus = placement.num_gpus
        self._domain_size = placement.topology.gpus_per_domain
        self._tensors: dict[int, tuple] = {}
        self._patterns: dict[tuple, tuple] = {}
        self._spreads: dict[tuple[int, int], tuple] = {}

    def _tensor(self, sends: Mapping[int, float]) -> tuple[np.ndarray, np.ndarray]:
        hit = self._tensors.get(id(sends))  # the stages (and their dicts) stay alive while the model runs
        if hit is None:
            live = [(src, nbytes) for src, nbytes in sends.items() if nbytes > 0]
            gpus = self._gpu_of[np.array([src for src, _ in live], np.int64)]
            hit = self._tensors[id(sends)] = (sends, gpus.astype(np.int64),
                                              np.array([nbytes for _, nbytes in live], np.float64))
        return hit[1], hit[2]

    def sends(self, sends: Sequence[Mapping[int, float]], bucket: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(sending GPUs in the order they first send, bytes each sends) of one bucket."""
        parts = [self._tensor(sends[i]) for i in bucket]
        gpus = np.concatenate([g for g, _ in parts]) if parts else np.zeros(0, np.int64)
        if not len(gpus):
            return gpus, np.zeros(0)
        nbytes = np.concatenate([b for _, b in parts])
        total = np.bincount(gpus, weights=nbytes, minlength=self._num_gpus)  # in order, as a running sum
        uniq, first = np.unique(gpus, return_index=True)
        order = uniq[np.argsort(first, kind="stable")]
        return order, total[order]

    def spread(self, gpu: int, helpers: np.ndarray, out_kind: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Bytes held by ``gpu`` cross a domain boundary spread evenly over the NICs of ``helpers`` (the
        domain's GPUs in the communicator, ``gpu`` among them): ``gpu`` hands each other helper its
        share over NVLink, each helper moves its share over its NIC (``out_kind`` NIC out or NIC in;
        for NIC in, the helpers forward to ``gpu``). Returns (flat link cells, each one's multiple of
        the share, the number of helpers: the share is bytes / helpers)."""
        key = (gpu, out_kind)
        hit = self._spreads.get(key)
        if hit is None:
            g = self._num_gpus
            others = helpers[helpers != gpu]
            if out_kind == NIC_OUT:
                index = np.concatenate([out_kind * g + helpers, [NVL_OUT * g + gpu], NVL_IN * g + others])
                factor = np.concatenate([np.ones(len(helpers)), [float(len(others))], np.ones(len(others))])
            else:
                index = np.concatenate([out_kind * g + helpers, NVL_OUT * g + others, [NVL_IN * g + gpu]])
                factor = np.concatenate([np.ones(len(helpers)), np.ones(len(others)), [float(len(others))]])
            hit = self._spreads[key] = (index.astype(np.int64), factor, len(helpers))
        return hit

    def pattern(self, root_gpu: int, gpus: np.ndarray, relays: _Relays) -> tuple:
        """(cells, divisor, factor, cells per GPU, any network, any NVLink) of sending GPUs ``gpus``."""
        key = (root_gpu, gpus.tobytes())
        hit = self._patterns.get(key)
        if hit is not None:
            return hit
        g, ds = self._num_gpus, self._domain_size
        index, divisor, factor, counts = [], [], [], []
        network = nvlink = False
        for gpu in gpus.tolist():
            if gpu == root_gpu:
                counts.append(0)
                continue
            if gpu // ds == root_gpu // ds:
                parts = [(np.array([NVL_OUT * g + gpu, NVL_IN * g + root_gpu], np.int64), np.ones(2), 1)]
                nvlink = True
            else:
                parts = [self.spread(gpu, relays.of(gpu), NIC_OUT),
                         self.spread(root_gpu, relays.of(root_gpu), NIC_IN)]
                network = True
            n = 0
            for cells, times, helpers in parts:
                index.append(cells)
                factor.append(times)
                divisor.append(np.full(len(cells), float(helpers)))
                n += len(cells)
            counts.append(n)
        empty = np.zeros(0)
        hit = self._patterns[key] = (np.concatenate(index) if index else np.zeros(0, np.int64),
                                     np.concatenate(divisor) if divisor else empty,
                                     np.concatenate(factor) if factor else empty,
                                     np.array(counts, np.int64), network, nvlink)
        return hit


class _PhaseTally:
    """Seconds per round of one fair-model phase, and each link's busy seconds and bytes over them all."""

    def __init__(self, name: str, num_rounds: int, num_gpus: int):
        self.name = name
        self.seconds, self.latency = np.zeros(num_rounds), np.zeros(num_rounds)
        self.busy, self.bytes = np.zeros((len(LINKS), num_gpus)), np.zeros((len(LINKS), num_gpus))

    def add(self, j: int, load: np.ndarray, latency: float, topology: Topology) -> None:
        on_links = link_seconds(load, topology)
        self.latency[j] = latency
        self.seconds[j] = latency + float(on_links.max(initial=0.0))
        self.busy += on_links
        self.bytes += load

    def estimate(self, placement: Placement) -> PhaseEstimate:
        bottleneck = None
        if self.busy.any():
            link, gpu = np.unravel_index(int(np.argmax(self.busy)), self.busy.shape)
            bottleneck = Bottleneck(self.name, LINKS[link], int(gpu), tuple(placement.ranks_on(int(gpu))),
                                    float(self.bytes[link, gpu]), float(self.busy[link, gpu]))
        return PhaseEstimate(self.name, len(self.seconds), float(self.seconds.sum()), float(self.latency.sum()),
                             bottleneck)
