"""Worker side of the ``reshard`` backend: each vLLM worker is one destination rank of a refit.

vLLM drives it through its weight-sync calls (``LLM`` methods, the HTTP server's routes, Ray)::

    init_weight_transfer_engine(init_info)   join the refit group, lay out this worker's parameters,
                                             exchange layouts, plan once, check the digest
    start_weight_update()                    check there is a connection
    update_weights({"version": ...})         receive this worker's boxes (the trainer sends at once)
    finish_weight_update(weight_version=v)   vLLM records v once every worker returned from update

A failed init leaves the model as it was; a failed update fails on every rank of the session.

The trainer picks the method in the init info: ``"auto"``, ``"reshard"``, ``"hierarchical"`` (a
refit session), or ``"broadcast"``, the baseline of :mod:`reshard.integrations.vllm.broadcast`
(full tensors from trainer rank 0 into ``load_weights``), so one engine can be refitted every way a
comparison needs.

vLLM 0.32's multiprocess executor stops reading the workers' replies at the first failed one, so an
error raised by several workers of one engine leaves replies queued and the engine's next RPC
hangs. Errors here are the same on every worker (sessions fail collectively), so each worker
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

from ...execution.group import Group
from ...refit.session import AUTO, DEFAULT_BUCKET_BYTES, RefitSession
from .broadcast import BROADCAST, receive_broadcast
from .broadcast import DEFAULT_BUCKET_BYTES as BROADCAST_BUCKET_BYTES
from .model import VLLMModelSide, redo_cpu_moe_packing


@dataclass(kw_only=True)
class ReshardWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs to join a refit (plain JSON: it rides vLLM's HTTP routes too)."""

    store_addr: str  # host:port of the refit group's TCP store, hosted by trainer rank 0
    world_size: int  # the group: trainer ranks (trainer rank 0 alone for "broadcast") + every engine's workers
    rank_offsets: list[int]  # first rank of each engine's workers in that group, engine by engine
    engine_index: int = 0
    method: str = AUTO  # "auto", "reshard", "hierarchical", or "broadcast"
    max_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES  # a refit's transfer staging cap per rank
    bucket_bytes: int | None = None  # "broadcast": bytes per broadcast bucket
    timeout_s: float = 300.0
    comm_backend: str | None = None  # "gloo" or "nccl"; default: nccl when CUDA is available

    def __post_init__(self) -> None:
        if not 0 <= self.engine_index < len(self.rank_offsets):
            raise ValueError(f"engine_index {self.engine_index} is not one of the {len(self.rank_offsets)} engines")


@dataclass
class ReshardWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    version: str | None = None
    names: list[str] | None = None  # "broadcast": the tensors coming, in order
    dtype_names: list[str] | None = None
    shapes: list[list[int]] | None = None


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardWeightTransferInitInfo,
                                                       ReshardWeightTransferUpdateInfo]):
    """The ``reshard`` backend's worker engine (see module doc)."""

    init_info_cls = ReshardWeightTransferInitInfo
    update_info_cls = ReshardWeightTransferUpdateInfo
    supports_draft_weight_update = False  # the plan is made for the model this engine was built for

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.session: RefitSession | None = None
        self.broadcast: tuple[Group, int] | None = None  # ("broadcast") the group and bucket size
        self._reload_pending = False
        self.last_stats = None
        self.last_error: Exception | None = None

    def init_transfer_engine(self, init_info: ReshardWeightTransferInitInfo) -> None:
        """Connect to a trainer; a new connection replaces the one of the same kind (a refit session,
        or a broadcast group: an engine can hold one of each, to be refitted both ways)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        first = init_info.rank_offsets[init_info.engine_index]
        rank = first + get_tensor_model_parallel_rank()
        timeout = timedelta(seconds=init_info.timeout_s)
        if init_info.method == BROADCAST:
            self._close(broadcast=True)
            with self._last_worker_raises():
                group = Group.connect(init_info.store_addr, rank, init_info.world_size,
                                      backend=init_info.comm_backend, timeout=timeout, prefix=BROADCAST)
                self.broadcast = (group, init_info.bucket_bytes or BROADCAST_BUCKET_BYTES)
            return
        self._close(session=True)
        side, failure = None, None
        try:
            side = VLLMModelSide.from_worker(self.model, self.vllm_config, rank, first)
        except Exception as e:  # noqa: BLE001 - every rank of the session hears it
            failure = f"{type(e).__name__}: {e}"
        with self._last_worker_raises():
            self.session = RefitSession.connect(
                destination=side, store_addr=init_info.store_addr, rank=rank, world_size=init_info.world_size,
                backend=init_info.comm_backend, timeout=timeout, method=init_info.method,
                max_bucket_bytes=init_info.max_bucket_bytes, failure=failure)

    def start_weight_update(self) -> None:
        if self.session is None and self.broadcast is None:
            raise RuntimeError("reshard weight transfer is not initialized: call init_weight_transfer_engine first")

    def receive_weights(self, update_info: ReshardWeightTransferUpdateInfo) -> None:
        """A refit (``{"version": v}``), or a broadcast update (names, dtypes and shapes of the full
        tensors coming): full tensors through ``load_weights`` in vLLM's layerwise reload."""
        self.start_weight_update()
        if update_info.names is not None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            if self.broadcast is None:
                raise RuntimeError("a broadcast update arrived, but no broadcast trainer is connected")
            redo_cpu_moe_packing(self.model)
            initialize_layerwise_reload(self.model)
            self._reload_pending = True
            with self._last_worker_raises():
                group, bucket_bytes = self.broadcast
                self.last_stats = receive_broadcast(self.model, group, update_info, bucket_bytes)
            return
        if self.session is None:
            raise RuntimeError("a refit arrived, but no reshard trainer is connected")
        with self._last_worker_raises():
            self.last_stats = self.session.refit(update_info.version)

    def finish_weight_update(self) -> None:
        if self._reload_pending:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._reload_pending = False
            finalize_layerwise_reload(self.model, self.model_config)

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

    def shutdown(self) -> None:
        self._close(session=True, broadcast=True)

    def _close(self, *, session: bool = False, broadcast: bool = False) -> None:
        if session and self.session is not None:
            self.session.close()
            self.session = None
        if broadcast and self.broadcast is not None:
            self.broadcast[0].close()
            self.broadcast = None


__all__ = ["ReshardWeightTransferEngine", "ReshardWeightTransferInitInfo",
           "ReshardWeightTransferUpdateInfo"]
