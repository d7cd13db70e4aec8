"""The baseline ``gloo_broadcast``: what vLLM's ``nccl`` backend does, with gloo standing in for NCCL.

vLLM's ``nccl`` backend needs an accelerator; this runs the same steps on any machine, so that
benchmarks and RL loops can put ``reshard`` beside the path RL stacks take today:

    trainer                                           each vLLM worker (the reshard engine, method
                                                      "broadcast")
    every rank gathers each full tensor (FSDP2's      start_weight_update: initialize_layerwise_reload
    full_tensor(), a collective), in checkpoint
    names (fused experts split), cast to wire_dtype
    rank 0 packs them into buckets of bucket_bytes    update_weights: receive every bucket (broadcast
    (vLLM's default 1 GiB) and broadcasts each to     from trainer rank 0), unpack, model.load_weights
    every worker (group: trainer rank 0 + workers)    finish_weight_update: finalize_layerwise_reload

Every worker receives every byte of the model and loads it through ``load_weights``; nothing is
written in place. Engines are configured as for ``reshard`` (``backend="reshard"``, or
``"gloo_broadcast"``: the same worker engine); the trainer picks this path with
:class:`BroadcastTrainerInitInfo`. On CPUs it carries the same FusedMoE workaround as ``reshard``
(:func:`~reshard.integrations.vllm.model.redo_cpu_moe_packing`), so that MoE engines load correctly.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Iterator, Self

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from ...execution.group import Group
from ...models.arch import named_tensors, parameter_segments
from ...planning.baseline import buckets
from .clients import EngineGroup, as_client
from .plugin import register
from .threads import with_pending_call

register()  # as for reshard's init info: using this one registers the backend in a trainer process

BACKEND = "gloo_broadcast"
BROADCAST = "broadcast"  # the worker engine's method name for this path
DEFAULT_BUCKET_BYTES = 1 << 30  # vLLM's packed broadcast buffer


def receive_broadcast(model: torch.nn.Module, group: Group, update, bucket_bytes: int) -> dict[str, int]:
    """Worker side of one update: every bucket from trainer rank 0, unpacked into ``model.load_weights``
    (inside a layerwise reload, where the model's parameters are on the meta device)."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    dtypes = [getattr(torch, name) for name in update.dtype_names]
    sizes = [int(torch.Size(shape).numel()) * dtype.itemsize for shape, dtype in zip(update.shapes, dtypes)]
    with disable_mtp_completeness_check():
        for bucket in buckets(sizes, bucket_bytes):
            flat = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8, device=group.device)
            group.broadcast(flat, 0)
            weights, offset = [], 0
            for i in bucket:
                data = flat[offset: offset + sizes[i]].view(dtypes[i]).view(update.shapes[i])
                weights.append((update.names[i], data))
                offset += sizes[i]
            model.load_weights(weights)
    return {"recv_bytes": sum(sizes)}


@dataclass(kw_only=True)
class BroadcastTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of ``gloo_broadcast``; ``rank`` is this trainer rank (rank 0 broadcasts)."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    engine_world_sizes: list[int]  # workers of each engine, in the client's order
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 300.0
    comm_backend: str | None = None
    wire_dtype: str | None = None  # cast before sending ("bfloat16": the engine's dtype); default the trainer's

    def worker_init_info(self) -> dict[str, Any]:
        sizes = list(self.engine_world_sizes)
        return {"store_addr": f"{self.master_address}:{self.master_port}", "world_size": 1 + sum(sizes),
                "rank_offsets": [1 + sum(sizes[:i]) for i in range(len(sizes))], "bucket_bytes": self.bucket_bytes,
                "options": {"timeout_s": self.timeout_s}, "comm_backend": self.comm_backend}


def full_checkpoint_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, full tensor)`` of every parameter and persistent buffer, gathering DTensors
    (a collective: every rank of the module's group iterates, in the same order) and splitting
    transformers 5's fused experts back into checkpoint tensors. A DeepSpeed ZeRO-3 model (or engine) is
    gathered one parameter at a time (``GatheredParameters``, TRL's way)."""
    from ..deepspeed import gathered_tensors, is_zero3_model

    if is_zero3_model(module):
        yield from gathered_tensors(module)
        return
    for name, tensor in named_tensors(module):
        full = (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()
        for spec, segment in parameter_segments(name, tuple(full.shape), full.dtype):
            box = full[segment.lead] if segment.lead else full
            yield spec.name, box[tuple(slice(start, start + size) for start, size in zip(segment.offsets, spec.shape))]


class BroadcastTrainerWeightTransferEngine(TrainerWeightTransferEngine[BroadcastTrainerInitInfo]):
    """Trainer side of ``gloo_broadcast`` (see module doc). ``source``: the trainer's module."""

    init_info_cls = BroadcastTrainerInitInfo

    def __init__(self, *, client, source: torch.nn.Module, init_info: BroadcastTrainerInitInfo) -> None:
        super().__init__(client=client, source=None, is_sender=init_info.is_sender)
        self.module, self.init_info = source, init_info
        self.group: Group | None = None
        self.dtype = getattr(torch, init_info.wire_dtype) if init_info.wire_dtype else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gloo-broadcast")

    @classmethod
    def trainer_init(cls, init_info: BroadcastTrainerInitInfo, *, client, source=None) -> Self:
        if not isinstance(source, torch.nn.Module):
            raise TypeError("gloo_broadcast gathers full tensors from the trainer's module: pass source=module")
        engine = cls(client=as_client(client), source=source, init_info=init_info)
        if engine.is_sender:
            info = init_info.worker_init_info()
            if not isinstance(engine.client, EngineGroup):
                info["engine_index"] = 0
            pending = engine._pool.submit(engine.client.init_weight_transfer_engine, info)
            with with_pending_call(pending):
                engine.group = Group.connect(info["store_addr"], 0, info["world_size"],
                                             backend=init_info.comm_backend,
                                             timeout=timedelta(seconds=init_info.timeout_s), prefix=BROADCAST)
        return engine

    def send_weights(self, weight_version: str | None = None, *, pause_mode: str | None = "keep") -> dict[str, int]:
        """Gather every full tensor (every trainer rank), broadcast them from rank 0; returns the bytes
        each worker received. Rank 0 pauses the engines (``pause_mode``, when the client can pause)
        once the gather is done, and resumes them after the version is recorded and the prefix cache
        dropped: vLLM serves between the calls of an update window, and a step run while the layerwise
        reload holds a layer on the meta device fails."""
        tensors = [(name, tensor if self.dtype is None else tensor.to(self.dtype))
                   for name, tensor in full_checkpoint_tensors(self.module)]
        if not self.is_sender:
            return {"recv_bytes": 0}
        sizes = [tensor.numel() * tensor.element_size() for _, tensor in tensors]
        update = {"names": [name for name, _ in tensors], "shapes": [list(tensor.shape) for _, tensor in tensors],
                  "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in tensors]}
        pause = bool(pause_mode) and hasattr(self.client, "pause_generation")
        if pause:
            self.client.pause_generation(pause_mode)
        self.client.start_weight_update()
        pending = self._pool.submit(self.client.update_weights, update)
        with with_pending_call(pending):
            for bucket in buckets(sizes, self.init_info.bucket_bytes):
                flat = torch.cat([tensors[i][1].contiguous().reshape(-1).view(torch.uint8) for i in bucket])
                self.group.broadcast(flat, 0)
        self.client.finish_weight_update(weight_version=weight_version)
        if hasattr(self.client, "reset_prefix_cache"):
            self.client.reset_prefix_cache()
        if pause:
            self.client.resume_generation(clear_cache=False)
        return {"recv_bytes": sum(sizes)}

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._pool.shutdown()


__all__ = ["BACKEND", "BROADCAST", "BroadcastTrainerInitInfo", "BroadcastTrainerWeightTransferEngine",
           "full_checkpoint_tensors", "receive_broadcast"]
