"""reshard: move weights from M training ranks to N inference ranks, each side sharded its own way.

The package is layered (see the README's architecture section): ``tensors``, ``placements`` and
``layout`` describe who holds what; ``models`` and ``frameworks`` build layouts of real models;
``planning`` computes the copies; ``modeling`` predicts their time on a machine; ``execution``
moves the bytes; ``apps`` are the command line, the demo and reports. The names below are the
public API.
"""

from .execution.base import PhaseStats, RunStats
from .execution.executor import ReshardExecutor, execute
from .execution.gather_broadcast import GatherBroadcastExecutor
from .execution.hybrid import HybridExecutor
from .execution.local import run_local
from .execution.precision import PrecisionExecutor, run_local_precision
from .execution.process_group import init_process_group, spawn
from .layout import Layout
from .placements import Replicate, Shard, StridedShard, split_sizes
from .planning.baseline import gather_broadcast_bytes
from .planning.hierarchy import HierarchicalPlan, hierarchical_plan
from .planning.hybrid import HybridPlan, HybridRule
from .planning.plan import PhasedPlan, Plan, RankPlan, plan
from .planning.precision import Cast, DtypePolicy, FP8Block, Keep, PrecisionPlan, precision_layout, precision_plan
from .planning.schedule import Copy, Message
from .quant import quantize_blocks
from .tensors import LayoutError, Piece, TensorSpec

__all__ = [
    "Cast", "Copy", "DtypePolicy", "FP8Block", "GatherBroadcastExecutor", "HierarchicalPlan",
    "HybridExecutor", "HybridPlan", "HybridRule", "Keep", "Layout", "LayoutError", "Message", "PhaseStats",
    "PhasedPlan", "Piece", "Plan", "PrecisionExecutor", "PrecisionPlan", "RankPlan", "Replicate",
    "ReshardExecutor", "RunStats", "Shard", "StridedShard", "TensorSpec", "execute", "gather_broadcast_bytes",
    "hierarchical_plan", "init_process_group", "plan", "precision_layout", "precision_plan",
    "quantize_blocks", "run_local", "run_local_precision", "spawn", "split_sizes",
]
