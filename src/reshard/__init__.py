"""reshard: move weights from M training ranks to N inference ranks, each side sharded its own way.

What a user calls first (the names below; the rest stays in its module)::

    describe         TensorSpec, Layout, Shard, Replicate, StridedShard
    plan             plan / Plan, hierarchical_plan, HybridPlan + HybridRule, DtypePolicy
    run              run_local (one process), ReshardExecutor, GatherBroadcastExecutor (the baseline),
                     spawn / init_process_group
    refit            RefitSession + Side (connect once, refit every step), RefitOptions, RefitStats
    errors           ReshardError, the base of LayoutError (bad input, nothing moved),
                     OptionsError (a wrong option) and RefitError (a refit failed on some rank)

The package is layered (see the README's architecture section): ``tensors``, ``placements`` and
``layout`` describe who holds what; ``models`` and ``frameworks`` build layouts of real models;
``planning`` computes the copies; ``modeling`` predicts their time on a machine; ``execution``
moves the bytes; ``refit`` runs sessions; ``integrations`` plug into engines; ``apps`` are the
command line, the demo and reports.
"""

import importlib

from .errors import OptionsError, ReshardError
from .execution.base import RunStats
from .execution.control import RefitError
from .execution.executor import ReshardExecutor
from .execution.gather_broadcast import GatherBroadcastExecutor
from .execution.local import run_local
from .execution.process_group import init_process_group, spawn
from .layout import Layout
from .options import RefitOptions
from .placements import Replicate, Shard, StridedShard
from .planning.baseline import gather_broadcast_plan
from .planning.hierarchy import hierarchical_plan
from .planning.hybrid import HybridPlan, HybridRule
from .planning.plan import Plan, plan
from .planning.precision import DtypePolicy, PrecisionPlan
from .refit.session import RefitSession, RefitStats
from .refit.sides import Side
from .tensors import LayoutError, TensorSpec

__all__ = [
    "DtypePolicy", "GatherBroadcastExecutor", "HybridPlan", "HybridRule", "Layout", "LayoutError", "OptionsError",
    "Plan", "PrecisionPlan", "RefitError", "RefitOptions", "RefitSession", "RefitStats", "Replicate",
    "ReshardError", "ReshardExecutor", "RunStats", "Shard", "Side", "StridedShard", "TensorSpec",
    "gather_broadcast_plan", "hierarchical_plan", "init_process_group", "plan", "run_local", "spawn",
]

# Names the package exported before: still importable from here, defined in their modules.
_MOVED = {
    "Cast": "planning.precision", "Copy": "planning.schedule", "FP8Block": "planning.precision",
    "HierarchicalPlan": "planning.hierarchy", "HybridExecutor": "execution.hybrid", "Keep": "planning.precision",
    "Message": "planning.schedule", "PhaseStats": "execution.base", "PhasedPlan": "planning.plan",
    "Piece": "tensors", "PrecisionExecutor": "execution.precision", "RankPlan": "planning.plan",
    "execute": "execution.executor", "gather_broadcast_bytes": "planning.baseline",
    "precision_layout": "planning.precision", "precision_plan": "planning.precision", "quantize_blocks": "quant",
    "run_local_precision": "execution.precision", "split_sizes": "placements",
}


def __getattr__(name: str):
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'reshard' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
