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
from .execution.local import run_local
from .execution.process_group import init_process_group, spawn
from .layout import Layout
from .placements import Replicate, Shard, StridedShard, split_sizes
from .planning.baseline import gather_broadcast_bytes
from .planning.hierarchy import HierarchicalPlan, hierarchical_plan
from .planning.plan import PhasedPlan, Plan, RankPlan, plan
from .planning.schedule import Copy, Message
from .tensors import LayoutError, Piece, TensorSpec

__all__ = [
    "Copy", "GatherBroadcastExecutor", "HierarchicalPlan", "Layout", "LayoutError", "Message", "PhaseStats",
    "PhasedPlan", "Piece", "Plan", "RankPlan", "Replicate", "ReshardExecutor", "RunStats", "Shard", "StridedShard",
    "TensorSpec", "execute", "gather_broadcast_bytes", "hierarchical_plan", "init_process_group", "plan",
    "run_local", "spawn", "split_sizes",
]
