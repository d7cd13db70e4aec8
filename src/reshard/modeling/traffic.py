"""Traffic: how many bytes and messages a refit puts on each link of each GPU, round by round.

A refit is a list of phases (a plain plan has one; a hierarchical one has a network phase
and an NVLink fan-out phase), each a list of rounds. A pair of ranks in one NVLink domain
moves its bytes over NVLink, any other pair over both GPUs' NICs; two ranks on one GPU copy
locally. :func:`traffic_from_pairs` counts this from bytes per rank pair (``Plan.pair_bytes``),
:func:`traffic_from_plan` exactly from a plan's messages. The time models
(:mod:`reshard.modeling.reshard_time`, :mod:`reshard.modeling.gather_broadcast`) read the result.

Pure numpy: plain data in (bytes per rank pair, a :class:`~reshard.modeling.topology.Placement`,
a :class:`~reshard.modeling.topology.Topology`), plain data out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..planning import schedule
from ..planning.pair_arrays import PairArrays
from .topology import Placement, Topology

#: link kinds, in the order of the ``bytes``/``messages`` arrays
LINKS = ("nic_out", "nic_in", "nvlink_out", "nvlink_in")
NIC_OUT, NIC_IN, NVL_OUT, NVL_IN = range(4)
LINK_LABEL = {"nic_out": "NIC out", "nic_in": "NIC in", "nvlink_out": "NVLink out", "nvlink_in": "NVLink in",
              "pack": "pack + post sends", "unpack": "unpack + post receives",
              "host": "shared host cores + loopback"}

PairBytes = Mapping[tuple[int, int], int]

# how a pair of ranks is connected (see _link_kind)
_SAME_GPU, _NVLINK, _NETWORK = 0, 1, 2


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
        per_link = (rounds, len(LINKS), gpus)
        per_gpu = (rounds, gpus)
        return cls(name, np.zeros(per_link), np.zeros(per_link), np.zeros(per_gpu), np.zeros(per_gpu),
                   np.zeros(per_gpu), np.zeros(per_gpu))

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
        for phase in self.phases:
            out += phase.total(kind)
        return out

    def network_bytes(self) -> float:
        """Bytes that cross the network (each counted once, at the sender)."""
        return float(self.total("nic_out").sum())

    def nvlink_bytes(self) -> float:
        return float(self.total("nvlink_out").sum())


def link_seconds(link_bytes: np.ndarray, topology: Topology) -> np.ndarray:
    """``[4, G]`` bytes on each link kind of each GPU -> seconds on those links."""
    bandwidth = np.array([topology.nic_bytes_per_s, topology.nic_bytes_per_s, topology.nvlink_bytes_per_s,
                          topology.nvlink_bytes_per_s])
    return link_bytes / bandwidth[:, None]


# ---------------------------------------------------------------------------------------------- from pairs
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
    placement.check_topology(topology)
    names = list(names) if names is not None else (["transfer"] if len(phases) == 1 else
                                                     [f"phase {i + 1}" for i in range(len(phases))])
    if len(names) != len(phases):
        raise ValueError(f"{len(names)} names for {len(phases)} phases")
    per_phase_rounds = [rounds] * len(phases) if rounds is None or isinstance(rounds, int) else list(rounds)
    per_phase_quotas = [None] * len(phases) if quotas is None else list(quotas)
    if len(per_phase_rounds) != len(phases) or len(per_phase_quotas) != len(phases):
        raise ValueError(f"{len(phases)} phases but {len(per_phase_rounds)} round counts / "
                         f"{len(per_phase_quotas)} quota maps")
    return Traffic(placement, [_phase_from_pairs(name, pairs, placement, phase_rounds, phase_quotas, max_bucket_bytes)
                               for name, pairs, phase_rounds, phase_quotas
                               in zip(names, phases, per_phase_rounds, per_phase_quotas)])


def _phase_from_pairs(name: str, pairs: PairBytes, placement: Placement, rounds: int | None,
                      quotas: Mapping[tuple[int, int], int] | None, max_bucket_bytes: int | None) -> PhaseTraffic:
    """One phase of :func:`traffic_from_pairs`: each pair's bytes cut into rounds, then counted per link."""
    src, dst, pair_bytes = _pairs_arrays(pairs)
    src_gpu, dst_gpu, kind = _link_kind(placement, src, dst)
    quota = None  # bytes per round of each pair; None: spread evenly over `num_rounds`
    if rounds is None and (quotas is not None or max_bucket_bytes is not None):
        quota = _round_quotas(src, dst, pair_bytes, quotas, max_bucket_bytes)
        num_rounds = int(np.ceil(pair_bytes / quota).max()) if len(pair_bytes) else 1
    else:
        num_rounds = max(1, int(rounds or 1))
    phase = PhaseTraffic.empty(name, num_rounds, placement.num_gpus)
    for j in range(num_rounds):
        sent = pair_bytes / num_rounds if quota is None else np.clip(pair_bytes - j * quota, 0, quota)
        _count_round(phase, j, src_gpu, dst_gpu, kind, sent)
    return phase


def _pairs_arrays(pairs: PairBytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source ranks, destination ranks, bytes) of the pairs that move any bytes (bytes may be
    fractions: a modeled baseline's shares)."""
    if isinstance(pairs, PairArrays):
        keep = pairs.nbytes > 0
        return pairs.src[keep], pairs.dst[keep], pairs.nbytes[keep].astype(np.float64)
    if not pairs:
        no_ranks = np.zeros(0, np.int64)
        return no_ranks, no_ranks, np.zeros(0)
    ranks = np.array(list(pairs.keys()), np.int64).reshape(-1, 2)
    pair_bytes = np.fromiter(pairs.values(), np.float64, len(pairs))
    keep = pair_bytes > 0
    return ranks[keep, 0], ranks[keep, 1], pair_bytes[keep]


def _link_kind(placement: Placement, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(GPU of src, GPU of dst, kind) with kind ``_SAME_GPU``, ``_NVLINK`` or ``_NETWORK``."""
    gpu_of = placement.gpu_of
    num_ranks = len(gpu_of)
    both = np.concatenate([src, dst])
    unplaced = both[(both < 0) | (both >= num_ranks)]
    if len(unplaced):
        raise ValueError(f"rank {int(unplaced[0])} is not placed (the placement has ranks 0..{num_ranks - 1})")
    src_gpu, dst_gpu = gpu_of[src], gpu_of[dst]
    domain_size = placement.topology.gpus_per_domain
    kind = np.where(src_gpu == dst_gpu, _SAME_GPU,
                    np.where(src_gpu // domain_size == dst_gpu // domain_size, _NVLINK, _NETWORK))
    return src_gpu, dst_gpu, kind


def _round_quotas(src: np.ndarray, dst: np.ndarray, pair_bytes: np.ndarray,
                  quotas: Mapping[tuple[int, int], int] | None, max_bucket_bytes: int | None) -> np.ndarray:
    """Bytes per round of each pair: from ``quotas`` if given, else the planner's rule
    (:func:`reshard.planning.schedule.pair_quotas` at :func:`~reshard.planning.schedule.round_cap` of a
    rank's staging cap ``max_bucket_bytes``) applied to payload bytes alone (the planner also counts
    each copy's alignment padding, unknown here). A pair with no quota goes in one round."""
    if quotas is None:  # the pairs are distinct: their quotas in order, from their whole bytes
        quota = schedule.stream_quotas(src, dst, pair_bytes.astype(np.int64),
                                       schedule.round_cap(max_bucket_bytes)).astype(np.float64)
    else:
        quota = np.array([quotas[(s, d)] if quotas.get((s, d)) is not None else np.inf
                          for s, d in zip(src.tolist(), dst.tolist())], np.float64)
    quota = np.where(np.isinf(quota), np.maximum(pair_bytes, 1), quota)  # unbounded: one chunk
    if (quota <= 0).any():
        raise ValueError(f"max_bucket_bytes={max_bucket_bytes} leaves no room for some pair's messages")
    return quota


def _count_round(phase: PhaseTraffic, j: int, src_gpu: np.ndarray, dst_gpu: np.ndarray, kind: np.ndarray,
                 sent: np.ndarray) -> None:
    """Add round ``j``, in which each pair sends ``sent`` bytes, to ``phase``'s link and copy counts."""
    gpus = phase.bytes.shape[2]
    live = sent > 0
    for out_link, in_link, on_link in ((NVL_OUT, NVL_IN, kind == _NVLINK), (NIC_OUT, NIC_IN, kind == _NETWORK)):
        moving = on_link & live
        phase.bytes[j, out_link] += np.bincount(src_gpu[moving], weights=sent[moving], minlength=gpus)
        phase.bytes[j, in_link] += np.bincount(dst_gpu[moving], weights=sent[moving], minlength=gpus)
        phase.messages[j, out_link] += np.bincount(src_gpu[moving], minlength=gpus)
        phase.messages[j, in_link] += np.bincount(dst_gpu[moving], minlength=gpus)
    remote = (kind != _SAME_GPU) & live
    phase.pack_bytes[j] += np.bincount(src_gpu[live], weights=sent[live], minlength=gpus)  # local copies too
    phase.unpack_bytes[j] += np.bincount(dst_gpu[remote], weights=sent[remote], minlength=gpus)


# ---------------------------------------------------------------------------------------------- from a plan
def traffic_from_plan(plan, placement: Placement, topology: Topology | None = None) -> Traffic:
    """Exact link load of a plan as :class:`~reshard.execution.executor.ReshardExecutor` runs it: one phase,
    every rank's messages by round (``plan.for_rank``), copy counts, local copies with round 0's
    packing and fan-out copies with the last round's unpacking. Builds every rank's part: meant
    for plans a test or a benchmark runs."""
    topology = placement.check_topology(topology)
    ranks = sorted(set(plan.source.ranks) | set(plan.destination.ranks))
    parts = {rank: plan.for_rank(rank) for rank in ranks}
    num_rounds = max([part.num_rounds for part in parts.values()] + [1])
    phase = PhaseTraffic.empty("transfer", num_rounds, placement.num_gpus)
    for rank, part in parts.items():
        gpu = int(placement.gpu_of[rank])
        _count_messages(phase, gpu, part, placement.gpu_of, topology.gpus_per_domain)
        phase.pack_bytes[0, gpu] += sum(copy.nbytes for copy in part.local)
        phase.pack_copies[0, gpu] += len(part.local)
        phase.unpack_bytes[num_rounds - 1, gpu] += sum(copy.nbytes for copy in part.fanout)
        phase.unpack_copies[num_rounds - 1, gpu] += len(part.fanout)
    return Traffic(placement, [phase])


def _count_messages(phase: PhaseTraffic, gpu: int, part, gpu_of: np.ndarray, domain_size: int) -> None:
    """Add one rank's sends and receives (``part``: its ``plan.for_rank``), on GPU ``gpu``, to ``phase``."""
    for outgoing, messages in ((True, part.sends), (False, part.recvs)):
        nvlink, nic = (NVL_OUT, NIC_OUT) if outgoing else (NVL_IN, NIC_IN)
        side_bytes, side_copies = ((phase.pack_bytes, phase.pack_copies) if outgoing
                                   else (phase.unpack_bytes, phase.unpack_copies))
        for message in messages:
            peer_gpu = int(gpu_of[message.peer])
            if peer_gpu != gpu:
                link = nvlink if peer_gpu // domain_size == gpu // domain_size else nic
                phase.bytes[message.round, link, gpu] += message.payload_bytes
                phase.messages[message.round, link, gpu] += 1
            side_bytes[message.round, gpu] += message.payload_bytes
            side_copies[message.round, gpu] += len(message.copies)
