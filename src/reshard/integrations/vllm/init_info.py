"""What a trainer rank needs to connect to its engines: :class:`ReshardTrainerInitInfo`.

The refit group is the trainer ranks ``0..num_trainer_ranks-1`` followed by each engine's
workers, engine by engine; trainer rank 0 hosts its TCP store and hands the workers their part of
the same information (:meth:`ReshardTrainerInitInfo.worker_init_info`, plain JSON: the refit's
:class:`~reshard.options.RefitOptions` as :meth:`~reshard.options.RefitOptions.to_json` writes it).
Every option is checked when the info is made (the refit's by ``RefitOptions`` itself), before
anything connects.

    info = ReshardTrainerInitInfo(rank=0, master_address=host, master_port=port, num_trainer_ranks=2,
                                  world_size=4, options=RefitOptions(method="hybrid", checksum=True))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from vllm.distributed.weight_transfer.base import TrainerInitInfo

from ...options import RefitOptions
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
    # the refit's options, the same on every rank: method, staging cap, timeout (bounds every wait of the
    # session), checksum, hybrid rule (regular expressions: they cross to the workers as JSON), ...
    options: RefitOptions = field(default_factory=RefitOptions)
    comm_backend: str | None = None  # "gloo" or "nccl"; default: nccl when CUDA is available
    pause_mode: str | None = "keep"  # vLLM's pause mode around each refit ("abort", "wait", "keep"), or None
    # rank 0's extra wait for an engine's weight-sync call once its own side of the same step ended:
    # a worker that stalls keeps vLLM's RPC busy, so gating its engine waits up to the timeout + this
    engine_grace_s: float = 30.0

    def __post_init__(self) -> None:
        self.options = as_options(self.options)
        value = self.engine_grace_s
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"engine_grace_s must be a finite number of seconds >= 0, got {value!r}")
        self._check_ranks()
        check_pause_mode(self.pause_mode)

    @property
    def timeout_s(self) -> float:
        """The refit's timeout, in seconds."""
        return self.options.timeout.total_seconds()

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
                "rank_offsets": self.rank_offsets, "comm_backend": self.comm_backend, "options": self.options.to_json()}


def as_options(options: RefitOptions | Mapping) -> RefitOptions:
    """``options`` (a RefitOptions, or its JSON as :meth:`RefitOptions.to_json` wrote it) as a RefitOptions
    that can cross to the workers as JSON (an ``OptionsError`` for one that holds code)."""
    options = options if isinstance(options, RefitOptions) else RefitOptions.from_json(options)
    options.to_json()
    return options


__all__ = ["PAUSE_MODES", "ReshardTrainerInitInfo", "as_options", "check_pause_mode"]
