"""Trainer side of the ``reshard`` backend: every trainer rank sends its own shards, at once.

Built on every trainer rank by vLLM's factory, like the ``nccl`` and ``nccl_m2n`` backends::

    info = ReshardTrainerInitInfo(rank=rank, master_address=host, master_port=port,
                                  num_trainer_ranks=M, world_size=M + N)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ReshardSource(model))
    stats = engine.send_weights(weight_version="7")

``client`` is anything that speaks vLLM's weight-sync protocol (an ``LLM``, vLLM's HTTP or Ray
clients), or an :class:`EngineGroup` of several. Trainer rank 0 hosts the refit group's TCP store
at ``master_address:master_port`` and drives the control plane: it starts the workers' init (they
join inside it) and their update (they receive inside it) on a helper thread while every trainer
rank sends; it calls ``finish_weight_update(weight_version=...)`` only after every rank of the
session committed, so vLLM's version advances only when every worker holds every byte.

Switching from ``nccl_m2n``: change the init info to :class:`ReshardTrainerInitInfo` and the source
to :class:`ReshardSource` (the module itself, not a list of tensors).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Iterator, Mapping, Self

import torch
from vllm.distributed.weight_transfer.base import (ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine,
                                                   VLLMWeightSyncClient, WeightSource)

from ...refit.session import AUTO, DEFAULT_BUCKET_BYTES, RefitSession, RefitStats
from ...refit.sides import Side
from .plugin import BACKEND, register

register()  # trainer processes run no vLLM engine, so no plugin loading: using the init info registers it


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
    method: str = AUTO  # "auto" (hierarchical over NVLink domains when they exist), "reshard", "hierarchical"
    max_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES  # transfer staging cap per rank (two rounds in flight share it)
    timeout_s: float = 300.0  # bounds every wait of the session
    comm_backend: str | None = None  # "gloo" or "nccl"; default: nccl when CUDA is available

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.num_trainer_ranks < self.world_size:
            raise ValueError(f"trainer rank {self.rank} of {self.num_trainer_ranks} must leave room for inference "
                             f"ranks in world_size {self.world_size}")
        sizes = self.engine_sizes
        if sum(sizes) != self.world_size - self.num_trainer_ranks or min(sizes) < 1:
            raise ValueError(f"engine_world_sizes {sizes} must add up to the {self.world_size - self.num_trainer_ranks} "
                             f"inference ranks")

    @property
    def engine_sizes(self) -> list[int]:
        return list(self.engine_world_sizes or [self.world_size - self.num_trainer_ranks])

    @property
    def rank_offsets(self) -> list[int]:
        sizes = self.engine_sizes
        return [self.num_trainer_ranks + sum(sizes[:i]) for i in range(len(sizes))]

    def worker_init_info(self) -> dict[str, Any]:
        """The workers' init info (plain JSON), without ``engine_index``."""
        return {"store_addr": f"{self.master_address}:{self.master_port}", "world_size": self.world_size,
                "rank_offsets": self.rank_offsets, "method": self.method,
                "max_bucket_bytes": self.max_bucket_bytes, "timeout_s": self.timeout_s,
                "comm_backend": self.comm_backend}


class ReshardSource(WeightSource):
    """A trainer's weights as ``reshard`` sends them: this rank's local shards and where they sit.

    ``ReshardSource(model)`` reads a module (DTensor parameters of FSDP2, FSDP2 over TP or a
    Hugging Face ``tp_plan`` model by their placements; plain tensors as replicas; transformers 5's
    fused experts by checkpoint names); ``ReshardSource(side)`` takes an explicit
    :class:`~reshard.refit.sides.Side` (a Megatron-Core layout, say). ``rank_of`` maps the ranks of
    the module's device meshes to refit ranks (default: the same numbers).
    """

    def __init__(self, module_or_side: torch.nn.Module | Side, *, rank_of: Mapping[int, int] | None = None) -> None:
        self._what = module_or_side
        self._rank_of = rank_of
        self._side: Side | None = module_or_side if isinstance(module_or_side, Side) else None

    def side(self, rank: int) -> Side:
        """This rank's source side (read from the module once; its tensors are the live shards)."""
        if self._side is None or self._side.rank != rank:
            if isinstance(self._what, Side):
                raise ValueError(f"the source side was built for rank {self._what.rank}, not {rank}")
            self._side = Side.from_module(self._what, rank, rank_of=self._rank_of)
        return self._side

    def metadata(self) -> list[ParamMeta]:
        side = self._side if self._side is not None else self.side(0 if not isinstance(self._what, Side)
                                                                    else self._what.rank)
        return [ParamMeta(s.name, s.dtype, s.shape) for s in side.layout.specs.values()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers (local shards), not full tensors: reshard never gathers."""
        if self._side is None:
            raise RuntimeError("the source has no rank yet: trainer_init reads it")
        yield from self._side.read().items()


class OfflineClient:
    """An offline ``vllm.LLM`` as a weight-sync client. vLLM 0.32's ``LLM`` methods take request
    dicts (``{"init_info": ...}``, ``{"update_info": ...}``) rather than the protocol's plain payloads;
    this wraps them (the trainer engine does it for any ``LLM`` it is given)."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def as_client(client):
    """``client``, with an offline ``vllm.LLM`` wrapped in :class:`OfflineClient`."""
    from vllm import LLM

    return OfflineClient(client) if isinstance(client, LLM) else client


class EngineGroup:
    """Several vLLM engines driven as one weight-sync client: every call goes to all of them at once
    (a refit needs every engine inside ``update_weights`` while the trainer sends); engine ``i`` gets
    ``engine_index=i`` in its init info."""

    def __init__(self, clients: list[VLLMWeightSyncClient]) -> None:
        self.clients = [as_client(c) for c in clients]

    def _all(self, call) -> None:
        with ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="reshard-engines") as pool:
            for f in [pool.submit(call, i, c) for i, c in enumerate(self.clients)]:
                f.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all(lambda i, c: c.init_weight_transfer_engine({**init_info, "engine_index": i}))

    def start_weight_update(self) -> None:
        self._all(lambda i, c: c.start_weight_update())

    def update_weights(self, update_info) -> None:
        self._all(lambda i, c: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(lambda i, c: c.finish_weight_update(weight_version))


@contextmanager
def with_pending_call(pending: Future | None):
    """Run the body, then wait for the control-plane call ``pending`` (the workers' side of the same
    collective); raise the body's error if it failed (the session's, which names the rank and
    tensor), else the call's."""
    try:
        yield
    except BaseException:
        if pending is not None:
            pending.exception()  # wait for it; the workers fail the same way
        raise
    if pending is not None:
        pending.result()


class ReshardTrainerWeightTransferEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """The ``reshard`` backend's trainer engine (see module doc)."""

    init_info_cls = ReshardTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: ReshardSource, init_info: ReshardTrainerInitInfo
                 ) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        self.session: RefitSession | None = None
        self.steps = 0
        self.last_stats: RefitStats | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-weight-sync")

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | torch.nn.Module | None = None) -> Self:
        """Connect this trainer rank to the engines (collective over every trainer rank and worker)."""
        if isinstance(source, torch.nn.Module):
            source = ReshardSource(source)
        if not isinstance(source, ReshardSource):
            raise TypeError(f"the reshard backend sends local shards with their layout: pass source=ReshardSource(model)"
                            f" (or the module itself), not {type(source).__name__}")
        engine = cls(client=as_client(client), source=source, init_info=init_info)
        side = source.side(init_info.rank)
        pending: Future | None = None
        if engine.is_sender:
            worker_info = init_info.worker_init_info()
            if not isinstance(engine.client, EngineGroup):
                if len(init_info.engine_sizes) > 1:
                    raise ValueError(f"{len(init_info.engine_sizes)} engines need an EngineGroup of their clients")
                worker_info["engine_index"] = 0
            pending = engine._pool.submit(engine.client.init_weight_transfer_engine, worker_info)
        with with_pending_call(pending):
            engine.session = RefitSession.connect(
                source=side, store_addr=f"{init_info.master_address}:{init_info.master_port}", rank=init_info.rank,
                world_size=init_info.world_size, backend=init_info.comm_backend,
                timeout=timedelta(seconds=init_info.timeout_s), method=init_info.method,
                max_bucket_bytes=init_info.max_bucket_bytes)
        return engine

    def send_weights(self, weight_version: str | None = None) -> RefitStats:
        """One refit (on every trainer rank): start, send while the workers receive, commit, finish."""
        if self.session is None:
            raise RuntimeError("the reshard trainer engine is not connected")
        self.steps += 1
        version = str(self.steps) if weight_version is None else str(weight_version)
        pending: Future | None = None
        if self.is_sender:
            self.client.start_weight_update()
            pending = self._pool.submit(self.client.update_weights, {"version": version})
        with with_pending_call(pending):
            self.last_stats = self.session.refit(version)
        if self.is_sender:
            self.client.finish_weight_update(weight_version=version)
        return self.last_stats

    def shutdown(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
        self._pool.shutdown()


__all__ = ["EngineGroup", "OfflineClient", "ReshardSource", "ReshardTrainerInitInfo",
           "ReshardTrainerWeightTransferEngine", "as_client"]
