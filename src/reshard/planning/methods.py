"""Refit methods by name: one entry each, saying how its plan is made, which executor runs it and
which options it takes. Adding a method is one entry here (and, for a new kind of plan, its executor).

    method            plan                                         executor                 options it takes
    reshard           Plan(source, destination)                    ReshardExecutor          checksum, precision
    hierarchical      hierarchical_plan(..., domains)              ReshardExecutor          checksum, precision,
                                                                                            domains (needed)
    hybrid            HybridPlan(..., rule, domains)               HybridExecutor           checksum, hybrid_rule,
                                                                                            domains
    gather-broadcast  GatherBroadcastPlan(Plan(source, destination)) GatherBroadcastExecutor  -

Every method also takes the options every refit has: ``max_bucket_bytes`` (the most staging
bytes a rank holds at once), ``timeout`` and ``allow_lossy``. ``"auto"`` is not an entry: a
session resolves it to ``hierarchical`` where it found NVLink domains, else ``reshard``
(:func:`resolve`). A dtype policy (``precision``) is a transform of a method's plan: the entry's
``precise`` maker plans the same method with each destination tensor in its policy's precision
(:class:`~reshard.planning.precision.PrecisionPlan`, run by the precision executor).

>>> import torch, reshard as rs
>>> spec = rs.TensorSpec("w", (4, 4), torch.float32)
>>> src = rs.Layout.from_placements(spec, ranks=[0], mesh_shape=(1,), placements=[rs.Replicate()])
>>> dst = rs.Layout.from_placements(spec, ranks=[1, 2], mesh_shape=(2,), placements=[rs.Replicate()])
>>> METHODS["hierarchical"].make(src, dst, rs.RefitOptions(method="hierarchical", domains={0: 0, 1: 1, 2: 1})).phase_names
['network', 'NVLink forward']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from ..errors import OptionsError
from ..layout import Layout
from .baseline import GatherBroadcastPlan
from .hierarchy import hierarchical_plan
from .hybrid import HybridPlan
from .plan import PhasedPlan, Plan
from .precision import PrecisionPlan

RESHARD, GATHER_BROADCAST, HIERARCHICAL, HYBRID = "reshard", "gather-broadcast", "hierarchical", "hybrid"
AUTO = "auto"
COMMON_OPTIONS = frozenset({"method", "max_bucket_bytes", "timeout", "allow_lossy"})

# (source, destination, options: a reshard.options.RefitOptions) -> the plan
PlanMaker = Callable[[Layout, Layout, "RefitOptions"], PhasedPlan]


@dataclass(frozen=True)
class Method:
    """One refit method: ``plan`` makes its plan from the two layouts and the options, ``precise``
    (None: the method takes no dtype policy) makes it under ``options.precision``; ``executor`` names
    the executor class that runs its plans; ``takes`` the options it takes beyond
    :data:`COMMON_OPTIONS`; ``needs`` those it cannot plan without (found by the session, or given)."""

    name: str
    plan: PlanMaker
    executor: str
    takes: frozenset[str] = frozenset()
    needs: frozenset[str] = frozenset()
    precise: PlanMaker | None = None

    def make(self, source: Layout, destination: Layout, options: "RefitOptions") -> PhasedPlan:
        """This method's plan, under the options' dtype policy if they have one."""
        for name in sorted(self.needs):
            if getattr(options, name) is None:
                raise OptionsError(f"method {self.name!r} needs option {name!r} (none given, and the session found "
                                   f"none)")
        if options.precision is not None:
            return self.precise(source, destination, options)
        return self.plan(source, destination, options)

    def accepts(self, option: str) -> bool:
        return option in COMMON_OPTIONS or option in self.takes


def _direct(source: Layout, destination: Layout, options: "RefitOptions") -> Plan:
    return Plan(source, destination, max_bucket_bytes=options.max_bucket_bytes)


def _hierarchical(source: Layout, destination: Layout, options: "RefitOptions") -> PhasedPlan:
    return hierarchical_plan(source, destination, options.domains, max_bucket_bytes=options.max_bucket_bytes)


def _hybrid(source: Layout, destination: Layout, options: "RefitOptions") -> HybridPlan:
    return HybridPlan(source, destination, options.hybrid_rule, max_bucket_bytes=options.max_bucket_bytes,
                      domains=options.domains)


def _gather_broadcast(source: Layout, destination: Layout, options: "RefitOptions") -> GatherBroadcastPlan:
    return GatherBroadcastPlan(Plan(source, destination))


def _precise(domains: bool) -> PlanMaker:
    def make(source: Layout, destination: Layout, options: "RefitOptions") -> PrecisionPlan:
        return PrecisionPlan(source, destination, options.policy, max_bucket_bytes=options.max_bucket_bytes,
                             domains=options.domains if domains else None)
    return make


METHODS: dict[str, Method] = {m.name: m for m in (
    Method(RESHARD, _direct, "ReshardExecutor", frozenset({"checksum", "precision"}), precise=_precise(False)),
    Method(HIERARCHICAL, _hierarchical, "ReshardExecutor", frozenset({"checksum", "precision", "domains"}),
           needs=frozenset({"domains"}), precise=_precise(True)),
    Method(HYBRID, _hybrid, "HybridExecutor", frozenset({"checksum", "hybrid_rule", "domains"})),
    Method(GATHER_BROADCAST, _gather_broadcast, "GatherBroadcastExecutor"),
)}
METHOD_NAMES = tuple(METHODS)
# "auto" becomes one of these (resolve): it takes what either takes
AUTO_TAKES = METHODS[RESHARD].takes | METHODS[HIERARCHICAL].takes


def resolve(method: str, domains: Mapping[int, int] | None) -> str:
    """The method ``"auto"`` stands for (``hierarchical`` with NVLink domains, else ``reshard``); other
    names as they are."""
    if method != AUTO:
        return method
    return HIERARCHICAL if domains else RESHARD


__all__ = ["AUTO", "AUTO_TAKES", "COMMON_OPTIONS", "GATHER_BROADCAST", "HIERARCHICAL", "HYBRID", "METHODS",
           "METHOD_NAMES", "Method", "RESHARD", "resolve"]
