"""The physical lower bound of a refit: seconds no method can beat on these links.

:func:`lower_bound` takes the slowest of each domain's ingress over its NICs (every NIC of the
domain, or with ``ingress="job"`` the job's only), the sources' egress, the bytes only one source
holds (out of its domain; out of its GPU over its NIC or one NVLink hop), and each GPU's need over
its NIC and NVLink. :class:`Demand` says what must move; ``RefitModel.demand`` builds it from
layouts. Formulas in ``docs/cost_model.md``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from .topology import Placement, Topology


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
        return max(self.terms, key=lambda term: term.seconds, default=None)

    def format(self) -> str:
        binding = self.binding
        head = f"lower bound {self.seconds:.4g} s"
        if binding is not None:
            head += (f": {binding.name} at {binding.where}, {binding.bytes / 1e9:.3f} GB at "
                     f"{binding.bytes_per_s / 1e9:.4g} GB/s")
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
    links = _Links(placement, placement.check_topology(topology), job=ingress == "job")
    terms = (_domain_ingress_terms(demand, links) + _source_egress_terms(demand, placement, links)
             + _source_exclusive_terms(demand, placement, links) + _gpu_ingress_terms(demand, placement, links))
    return Bound(max((term.seconds for term in terms), default=0.0), tuple(terms))


class _Links:
    """The NICs a domain may use and whether a GPU may hand bytes to a peer over NVLink: every GPU
    of the domain, or (``job``) only those the placement uses."""

    def __init__(self, placement: Placement, topology: Topology, job: bool):
        self.nic_bw, self.nvlink_bw = topology.nic_bytes_per_s, topology.nvlink_bytes_per_s
        self.domain_size = topology.gpus_per_domain
        self.used_domain = placement.used_gpus() // self.domain_size  # of each used GPU
        self.job = job
        self.whose = "the job's " if job else ""

    def nics(self, domain: int) -> int:
        return int((self.used_domain == domain).sum()) if self.job else self.domain_size

    def gpu_bw(self, gpu: int) -> float:
        """A GPU's own NIC, plus NVLink if it has a peer in its domain to relay through."""
        return self.nic_bw + (self.nvlink_bw if self.has_peer(gpu) else 0.0)

    def has_peer(self, gpu: int) -> bool:
        return self.nics(gpu // self.domain_size) > 1


def _domain_ingress_terms(demand: Demand, links: _Links) -> list[BoundTerm]:
    terms = []
    for domain, nbytes in sorted(demand.domain_ingress_bytes.items()):
        if nbytes and not (links.used_domain == domain).any():
            raise ValueError(f"domain {domain} must receive {nbytes} bytes but holds no GPU of the placement")
        if nbytes:
            terms.append(BoundTerm("domain NIC ingress", f"domain {domain} ({links.nics(domain)} {links.whose}NICs)",
                                   float(nbytes), links.nics(domain) * links.nic_bw))
    return terms


def _source_egress_terms(demand: Demand, placement: Placement, links: _Links) -> list[BoundTerm]:
    src_gpus = np.unique(placement.gpu_of[list(placement.train_ranks)])
    if demand.source_egress_bytes and not len(src_gpus):
        raise ValueError("source_egress_bytes given but the placement has no training (source) ranks")
    if not demand.source_egress_bytes:
        return []
    src_domains = np.unique(src_gpus // links.domain_size).tolist()
    nics = sum(links.nics(domain) for domain in src_domains)
    return [BoundTerm("source NIC egress", f"{len(src_domains)} source domain(s) ({nics} {links.whose}NICs)",
                      float(demand.source_egress_bytes), nics * links.nic_bw)]


def _source_exclusive_terms(demand: Demand, placement: Placement, links: _Links) -> list[BoundTerm]:
    """Each source's exclusive bytes out of its GPU, then each source domain's out of the domain."""
    terms = []
    by_domain: dict[int, float] = defaultdict(float)
    for src, nbytes in sorted(demand.source_exclusive_bytes.items()):
        if not nbytes:
            continue
        gpu = int(placement.gpu_of[src])
        by_domain[gpu // links.domain_size] += nbytes
        how = "NIC + NVLink" if links.has_peer(gpu) else "NIC"
        terms.append(BoundTerm(f"source-only bytes ({how})", f"rank {src} (GPU {gpu})", float(nbytes),
                               links.gpu_bw(gpu)))
    for domain, nbytes in sorted(by_domain.items()):
        terms.append(BoundTerm("source domain egress", f"domain {domain} ({links.nics(domain)} {links.whose}NICs)",
                               float(nbytes), links.nics(domain) * links.nic_bw))
    return terms


def _gpu_ingress_terms(demand: Demand, placement: Placement, links: _Links) -> list[BoundTerm]:
    need: dict[int, float] = defaultdict(float)  # by GPU: its destination ranks' needs
    for rank, nbytes in demand.dest_need_bytes.items():
        need[int(placement.gpu_of[rank])] += nbytes
    terms = []
    for gpu, nbytes in sorted(need.items()):
        if not nbytes:
            continue
        how = "NIC + NVLink" if links.has_peer(gpu) else "NIC"
        ranks = ", ".join(map(str, placement.ranks_on(gpu)))
        terms.append(BoundTerm(f"GPU ingress ({how})", f"GPU {gpu} (ranks {ranks})", float(nbytes), links.gpu_bw(gpu)))
    return terms
