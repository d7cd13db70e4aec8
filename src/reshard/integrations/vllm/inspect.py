"""Looking inside a vLLM engine: what its workers compute with, and what the last refit did.

The functions taking ``worker`` run inside each worker through ``llm.collective_rpc(fn)`` (with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), which returns one result per worker::

    digests = llm.collective_rpc(engine_digest)     # one hex digest per worker
    stats = llm.collective_rpc(refit_stats)          # the last refit's figures per worker
    states = llm.collective_rpc(transfer_state)      # ready / updating / poisoned, per worker

:func:`engine_tensors` includes the weights vLLM's CPU backend packed into its linear layers'
closures (``named_parameters`` shows those layers' weights as empty), so two engines that compute
alike have equal tensors and digests.
"""

from __future__ import annotations

import hashlib

import torch


def engine_tensors(worker) -> dict[str, torch.Tensor]:
    """Every tensor the worker's model computes with: parameters, buffers, packed weights."""
    model = worker.model_runner.get_model()
    tensors = {name: param.detach().clone() for name, param in model.named_parameters()}
    tensors.update((f"buffer:{name}", buffer.detach().clone()) for name, buffer in model.named_buffers())
    for module_name, module in model.named_modules():
        linear = getattr(module, "cpu_linear", None)
        for index, cell in enumerate(getattr(linear, "__closure__", None) or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if isinstance(value, torch.Tensor):
                tensors[f"packed:{module_name}:{index}"] = value.detach().clone()
    return tensors


def engine_digest(worker) -> str:
    """A digest of :func:`engine_tensors` (names, shapes, dtypes and every byte)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(engine_tensors(worker).items()):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def refit_stats(worker) -> dict | None:
    """The worker's last refit: bytes in place and reprocessed, bytes received, the plan's identity,
    resident memory."""
    engine = worker.weight_transfer_engine
    stats = getattr(engine, "last_stats", None)
    session = getattr(engine, "session", None)
    if stats is None or not hasattr(stats, "in_place_bytes"):
        return None
    return {"in_place": stats.in_place_bytes, "reprocessed": stats.reprocessed_bytes, "recv": stats.recv_bytes,
            "seconds": stats.seconds, "fingerprint": session.plan.fingerprint() if session else None,
            "plan_id": id(session.plan) if session else None, "rss_mb": memory()["rss_mb"]}


def transfer_state(worker) -> dict | None:
    """The worker's refit state (``None`` without the ``reshard`` backend): its refit rank, ``state``
    (a :class:`~reshard.refit.states.DestinationState` by its plain name: ``"ready"``, ``"updating"``
    or ``"poisoned"``), ``version`` (the last one a refit committed there),
    and while poisoned ``failed_version`` and ``error``; ``connected`` (a trainer session is open)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    describe = getattr(engine, "transfer_state", None)
    return describe() if callable(describe) else None


class ReshardWorkerExtension:
    """A vLLM worker extension (``LLM(..., worker_extension_cls="reshard.integrations.vllm.inspect.
    ReshardWorkerExtension")``) that names :func:`transfer_state` as a worker method:
    ``collective_rpc("reshard_transfer_state")`` then needs no pickled function, so an HTTP server's
    ``/collective_rpc`` route (``VLLM_SERVER_DEV_MODE=1``) answers it too."""

    def reshard_transfer_state(self) -> dict | None:
        return transfer_state(self)


def memory(reset_peak: bool = False) -> dict[str, float]:
    """This process's resident memory and its peak since the last reset (Linux), in MiB; with
    ``reset_peak`` the peak starts again from now."""
    if reset_peak:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return {"rss_mb": fields["VmRSS"], "peak_mb": fields["VmHWM"]}


def worker_memory(worker, reset_peak: bool = False) -> dict[str, float]:
    """:func:`memory` of a worker (for ``collective_rpc``)."""
    return memory(reset_peak)


def close_engine(llm) -> None:
    """Stop an offline engine's EngineCore and workers. vLLM 0.32's ``LLM`` has no ``shutdown``; a
    process that made one (not the main process) otherwise cannot exit: it waits for them."""
    llm.llm_engine.engine_core.shutdown()


__all__ = ["ReshardWorkerExtension", "close_engine", "engine_digest", "engine_tensors", "memory", "refit_stats",
           "transfer_state", "worker_memory"]
