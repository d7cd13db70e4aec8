"""reshard: move weights from M training ranks to N inference ranks, each side sharded its own way."""

from .execution.direct import ReshardExecutor, RunStats, execute
from .execution.gather_broadcast import GatherBroadcastExecutor, gather_broadcast_bytes
from .execution.local import run_local
from .execution.process_group import init_process_group, spawn
from .layout import Layout
from .placements import Replicate, Shard, StridedShard, split_sizes
from .planning.plan import Plan, RankPlan, plan
from .planning.schedule import Copy, Message
from .tensors import LayoutError, Piece, TensorSpec

__all__ = [
    "GatherBroadcastExecutor", "ReshardExecutor", "RunStats", "execute", "gather_broadcast_bytes",
    "init_process_group", "spawn", "Copy", "Layout", "LayoutError", "Message", "Piece", "Plan", "RankPlan", "Replicate", "Shard", "StridedShard",
    "TensorSpec", "plan", "run_local", "split_sizes",
]
