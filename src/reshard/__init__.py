"""reshard: move weights from M training ranks to N inference ranks, each side sharded its own way."""

from .executor import ReshardExecutor, RunStats, execute
from .gather_broadcast import GatherBroadcastExecutor, gather_broadcast_bytes
from .layout import Layout, LayoutError, Piece, TensorSpec
from .local import run_local
from .placements import Replicate, Shard, StridedShard, split_sizes
from .plan import Plan, RankPlan, plan
from .process_group import init_process_group, spawn
from .schedule import Copy, Message

__all__ = [
    "GatherBroadcastExecutor", "ReshardExecutor", "RunStats", "execute", "gather_broadcast_bytes",
    "init_process_group", "spawn", "Copy", "Layout", "LayoutError", "Message", "Piece", "Plan", "RankPlan", "Replicate", "Shard", "StridedShard",
    "TensorSpec", "plan", "run_local", "split_sizes",
]
