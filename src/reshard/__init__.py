"""reshard: move weights from M training ranks to N inference ranks, each side sharded its own way."""

from .layout import Layout, LayoutError, Piece, TensorSpec
from .local import run_local
from .placements import Replicate, Shard, StridedShard, split_sizes
from .plan import Plan, RankPlan, plan
from .schedule import Copy, Message

__all__ = [
    "Copy", "Layout", "LayoutError", "Message", "Piece", "Plan", "RankPlan", "Replicate", "Shard", "StridedShard",
    "TensorSpec", "plan", "run_local", "split_sizes",
]
