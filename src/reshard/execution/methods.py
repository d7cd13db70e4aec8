"""Refit methods by name: the plan each one runs and the executor that runs it.

    method            plan                                            executor
    reshard           plan(source, destination)                       ReshardExecutor
    hierarchical      hierarchical_plan(source, destination, domains)  ReshardExecutor (its phases)
    gather-broadcast  plan(source, destination)                       GatherBroadcastExecutor
    hybrid            HybridPlan(source, destination, rule)           HybridExecutor: the tensors ``rule``
                                                                      picks by reshard, the rest by
                                                                      gather-and-broadcast

The demo and the benchmarks pick methods from here, so a comparison can include any of them;
``reshard`` and ``gather-broadcast`` share one plan. The hybrid's ``rule``
(:class:`~reshard.planning.hybrid.HybridRule`, default: FFN and expert weights by reshard) is the
user's to change: ``method_plan("hybrid", src, dst, rule=HybridRule(patterns=(r"experts",)))``.

>>> import torch, reshard as rs
>>> spec = rs.TensorSpec("w", (4, 4), torch.float32)
>>> src = rs.Layout.from_placements(spec, ranks=[0], mesh_shape=(1,), placements=[rs.Replicate()])
>>> dst = rs.Layout.from_placements(spec, ranks=[1, 2], mesh_shape=(2,), placements=[rs.Replicate()])
>>> method_plan("hierarchical", src, dst, domains={0: 0, 1: 1, 2: 1}).phase_names
['network', 'NVLink forward']
>>> method_plan("hybrid", src, dst, rule=HybridRule(patterns=(r"^w$",))).phase_names  # w picked: by reshard
['transfer']
"""

from __future__ import annotations

from datetime import timedelta
from typing import Mapping

from ..layout import Layout
from ..planning.hierarchy import hierarchical_plan
from ..planning.hybrid import HybridPlan, HybridRule, as_rule
from ..planning.plan import PhasedPlan, plan
from .base import Executor
from .executor import DEFAULT_TIMEOUT, ReshardExecutor
from .gather_broadcast import GatherBroadcastExecutor
from .hybrid import HybridExecutor

RESHARD, GATHER_BROADCAST, HIERARCHICAL, HYBRID = "reshard", "gather-broadcast", "hierarchical", "hybrid"
METHODS = (RESHARD, GATHER_BROADCAST, HIERARCHICAL, HYBRID)


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown refit method {method!r}; choose from {', '.join(METHODS)}")
    return method


def round_cap(max_bucket_bytes: int | None) -> int | None:
    """The staging cap of one round when a rank's total staging must stay under ``max_bucket_bytes``:
    :class:`ReshardExecutor` overlaps neighbouring rounds, so two rounds' buffers are alive at once.

    >>> round_cap(64 << 20) == 32 << 20, round_cap(None)
    (True, None)
    """
    return None if max_bucket_bytes is None else max(1, max_bucket_bytes // 2)


def method_plan(method: str, source: Layout, destination: Layout, *, max_bucket_bytes: int | None = None,
                domains: Mapping[int, int] | None = None, rule: HybridRule | None = None) -> PhasedPlan:
    """The plan ``method`` runs (``domains``, ``{rank: NVLink domain}``, is needed by ``hierarchical``;
    given to ``hybrid``, its reshard part is hierarchical). ``rule``: which tensors the ``hybrid``
    method moves by reshard (a :class:`HybridRule`, a list of regular expressions or a predicate on
    names; default :class:`HybridRule`); an error for the other methods.

    ``max_bucket_bytes`` caps each rank's staging in all (plus the largest single copy of each of
    the two rounds in flight): rounds are scheduled at :func:`round_cap` of it.
    """
    check_method(method)
    if rule is not None and method != HYBRID:
        raise ValueError(f"a hybrid rule was given to the {method} method; only the hybrid method takes one")
    if method == HYBRID:
        return HybridPlan(source, destination, as_rule(rule), max_bucket_bytes=round_cap(max_bucket_bytes),
                          domains=domains)
    if method == HIERARCHICAL:
        if domains is None:
            raise ValueError("the hierarchical method needs domains ({rank: NVLink domain})")
        return hierarchical_plan(source, destination, domains, max_bucket_bytes=round_cap(max_bucket_bytes))
    return plan(source, destination, max_bucket_bytes=round_cap(max_bucket_bytes))


def method_executor(method: str, plan: PhasedPlan, group=None, *, timeout: timedelta = DEFAULT_TIMEOUT,
                    checksum: bool = False, allow_lossy: bool = False) -> Executor:
    """The executor of ``method`` for ``plan`` (collective: every rank of ``group`` builds one, and
    :meth:`~reshard.execution.base.Executor.close` s it). ``checksum`` and ``allow_lossy`` are the
    reshard executor's options (for ``hybrid``: of both parts, the checksum of its reshard part);
    gather-and-broadcast has neither."""
    if check_method(method) == GATHER_BROADCAST:
        if checksum:
            raise ValueError("the gather-broadcast method has no checksum option")
        return GatherBroadcastExecutor(plan, group, timeout=timeout)
    if method == HYBRID:
        if not isinstance(plan, HybridPlan):
            raise ValueError(f"the hybrid method runs a HybridPlan (method_plan('hybrid', ...)), got "
                             f"{type(plan).__name__}")
        return HybridExecutor(plan, group, timeout=timeout, checksum=checksum, allow_lossy=allow_lossy)
    return ReshardExecutor(plan, group, timeout=timeout, checksum=checksum, allow_lossy=allow_lossy)


__all__ = ["GATHER_BROADCAST", "HIERARCHICAL", "HYBRID", "METHODS", "RESHARD", "check_method", "method_executor",
           "method_plan", "round_cap"]
