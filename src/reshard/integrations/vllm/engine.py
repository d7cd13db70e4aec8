"""Worker side of the ``reshard`` backend: each vLLM worker is one destination rank of a refit session.

vLLM drives it through its weight-sync calls (``LLM`` methods, the HTTP server's routes, Ray)::

    init_weight_transfer_engine(init_info)   join the refit group, lay out this worker's parameters,
                                             exchange layouts, plan once, check the digest
    start_weight_update()                    -
    update_weights({"version": ...})         receive this worker's boxes (the trainer sends at once)
    finish_weight_update(weight_version=v)   vLLM records v once every worker returned from update

A failed init leaves the model as it was; a failed update fails on every rank of the session.

vLLM 0.32's multiprocess executor stops reading the workers' replies at the first failed one, so an
error raised by several workers of one engine leaves replies queued and the engine's next RPC
hangs. Session errors are the same on every rank (sessions fail collectively), so each worker
catches them and only the engine's last worker raises: vLLM reads every reply, reports the error,
and keeps serving.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from ...refit.session import AUTO, DEFAULT_BUCKET_BYTES, RefitSession
from .model import VLLMModelSide


@dataclass(kw_only=True)
class ReshardWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs to join a refit (plain JSON: it rides vLLM's HTTP routes too)."""

    store_addr: str  # host:port of the refit group's TCP store, hosted by trainer rank 0
    world_size: int  # trainer ranks + every engine's workers
    rank_offsets: list[int]  # first refit rank of each engine's workers, engine by engine
    engine_index: int = 0
    method: str = AUTO
    max_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
    timeout_s: float = 300.0
    comm_backend: str | None = None  # "gloo" or "nccl"; default: nccl when CUDA is available

    def __post_init__(self) -> None:
        if not 0 <= self.engine_index < len(self.rank_offsets):
            raise ValueError(f"engine_index {self.engine_index} is not one of the {len(self.rank_offsets)} engines")


@dataclass
class ReshardWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    version: str | None = None


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardWeightTransferInitInfo,
                                                       ReshardWeightTransferUpdateInfo]):
    """The ``reshard`` backend's worker engine (see module doc)."""

    init_info_cls = ReshardWeightTransferInitInfo
    update_info_cls = ReshardWeightTransferUpdateInfo
    supports_draft_weight_update = False  # the plan is made for the model this engine was built for

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.session: RefitSession | None = None
        self.last_stats = None
        self.last_error: Exception | None = None

    def init_transfer_engine(self, init_info: ReshardWeightTransferInitInfo) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        self.shutdown()  # a new trainer connection replaces the old one
        first = init_info.rank_offsets[init_info.engine_index]
        rank = first + get_tensor_model_parallel_rank()
        side, failure = None, None
        try:
            side = VLLMModelSide.from_worker(self.model, self.vllm_config, rank, first)
        except Exception as e:  # noqa: BLE001 - every rank of the session hears it
            failure = f"{type(e).__name__}: {e}"
        with self._last_worker_raises():
            self.session = RefitSession.connect(
                destination=side, store_addr=init_info.store_addr, rank=rank, world_size=init_info.world_size,
                backend=init_info.comm_backend, timeout=timedelta(seconds=init_info.timeout_s),
                method=init_info.method, max_bucket_bytes=init_info.max_bucket_bytes, failure=failure)

    def start_weight_update(self) -> None:
        if self.session is None:
            raise RuntimeError("reshard weight transfer is not initialized: call init_weight_transfer_engine first")

    def receive_weights(self, update_info: ReshardWeightTransferUpdateInfo) -> None:
        self.start_weight_update()
        with self._last_worker_raises():
            self.last_stats = self.session.refit(update_info.version)

    @contextmanager
    def _last_worker_raises(self):
        """Run a collective step; on failure only the engine's last worker raises (see module doc)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        try:
            yield
        except Exception as e:  # noqa: BLE001
            self.last_error = e
            if get_tensor_model_parallel_rank() == get_tensor_model_parallel_world_size() - 1:
                raise

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


__all__ = ["ReshardWeightTransferEngine", "ReshardWeightTransferInitInfo", "ReshardWeightTransferUpdateInfo"]
