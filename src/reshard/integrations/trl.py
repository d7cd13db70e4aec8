"""TRL's ``GRPOTrainer`` with its vLLM refit done by reshard: :class:`ReshardGRPOTrainer`.

One change in a TRL script: ``GRPOTrainer`` becomes ``ReshardGRPOTrainer`` (same arguments, plus
``refit_options``)::

    from reshard.integrations.trl import ReshardGRPOTrainer

    trainer = ReshardGRPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=reward, train_dataset=data,
                                 args=GRPOConfig(use_vllm=True, vllm_mode="server", ...))
    trainer.train()

TRL builds its vLLM side (``trl.generation.vllm_generation.VLLMGeneration``) by its module-level
name inside ``GRPOTrainer.__init__``; the trainer swaps that name for :class:`ReshardVLLMGeneration`
for the duration of that one constructor call (a lock keeps two constructions in one process from
crossing), so nothing else in TRL changes and generation still goes through TRL's code::

    mode        generation               refit (every step TRL syncs, on every trainer rank)
    "server"    TRL's VLLMClient, HTTP   reshard's vLLM backend: the server runs with
                                         --weight-transfer-config '{"backend": "reshard"}'; every
                                         trainer rank sends its own shards (FSDP2 DTensors, ZeRO-3
                                         chunks, replicas), rank 0 drives the server's routes
    "colocate"  TRL's in-process LLM     one RefitSession over the trainer ranks, each rank both a
                                         source (its shards) and a destination (its engine's
                                         model): local copies where a rank holds its bytes, the
                                         rest from the other ranks; no load_weights (vLLM's CPU
                                         backend breaks TRL's own sync there)

Versions: the refit at ``global_step`` k is version ``str(k)``: the server records it at
``finish_weight_update`` (``/weight_info``), the colocated engine through ``update_weight_version``.
Before and after each rollout the generation object reads the engine's version (and, colocated, the
version vLLM labelled each output's tokens with) and raises if it is not the one it last refitted
(:attr:`ReshardVLLMGeneration.rollouts` keeps them), so the rollouts of step k+1 come from step
k's weights. Each refit resets the prefix cache.

Not covered, refused at construction with an error naming the option: PEFT/LoRA models
(``peft_config`` or a ``PeftModel``), ``vllm_enable_sleep_mode``, ``use_vllm=False``. TRL's async
GRPO (``trl.experimental.async_grpo``) and other trainers (RLOO, distillation, ...) keep their own
sync: this class is a ``GRPOTrainer``. docs/trl.md says more.

TRL is imported lazily: importing reshard never imports it.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..options import RefitOptions

BACKEND = "reshard"
_SWAP = threading.Lock()  # one GRPOTrainer construction at a time swaps TRL's VLLMGeneration name


@dataclass
class SyncRecord:
    """One refit as a trainer rank saw it."""

    step: int  # TRL's global_step the weights are from
    version: str
    seconds: float  # the sync_weights call (rank 0: pausing, the refit, version, prefix-cache reset, resume)
    sent_bytes: int
    recv_bytes: int
    refit_s: float = 0.0  # the refit itself, as its session timed it on this rank


@dataclass
class RolloutRecord:
    """One generation call: the step it ran at and the engine's weight version before and after it
    (``None`` on the ranks that do not talk to the server)."""

    step: int
    expected: str | None
    before: str | None
    after: str | None
    labels: list[str] | None = None  # colocate: the versions vLLM labelled the outputs' tokens with


class _ReshardGeneration:
    """TRL's ``VLLMGeneration`` with reshard's refit: the methods of :data:`ReshardVLLMGeneration`,
    the class made on first use from this one and TRL's ``VLLMGeneration`` (so that importing this
    module imports no TRL).

    ``sync_weights()`` (called by TRL on every rank when the step changed) connects on first use
    (collective; the trainer's model is sharded by then) and then refits; ``generate()`` is TRL's,
    checked against the engine's version."""

    def __init__(self, *args, refit_options: RefitOptions | None = None, master_address: str | None = None,
                 **kwargs) -> None:
        self.refit_options = refit_options if refit_options is not None else RefitOptions()
        self.master_address = master_address
        self.trainer = None  # the ReshardGRPOTrainer (its state's global_step names the versions)
        self.weight_version: str | None = None  # the last version refitted
        self.syncs: list[SyncRecord] = []
        self.rollouts: list[RolloutRecord] = []
        self._engine = None  # server mode: the reshard trainer engine
        self._session = None  # colocate mode: the refit session
        self._server_world = 0
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ set up
    def _init_vllm(self) -> None:
        if self.enable_sleep_mode:
            raise ValueError("ReshardGRPOTrainer: vllm_enable_sleep_mode=True is not supported (level-2 sleep "
                             "drops the engine's weights, which a refit writes in place); set it to False")
        if self.mode == "colocate":
            super()._init_vllm()  # TRL's in-process LLM, unchanged
            return
        if self.mode != "server":
            raise ValueError(f"vllm_mode must be 'server' or 'colocate', got {self.mode!r}")
        from trl.generation.vllm_client import VLLMClient

        if self.accelerator.is_main_process:
            url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            # TRL's client for generation; its NCCL communicator (CUDA only) is never opened
            self.vllm_client = VLLMClient(base_url=url, group_port=self.group_port,
                                          connection_timeout=self.server_timeout)
            config = self.vllm_client.get_server_info().get("weight_transfer_config") or {}
            if config.get("backend") != BACKEND:
                raise ValueError(f"the vLLM server at {url} runs weight-transfer backend {config.get('backend')!r}; "
                                 f"start it with --weight-transfer-config '{{\"backend\": \"{BACKEND}\"}}'")
            self._server_world = self.vllm_client.get_world_size()
        self.accelerator.wait_for_everyone()

    def _trainer_model(self) -> torch.nn.Module:
        """The trainer's module as it is now (sharded by accelerate once training started)."""
        model = self.trainer.model if self.trainer is not None else self.model
        return self.accelerator.unwrap_model(model)

    def _connect(self) -> None:
        if self.mode == "server":
            self._connect_server()
        else:
            self._connect_colocated()

    def _store(self, port: int | None = None) -> tuple[str, int, int]:
        """(address, port, server world size) as trainer rank 0 sees them, on every rank."""
        from accelerate.utils import broadcast_object_list

        from ..execution.process_group import free_port

        facts = [None]
        if self.accelerator.is_main_process:
            address = self.master_address
            if address is None:
                from vllm.utils.network_utils import get_ip

                address = get_ip()
            facts = [(address, port or self.group_port or free_port(), self._server_world)]
        broadcast_object_list(facts, from_process=0)
        return facts[0]

    def _connect_server(self) -> None:
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

        from .vllm import ReshardSource, ReshardTrainerInitInfo

        address, port, server_world = self._store()
        ranks = self.accelerator.num_processes
        info = ReshardTrainerInitInfo(rank=self.accelerator.process_index, master_address=address, master_port=port,
                                      num_trainer_ranks=ranks, world_size=ranks + server_world,
                                      options=self.refit_options)
        # rank 0 drives the server's routes; the other ranks only send their shards
        client = HTTPVLLMWeightSyncClient(self.vllm_client.base_url) if self.accelerator.is_main_process else None
        self._engine = WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                                 source=ReshardSource(self._trainer_model()))

    def _connect_colocated(self) -> None:
        from ..refit.session import RefitSession
        from .vllm import ReshardSource, VLLMModelSide

        rank, ranks = self.accelerator.process_index, self.accelerator.num_processes
        address, port, _ = self._store()
        worker = self.llm.llm_engine.model_executor.driver_worker
        tp = self.tensor_parallel_size
        destination, failure = None, None
        try:
            destination = VLLMModelSide.from_worker(worker.model_runner.get_model(), worker.vllm_config, rank,
                                                    rank - rank % tp)
        except Exception as error:  # noqa: BLE001 - every rank hears it at connect, named
            failure = f"{type(error).__name__}: {error}"
        source = ReshardSource(self._trainer_model()).side(rank)
        self._session = RefitSession.connect(source=source, destination=destination, store_addr=f"{address}:{port}",
                                             rank=rank, world_size=ranks, options=self.refit_options, failure=failure)

    # ------------------------------------------------------------------ every step
    def sync_weights(self) -> None:
        """Refit the engine(s) with the trainer's weights at this step (every trainer rank)."""
        step = self.trainer.state.global_step if self.trainer is not None else len(self.syncs)
        version = str(step)
        if self._engine is None and self._session is None:
            self._connect()
        t0 = time.perf_counter()
        if self.mode == "server":
            stats = self._engine.send_weights(weight_version=version)  # rank 0 resets the prefix cache too
        else:
            stats = self._session.refit(version)
            self.llm.update_weight_version(version)
            if self.llm.reset_prefix_cache() is False:
                raise RuntimeError(f"the colocated engine's prefix cache could not be reset after refit {version!r}")
        self.weight_version = version
        figures = stats if isinstance(stats, dict) else vars(stats)  # a trainer engine's stats, or its dict
        self.syncs.append(SyncRecord(step, version, time.perf_counter() - t0, figures.get("sent_bytes", 0),
                                     figures.get("recv_bytes", 0), figures.get("seconds", 0.0)))

    def engine_version(self) -> str | None:
        """The engine's weight version (server mode: on the main process only, else None)."""
        if self.mode == "colocate":
            return self.llm.get_weight_version()
        if not self.accelerator.is_main_process:
            return None
        client = self.vllm_client
        return client._get(f"{client.base_url}/weight_info")["weight_version"]

    def generate(self, *args, **kwargs) -> tuple:
        """TRL's generation, between two reads of the engine's version: both must be the version of the
        last refit (a ``RuntimeError`` otherwise)."""
        step = self.trainer.state.global_step if self.trainer is not None else -1
        labels = set() if self.mode == "colocate" else None
        if labels is not None:  # read the labels vLLM puts on each output's tokens (CompletionOutput.weight_versions)
            generate = self.llm.generate

            def labelled(*a, **k):
                outputs = generate(*a, **k)
                labels.update(span.version for output in outputs for completion in output.outputs
                              for span in (getattr(completion, "weight_versions", None) or ()))
                return outputs

            self.llm.generate = labelled
        before = self.engine_version()
        try:
            out = super().generate(*args, **kwargs)
        finally:
            if labels is not None:
                del self.llm.generate
        after = self.engine_version()
        self.rollouts.append(RolloutRecord(step, self.weight_version, before, after,
                                           None if labels is None else sorted(labels)))
        if before is not None and not before == after == self.weight_version or labels and labels != {after}:
            raise RuntimeError(f"rollouts at step {step} ran on weight versions {before!r}..{after!r} (tokens "
                               f"labelled {sorted(labels or [])}), not on the last refit's {self.weight_version!r}")
        return out

    def close(self) -> None:
        """Close the refit connection (every trainer rank)."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._session is not None:
            self._session.close()
            self._session = None


@functools.cache
def _generation_class() -> type:
    from trl.generation.vllm_generation import VLLMGeneration

    return type("ReshardVLLMGeneration", (_ReshardGeneration, VLLMGeneration), {"__module__": __name__})


@functools.cache
def _trainer_class() -> type:
    from accelerate.utils import is_peft_model
    from trl import GRPOTrainer
    from trl.trainer import grpo_trainer

    generation_class = _generation_class()

    class ReshardGRPOTrainer(GRPOTrainer):
        """TRL's ``GRPOTrainer``, refitting its vLLM engine(s) through reshard (see module doc).

        Takes ``GRPOTrainer``'s arguments, plus ``refit_options`` (a :class:`~reshard.options.RefitOptions`:
        method, timeout, staging cap, ...) and ``master_address`` (where trainer rank 0 hosts the refit
        group's store: an address the vLLM server can reach; default vLLM's ``get_ip()``). The store's
        port is ``GRPOConfig.vllm_group_port``.

            trainer = ReshardGRPOTrainer(model=path, reward_funcs=reward, train_dataset=data,
                                         args=GRPOConfig(use_vllm=True, vllm_mode="colocate"))
        """

        def __init__(self, *args, refit_options: RefitOptions | None = None, master_address: str | None = None,
                     **kwargs) -> None:
            given = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
            config, model = given.get("args"), given.get("model")
            if given.get("peft_config") is not None:
                raise ValueError("ReshardGRPOTrainer: peft_config is not supported (LoRA adapters are not refitted "
                                 "by reshard yet); train the full model, or use GRPOTrainer")
            if isinstance(model, torch.nn.Module) and is_peft_model(model):
                raise ValueError("ReshardGRPOTrainer: a PEFT model is not supported (LoRA adapters are not refitted "
                                 "by reshard yet); pass the base model, or use GRPOTrainer")
            if config is None or not getattr(config, "use_vllm", False):
                raise ValueError("ReshardGRPOTrainer refits a vLLM engine: pass args=GRPOConfig(use_vllm=True, "
                                 "vllm_mode='server' or 'colocate', ...)")
            make = functools.partial(generation_class, refit_options=refit_options, master_address=master_address)
            with _SWAP:
                original = grpo_trainer.VLLMGeneration
                grpo_trainer.VLLMGeneration = make  # only for this constructor call (module doc)
                try:
                    super().__init__(*args, **kwargs)
                finally:
                    grpo_trainer.VLLMGeneration = original
            self.vllm_generation.trainer = self

        @property
        def syncs(self) -> list[SyncRecord]:
            """This rank's refits, in order."""
            return self.vllm_generation.syncs

        @property
        def rollouts(self) -> list[RolloutRecord]:
            """Each generation call's step and the engine's versions around it."""
            return self.vllm_generation.rollouts

        def close_refit(self) -> None:
            """Close the refit connection (every trainer rank; the engine keeps serving)."""
            self.vllm_generation.close()

    ReshardGRPOTrainer.__module__, ReshardGRPOTrainer.__qualname__ = __name__, "ReshardGRPOTrainer"
    return ReshardGRPOTrainer


def __getattr__(name: str):
    """``ReshardGRPOTrainer`` and ``ReshardVLLMGeneration`` are made (TRL imported) on first use."""
    if name == "ReshardGRPOTrainer":
        return _trainer_class()
    if name == "ReshardVLLMGeneration":
        return _generation_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ReshardGRPOTrainer", "ReshardVLLMGeneration", "RolloutRecord", "SyncRecord"]
