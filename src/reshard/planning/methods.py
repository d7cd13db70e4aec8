"""Refit methods by name: one entry each, saying how its plan is made, which executor runs it and
which options it takes. Adding a method is one entry here (and, for a new kind of plan, its executor).

    method            plan                                         executor                 options it takes
    reshard           Plan(source, destination)                    ReshardExecutor          checksum
    hierarchical      hierarchical_plan(..., domains)              ReshardExecutor          checksum,
                                                                                            domains (needed)
    hybrid            HybridPlan(..., rule, domains)               HybridExecutor           checksum, hybrid_rule,
                                                                                            domains
    gather-broadcast  GatherBroadcastPlan(Plan(source, destination)) GatherBroadcastExecutor  -

Every method also takes the options every refit has: ``max_bucket_bytes`` (the most staging
bytes a rank holds at once), ``timeout``, ``allow_lossy`` and ``precision``. ``"auto"`` is not
an entry: a session resolves it to ``hierarchical`` where it found NVLink domains, else
``reshard`` (:func:`resolve`).

A dtype policy (``precision``) is a transform of any method's plan: :meth:`Method.make` plans a
:class:`~reshard.planning.precision.PrecisionPlan` whose wire (FP8 values, scales, raw blocks and
the other tensors) is the method's own plan, run by the precision executor around the method's
executor. Each block is quantized where some source rank holds it whole, except by
gather-and-broadcast (and the hybrid's gather-and-broadcast part), which sends every block in
the source's precision and quantizes it on the receivers, as the stacks that gather and
broadcast do. Where the options carry NVLink domains (methods that take ``domains``: given, or
found by the session on GPU hosts), blocks no source rank holds whole but the source ranks of one
domain hold together (FSDP's row pieces) are first assembled on one of them
(:func:`source_domains`, :mod:`reshard.planning.fp8_assembly`) and cross as FP8; without domains
they cross in the source's precision, as before. The hybrid rule picks a wire tensor by the
destination tensor it carries (``w_scale_inv`` and ``w@raw`` go with ``w``).

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
from .fp8_blocks import carried_tensor
from .hierarchy import hierarchical_plan
from .hybrid import HybridPlan, HybridRule
from .plan import PhasedPlan, Plan
from .precision import PrecisionPlan

RESHARD, GATHER_BROADCAST, HIERARCHICAL, HYBRID = "reshard", "gather-broadcast", "hierarchical", "hybrid"
AUTO = "auto"
COMMON_OPTIONS = frozenset({"method", "max_bucket_bytes", "timeout", "allow_lossy", "precision", "receive",
                            "max_receive_staging_bytes"})

# (source, destination, options: a reshard.options.RefitOptions) -> the plan
PlanMaker = Callable[[Layout, Layout, "RefitOptions"], PhasedPlan]


@dataclass(frozen=True)
class Method:
    """One refit method: ``plan`` makes its plan from the two layouts and the options; ``executor``
    names the executor class that runs its plans; ``takes`` the options it takes beyond
    :data:`COMMON_OPTIONS`; ``needs`` those it cannot plan without (found by the session, or given);
    ``quantize_at_source(options)``: under a dtype policy, which tensors have the blocks a source
    holds whole quantized there (a predicate on names; the others are quantized on the receivers)."""

    name: str
    plan: PlanMaker
    executor: str
    takes: frozenset[str] = frozenset()
    needs: frozenset[str] = frozenset()
    quantize_at_source: Callable[["RefitOptions"], Callable[[str], bool]] = lambda options: _everywhere

    def make(self, source: Layout, destination: Layout, options: "RefitOptions") -> PhasedPlan:
        """This method's plan; under the options' dtype policy, a PrecisionPlan with it as the wire."""
        for name in sorted(self.needs):
            if getattr(options, name) is None:
                raise OptionsError(f"method {self.name!r} needs option {name!r} (none given, and the session found "
                                   f"none)")
        if options.precision is None:
            return self.plan(source, destination, options)
        wire_options = (options.replace(hybrid_rule=CarriedTensorRule.of(options.hybrid_rule))
                        if self.accepts("hybrid_rule") else options)

        def wire(wire_source: Layout, wire_destination: Layout) -> PhasedPlan:
            return self.plan(wire_source, wire_destination, wire_options)

        return PrecisionPlan(source, destination, options.policy, max_bucket_bytes=options.max_bucket_bytes,
                             wire=wire, at_source=self.quantize_at_source(options),
                             assemble=source_domains(source, options.domains))

    def accepts(self, option: str) -> bool:
        return option in COMMON_OPTIONS or option in self.takes


class CarriedTensorRule(HybridRule):
    """A hybrid rule applied to the tensor a wire tensor carries part of (``w_scale_inv`` and
    ``w@raw`` follow ``w``), so that a precision plan's wire splits as the method would split the
    destination tensors."""

    @classmethod
    def of(cls, rule: HybridRule | None) -> "CarriedTensorRule":
        rule = HybridRule() if rule is None else rule
        return cls(patterns=rule.patterns, predicate=rule.predicate)

    def __call__(self, name: str) -> bool:
        return HybridRule.__call__(self, carried_tensor(name))

    @property
    def key(self) -> str:
        return "carried:" + HybridRule.key.fget(self)


def source_domains(source: Layout, domains: Mapping[int, int] | None) -> dict[int, int] | None:
    """The NVLink domains of ``source``'s ranks (the ``assemble`` of a precision plan: blocks no source rank
    holds whole are assembled inside them), or None without domains.

    >>> import torch, reshard as rs
    >>> spec = rs.TensorSpec("w", (4, 4), torch.float32)
    >>> source_domains(rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(0)]), {0: 0, 1: 0, 2: 1})
    {0: 0, 1: 0}
    """
    if not domains:
        return None
    return {rank: domains[rank] for rank in source.ranks if rank in domains} or None


def _everywhere(name: str) -> bool:
    return True


def _nowhere(name: str) -> bool:
    return False


def _picked_by_rule(options: "RefitOptions") -> Callable[[str], bool]:
    """The hybrid's reshard part quantizes at the sources; its gather-and-broadcast part on the receivers."""
    return HybridRule() if options.hybrid_rule is None else options.hybrid_rule


def _direct(source: Layout, destination: Layout, options: "RefitOptions") -> Plan:
    return Plan(source, destination, max_bucket_bytes=options.max_bucket_bytes)


def _hierarchical(source: Layout, destination: Layout, options: "RefitOptions") -> PhasedPlan:
    return hierarchical_plan(source, destination, options.domains, max_bucket_bytes=options.max_bucket_bytes)


def _hybrid(source: Layout, destination: Layout, options: "RefitOptions") -> HybridPlan:
    return HybridPlan(source, destination, options.hybrid_rule, max_bucket_bytes=options.max_bucket_bytes,
                      domains=options.domains)


def _gather_broadcast(source: Layout, destination: Layout, options: "RefitOptions") -> GatherBroadcastPlan:
    return GatherBroadcastPlan(Plan(source, destination))


METHODS: dict[str, Method] = {m.name: m for m in (
    Method(RESHARD, _direct, "ReshardExecutor", frozenset({"checksum"})),
    Method(HIERARCHICAL, _hierarchical, "ReshardExecutor", frozenset({"checksum", "domains"}),
           needs=frozenset({"domains"})),
    Method(HYBRID, _hybrid, "HybridExecutor", frozenset({"checksum", "hybrid_rule", "domains"}),
           quantize_at_source=_picked_by_rule),
    Method(GATHER_BROADCAST, _gather_broadcast, "GatherBroadcastExecutor", quantize_at_source=lambda options: _nowhere),
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


__all__ = ["AUTO", "AUTO_TAKES", "COMMON_OPTIONS", "CarriedTensorRule", "GATHER_BROADCAST", "HIERARCHICAL", "HYBRID", "METHODS",
           "METHOD_NAMES", "Method", "RESHARD", "resolve", "source_domains"]
