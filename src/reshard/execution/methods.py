"""The executor of each refit method (:data:`~reshard.planning.methods.METHODS` names it), built from a
finished plan and the refit's options. Every entry point (sessions, the demo, benchmarks) makes a
method's plan and executor here, so a comparison can include any method::

    plan = make_plan(options, source, destination)         # the method's plan (precision applied)
    ex = make_executor(options, plan, group)               # collective where the executor says so

>>> import torch, reshard as rs
>>> spec = rs.TensorSpec("w", (4, 4), torch.float32)
>>> src = rs.Layout.from_placements(spec, ranks=[0], mesh_shape=(1,), placements=[rs.Replicate()])
>>> dst = rs.Layout.from_placements(spec, ranks=[1, 2], mesh_shape=(2,), placements=[rs.Replicate()])
>>> method_plan("hierarchical", src, dst, domains={0: 0, 1: 1, 2: 1}).phase_names
['network', 'NVLink forward']
>>> method_plan("hybrid", src, dst, rule=rs.HybridRule(patterns=(r"^w$",))).phase_names  # w picked: by reshard
['transfer']
"""

from __future__ import annotations

from datetime import timedelta
from typing import Mapping

from ..errors import OptionsError
from ..layout import Layout
from ..options import DEFAULT_TIMEOUT, RefitOptions
from ..planning.hybrid import HybridRule
from ..planning.methods import GATHER_BROADCAST, HIERARCHICAL, HYBRID, METHOD_NAMES, RESHARD
from ..planning.methods import METHODS as REGISTRY
from ..planning.plan import PhasedPlan
from ..planning.precision import PrecisionPlan
from ..planning.schedule import round_cap
from .base import Executor
from .executor import ReshardExecutor
from .gather_broadcast import GatherBroadcastExecutor
from .hybrid import HybridExecutor
from .precision import PrecisionExecutor

EXECUTORS: dict[str, type[Executor]] = {cls.__name__: cls for cls in (
    ReshardExecutor, HybridExecutor, GatherBroadcastExecutor, PrecisionExecutor)}


def make_plan(options: RefitOptions, source: Layout, destination: Layout) -> PhasedPlan:
    """The plan of ``options.method`` (resolved: not ``"auto"``) from ``source`` to ``destination``."""
    return REGISTRY[options.method].make(source, destination, options)


def make_executor(options: RefitOptions, plan: PhasedPlan, group=None) -> Executor:
    """The executor of ``options.method`` for its ``plan`` (a :class:`PrecisionPlan` runs on the
    precision executor around the method's), with the options it takes. Collective where the executor's
    ``collective_setup`` says so; the caller closes it."""
    cls = EXECUTORS[REGISTRY[options.method].executor]
    kwargs = {"timeout": options.timeout, "allow_lossy": options.allow_lossy}
    if cls.checksums:
        kwargs["checksum"] = options.checksum
    if isinstance(plan, PrecisionPlan):
        return PrecisionExecutor(plan, group, wire=cls, **kwargs)
    return cls(plan, group, **kwargs)


# ---------------------------------------------------------------------------- the names before the registry
METHODS = METHOD_NAMES  # the methods' names, as callers imported them before the registry


def check_method(method: str) -> str:
    """``method`` if it is a registered method, else an OptionsError naming the methods."""
    if method not in METHOD_NAMES:
        raise OptionsError(f"unknown refit method {method!r}; choose from {', '.join(METHOD_NAMES)}")
    return method


def method_plan(method: str, source: Layout, destination: Layout, *, max_bucket_bytes: int | None = None,
                domains: Mapping[int, int] | None = None, rule: HybridRule | None = None) -> PhasedPlan:
    """The plan ``method`` runs, from keyword options (:func:`make_plan` of a :class:`RefitOptions`);
    ``max_bucket_bytes`` caps each rank's staging in all."""
    options = RefitOptions(method=check_method(method), max_bucket_bytes=max_bucket_bytes, domains=domains,
                           hybrid_rule=rule)
    return make_plan(options, source, destination)


def method_executor(method: str, plan: PhasedPlan, group=None, *, timeout: timedelta = DEFAULT_TIMEOUT,
                    checksum: bool = False, allow_lossy: bool = False) -> Executor:
    """The executor of ``method`` for ``plan`` (:func:`make_executor` of a :class:`RefitOptions`)."""
    options = RefitOptions(method=check_method(method), timeout=timeout, checksum=checksum, allow_lossy=allow_lossy)
    return make_executor(options, plan, group)


__all__ = ["EXECUTORS", "GATHER_BROADCAST", "HIERARCHICAL", "HYBRID", "METHODS", "RESHARD", "check_method",
           "make_executor", "make_plan", "method_executor", "method_plan", "round_cap"]
