"""What a trainer rank needs to connect to its engines: :class:`ReshardTrainerInitInfo`.

The refit group is the trainer ranks ``0..num_trainer_ranks-1`` followed by each engine's
workers, engine by engine; trainer rank 0 hosts its TCP store and hands the workers their part of
the same information (:meth:`ReshardTrainerInitInfo.worker_init_info`, plain JSON). Every option
is checked here, when the info is made, before anything connects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo

from ...execution.methods import HYBRID, check_method
from ...planning.hybrid import as_rule
from ...refit.session import AUTO, DEFAULT_BUCKET_BYTES
from .plugin import BACKEND, register

register()  # trainer processes run no vLLM engine, so no plugin loading: using the init info registers it

PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's pause modes, as the trainer uses them around a refit


def check_pause_mode(mode: str | None) -> None:
    """A ``ValueError`` unless ``mode`` is one of :data:`PAUSE_MODES` or None."""
    if mode is not None and mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode {mode!r}: use one of {', '.join(PAUSE_MODES)}, or None")


@dataclass(kw_only=True)
class ReshardTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``reshard`` backend (``rank``: this trainer rank, also its refit rank).

    The refit group is the trainer ranks ``0..num_trainer_ranks-1`` followed by each engine's
    workers, engine by engine (``engine_world_sizes``, in the client's order; default: one engine
    with every other rank).
    """

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int  # trainer ranks + every engine's workers
    num_trainer_ranks: int = 1
    engine_world_sizes: list[int] | None = None
    # "auto" (hierarchical over NVLink domains when they exist), "reshard", "hierarchical", "hybrid"
    # (hybrid_patterns by reshard, the other tensors by gather-and-broadcast), "gather-broadcast"
    method: str = AUTO
    max_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES  # transfer staging cap per rank (two rounds in flight share it)
    timeout_s: float = 300.0  # bounds every wait of the session
    comm_backend: str | None = None  # "gloo" or "nccl"; default: nccl when CUDA is available
    pause_mode: str | None = "keep"  # vLLM's pause mode around each refit ("abort", "wait", "keep"), or None
    checksum: bool = False  # an xxh3-64 digest per message, checked on arrival (catches corruption on the wire)
    # rank 0's extra wait for an engine's weight-sync call once its own side of the same step ended:
    # a worker that stalls keeps vLLM's RPC busy, so gating its engine waits up to timeout_s + this
    engine_grace_s: float = 30.0
    # method "hybrid": regular expressions (re.search) of the tensors it moves by reshard; None: FFN and
    # expert weights (reshard.planning.hybrid.FFN_PATTERNS); [] sends every tensor by gather-and-broadcast
    hybrid_patterns: list[str] | None = None

    def __post_init__(self) -> None:
        self._check_seconds()
        if self.method != AUTO:
            check_method(self.method)  # ValueError naming the methods
        if self.hybrid_patterns is not None:
            if self.method != HYBRID:
                raise ValueError(f"hybrid_patterns is the rule of method 'hybrid', not of method {self.method!r}")
            as_rule(self.hybrid_patterns)  # ValueError naming a pattern that is no regular expression
        self._check_ranks()
        check_pause_mode(self.pause_mode)

    def _check_seconds(self) -> None:
        for name in ("timeout_s", "engine_grace_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)
                    and (value > 0 if name == "timeout_s" else value >= 0)):
                raise ValueError(f"{name} must be a finite number of seconds (timeout_s > 0, engine_grace_s >= 0), "
                                 f"got {value!r}")

    def _check_ranks(self) -> None:
        if not 0 <= self.rank < self.num_trainer_ranks < self.world_size:
            raise ValueError(f"trainer rank {self.rank} of {self.num_trainer_ranks} must leave room for inference "
                             f"ranks in world_size {self.world_size}")
        sizes, inference_ranks = self.engine_sizes, self.world_size - self.num_trainer_ranks
        if sum(sizes) != inference_ranks or min(sizes) < 1:
            raise ValueError(f"engine_world_sizes {sizes} must add up to the {inference_ranks} inference ranks")

    @property
    def engine_sizes(self) -> list[int]:
        return list(self.engine_world_sizes or [self.world_size - self.num_trainer_ranks])

    @property
    def rank_offsets(self) -> list[int]:
        sizes = self.engine_sizes
        return [self.num_trainer_ranks + sum(sizes[:index]) for index in range(len(sizes))]

    def engine_ranks(self, index: int) -> list[int]:
        """The refit ranks of engine ``index``'s workers."""
        first = self.rank_offsets[index]
        return list(range(first, first + self.engine_sizes[index]))

    def worker_init_info(self) -> dict[str, Any]:
        """The workers' init info (plain JSON), without ``engine_index``."""
        return {"store_addr": f"{self.master_address}:{self.master_port}", "world_size": self.world_size,
                "rank_offsets": self.rank_offsets, "method": self.method,
                "max_bucket_bytes": self.max_bucket_bytes, "timeout_s": self.timeout_s,
                "comm_backend": self.comm_backend, "checksum": self.checksum, "hybrid_patterns": self.hybrid_patterns}


__all__ = ["PAUSE_MODES", "ReshardTrainerInitInfo", "check_pause_mode"]
