"""What a trainer rank needs to connect to its engines: :class:`ReshardTrainerInitInfo`.

The refit group is the trainer ranks ``0..num_trainer_ranks-1`` followed by each engine's
workers, engine by engine; trainer rank 0 hosts its TCP store and hands the workers their part of
the same information (:meth:`ReshardTrainerInitInfo.worker_init_info`, plain JSON: the refit's
:class:`~reshard.options.RefitOptions` as :meth:`~reshard.options.RefitOptions.to_json` writes it).
Every option is checked when the info is made (the refit's by ``RefitOptions`` itself), before
anything connects.

    info = ReshardTrainerInitInfo(rank=0, master_address=host, master_port=port, num_trainer_ranks=2,
                                  world_size=4, options=RefitOptions(method="hybrid", checksum=True))

**FP8 engines.** The refit's dtype policy is ``options.precision`` (a name: it crosses to the workers
as JSON). An engine serving a block-FP8 checkpoint is refitted from a BF16 trainer with
``RefitOptions(precision="fp8")``, or with the policy its quantization config asks for,
``RefitOptions(precision=engine_precision(checkpoint))`` (:func:`engine_precision`). Each worker
checks the policy against its engine at connect: a tensor the policy puts in another precision
than the engine holds it (a BF16 refit into FP8 weights, FP8 into a layer the engine keeps in
BF16, another block size) fails the connect on every rank with an error naming the tensor, before
any byte moves.
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


def engine_precision(engine) -> str | None:
    """The dtype policy (its name, for ``RefitOptions(precision=...)``) that an engine's
    ``quantization_config`` asks for: ``"fp8"`` for block FP8 with 128x128 blocks (DeepSeek-V3's and
    Kimi-K2's checkpoints: ``quant_method`` fp8, e4m3, ``weight_block_size`` [128, 128]), ``"mxfp8"``
    for vLLM's MXFP8 (``quant_method`` mxfp8), None for an unquantized engine. ``engine``: the checkpoint
    folder (every trainer rank can read it), its ``config.json`` as a dict, an ``LLM``, or a vLLM or
    Hugging Face config. A quantization no named policy matches is a ``ValueError`` saying what it is.

    >>> engine_precision({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
    ...                                           "weight_block_size": [128, 128]}})
    'fp8'
    >>> engine_precision({"model_type": "qwen3"}) is None
    True
    """
    config = _quantization_config(engine)
    if config is None:
        return None
    method = str(config.get("quant_method", "")).lower()
    block = config.get("weight_block_size")
    if method == "fp8" and block is not None and list(block) == [128, 128] and config.get("fmt", "e4m3") == "e4m3" \
            and config.get("activation_scheme", "dynamic") == "dynamic":
        return "fp8"
    if method == "mxfp8":
        return "mxfp8"
    raise ValueError(f"the engine's quantization_config {config} matches no dtype policy of reshard (block FP8 "
                     f"128x128 e4m3 with dynamic activations: 'fp8'; 'mxfp8'): give RefitOptions(precision=a "
                     f"DtypePolicy) for a session without vLLM, or serve one of those")


def _quantization_config(engine) -> dict | None:
    import json
    import os

    if isinstance(engine, (str, os.PathLike)):
        with open(os.path.join(engine, "config.json")) as f:
            engine = json.load(f)
    llm_engine = getattr(engine, "llm_engine", None)  # an offline LLM
    if llm_engine is not None:
        engine = llm_engine.vllm_config
    engine = getattr(engine, "model_config", engine)  # a VllmConfig
    engine = getattr(engine, "hf_config", engine)  # a ModelConfig
    config = engine.get("quantization_config") if isinstance(engine, dict) else getattr(
        engine, "quantization_config", None)
    if config is not None and not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return config


def as_options(options: RefitOptions | Mapping) -> RefitOptions:
    """``options`` (a RefitOptions, or its JSON as :meth:`RefitOptions.to_json` wrote it) as a RefitOptions
    that can cross to the workers as JSON (an ``OptionsError`` for one that holds code)."""
    options = options if isinstance(options, RefitOptions) else RefitOptions.from_json(options)
    options.to_json()
    return options


__all__ = ["PAUSE_MODES", "ReshardTrainerInitInfo", "as_options", "check_pause_mode", "engine_precision"]
