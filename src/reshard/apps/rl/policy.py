"""The policy and its trainer: a tiny random Qwen3 under FSDP2 over ``M`` gloo ranks, AdamW, GRPO steps,
and a refit of the rollout engine after each update, by one of four methods.

One :class:`PolicyTrainer` per trainer rank, each in its own process (a local actor or a Ray actor).
Call sequence, on every rank at once (the driver fans each call out)::

    PolicyTrainer(rank, world, path, lr)      load the checkpoint in fp32, fully_shard it, AdamW
    setup(store_addr)                         join the trainer group (FSDP2's collectives)
    connect(methods, engine, host, tp, staged) connect to the engine for each refit method
    train(samples, num_tokens)                one GRPO step on this rank's share of the batch
    refit(method, version, directory)         push the weights; the engine serves ``version`` after it
    close()

The asynchronous loop refits with ``refit_start`` (the reshard backend's methods, connected with
``staged=True``: ``send_weights(..., wait=False)``, the engine receiving into staging while it
serves; the other methods block there) and ``refit_wait`` (the refit's end); the next ``train``
runs meanwhile: its forward and backward read the shards being sent, and its optimizer step waits
until they have been sent (reshard's optimizer-step guard). ``train`` reports how long that wait took.

Refit methods (the same trainer weights; the engine holds the same bytes after any of them)::

    reshard            the reshard backend (options=RefitOptions(method="reshard")): each worker
                       receives its own shards straight from the trainer ranks that hold them
    hybrid             the reshard backend with method "hybrid" (FFN and experts by reshard, the rest
                       gathered and broadcast, as NeMo RL does)
    gather-broadcast   every rank gathers each full tensor, rank 0 broadcasts them to every worker,
                       which loads them through vLLM's load_weights (the path of vLLM's nccl backend)
    checkpoint         every rank gathers, rank 0 saves safetensors, the engine reloads them

Rendezvous goes through the refit session's documented options only: trainer rank 0 picks a free
port on ``host`` and the ranks agree on it over the trainer group; nothing here knows Ray.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from .grpo import Sample, batch_tensors, policy_loss, token_logprobs

logger = logging.getLogger(__name__)
RESHARD, HYBRID, GATHER_BROADCAST, CHECKPOINT = "reshard", "hybrid", "gather-broadcast", "checkpoint"
REFIT_METHODS = (RESHARD, HYBRID, GATHER_BROADCAST, CHECKPOINT)
SESSION_METHODS = (RESHARD, HYBRID)  # refit sessions of the reshard backend (an engine holds one per method)


def save_policy_checkpoint(path: str, seed: int = 0, **overrides) -> None:
    """The initial policy: a tiny random Qwen3 (2 layers, hidden 64, 320 logits) and the toy tokenizer."""
    from ..toy_models import save_checkpoint

    save_checkpoint(path, "dense", seed=seed, dtype=torch.float32, **overrides)


class PolicyTrainer:
    """One trainer rank (see module doc)."""

    def __init__(self, rank: int, world: int, path: str, lr: float, timeout_s: float = 300.0) -> None:
        self.rank, self.world, self.path, self.lr, self.timeout_s = rank, world, path, lr, timeout_s
        self.model = None
        self.transfers: dict[str, Any] = {}  # method -> vLLM trainer engine (session methods share one)
        self.client = None
        self.staged = False  # the session methods receive staged and send with wait=False
        self.pending = None  # the refit in flight, (method, RefitHandle), between refit_start and refit_wait

    def setup(self, store_addr: str) -> None:
        """Join the trainer group and build the FSDP2 model and its optimizer."""
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        from ...execution.process_group import init_process_group

        torch.set_num_threads(1)
        init_process_group(self.rank, self.world, store_addr=store_addr, backend="gloo")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.0)
        self.dist = dist

    def free_port(self) -> int:
        from ...execution.process_group import free_port

        return free_port()

    def pid(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------------ training

    def train(self, samples: list[Sample], num_tokens: int, max_grad_norm: float = 1.0) -> dict[str, float]:
        """One optimizer step on this rank's samples; ``num_tokens``: completion tokens of the whole batch.
        Returns this rank's loss share, the gradient norm, the mean |engine - trainer| log-prob of
        the sampled tokens (the weights the engine sampled with against the trainer's, before the step)
        and ``guard_s``: how long the optimizer step waited for a refit in flight (reshard's guard)."""
        model = self.model
        batch = batch_tensors(samples)
        mask = batch["completion_mask"]
        logp = token_logprobs(model, batch["input_ids"])
        old = logp.detach()
        # FSDP2 averages gradients over ranks: scale so the sum is the token mean of the whole batch
        loss = policy_loss(logp, old, batch["advantage"], mask, num_tokens) * self.world
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        handle = self.pending[1] if self.pending is not None else None
        waited = handle.guard_wait_s if handle is not None else 0.0
        self.optimizer.step()  # with a refit in flight, reshard's guard holds it until the shards were sent
        guard_s = handle.guard_wait_s - waited if handle is not None else 0.0
        self.optimizer.zero_grad(set_to_none=True)
        gap = 0.0
        if samples and samples[0].sampler_logprobs is not None:
            engine = torch.zeros_like(old)
            for i, s in enumerate(samples):
                start = len(s.prompt_ids) - 1
                engine[i, start: start + len(s.completion_ids)] = torch.tensor(s.sampler_logprobs)
            gap = float(((engine - old).abs() * mask).sum() / mask.sum())
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        return {"loss": loss.item() / self.world, "grad_norm": float(grad_norm), "logprob_gap": gap,
                "guard_s": guard_s}

    # ------------------------------------------------------------------ refit

    def _agreed_port(self) -> int:
        """A free port on rank 0's host, the same on every trainer rank."""
        port = [self.free_port() if self.rank == 0 else 0]
        self.dist.broadcast_object_list(port, src=0)
        return port[0]

    def connect(self, methods: list[str], engine, host: str, tp: int, staged: bool = False) -> dict[str, float]:
        """Connect to the engine (``engine``: its actor handle; used on rank 0 only) for every method in
        ``methods``; seconds per connection. ``staged``: the reshard backend's sessions receive staged."""
        from .rollout import EngineClient

        self.client = EngineClient(engine, self.timeout_s + 60) if self.rank == 0 else None
        self.host, self.tp, self.staged = host, tp, staged
        seconds = {}
        for method in methods:
            start = time.perf_counter()
            if method in SESSION_METHODS:
                self._session(method)
            elif method == GATHER_BROADCAST:
                from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

                from ...integrations.vllm import BroadcastTrainerInitInfo

                info = BroadcastTrainerInitInfo(rank=self.rank, master_address=host, master_port=self._agreed_port(),
                                                engine_world_sizes=[tp], wire_dtype="bfloat16",
                                                timeout_s=self.timeout_s)
                self.transfers[method] = WeightTransferTrainerFactory.trainer_init(info, client=self.client,
                                                                                   source=self.model)
            elif method != CHECKPOINT:
                raise ValueError(f"unknown refit method {method!r}; choose from {', '.join(REFIT_METHODS)}")
            seconds[method] = time.perf_counter() - start
        return seconds

    def _session(self, method: str) -> None:
        """Connect the reshard backend's session running ``method`` (its own port; the engine keeps a
        session per method, so the methods take turns without reconnecting)."""
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from ...integrations.vllm import ReshardSource, ReshardTrainerInitInfo
        from ...options import IN_PLACE, STAGED, RefitOptions

        info = ReshardTrainerInitInfo(rank=self.rank, master_address=self.host, master_port=self._agreed_port(),
                                      num_trainer_ranks=self.world, world_size=self.world + self.tp,
                                      options=RefitOptions(method=method, timeout=self.timeout_s,
                                                           receive=STAGED if self.staged else IN_PLACE),
                                      comm_backend="gloo")
        self.transfers[method] = WeightTransferTrainerFactory.trainer_init(info, client=self.client,
                                                                           source=ReshardSource(self.model))

    # ------------------------------------------------------------------ a fleet of engines (the chaos loop)

    def _fleet_info(self, sizes: list[int]):
        from ...integrations.vllm import ReshardTrainerInitInfo

        return ReshardTrainerInitInfo(rank=self.rank, master_address=self.host, master_port=self._agreed_port(),
                                      num_trainer_ranks=self.world, world_size=self.world + sum(sizes),
                                      engine_world_sizes=list(sizes), options=self.fleet_options, comm_backend="gloo")

    def _fleet_client(self, engines: list):
        """Rank 0: the engines as one weight-sync client (each engine's client kept across reconnects)."""
        from ...integrations.vllm import EngineGroup
        from .rollout import EngineClient

        if self.rank != 0:
            return None
        clients = self.__dict__.setdefault("fleet_clients", {})
        return EngineGroup([clients.setdefault(key, EngineClient(handle, self.timeout_s + 60))
                            for key, handle in engines])

    def connect_fleet(self, engines: list, sizes: list[int], host: str, options: dict) -> float:
        """Connect one reshard session to several engines (``engines``: ``(key, actor handle)`` pairs, in
        refit-rank order; ``sizes``: their worker counts; ``options``: the refit's options as JSON).
        Refits go through :meth:`refit` with method ``reshard``; seconds taken."""
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from ...integrations.vllm import ReshardSource
        from ...options import RefitOptions

        start = time.perf_counter()
        self.host, self.fleet_options = host, RefitOptions.from_json(options)
        self.transfers[RESHARD] = WeightTransferTrainerFactory.trainer_init(
            self._fleet_info(sizes), client=self._fleet_client(engines), source=ReshardSource(self.model))
        return time.perf_counter() - start

    def reconnect_fleet(self, engines: list, sizes: list[int]) -> float:
        """A new session with the engines now (a failed refit broke the last one, or membership changed):
        collective over the trainer ranks and every engine's workers; seconds taken."""
        start = time.perf_counter()
        self.transfers[RESHARD].reconnect(self._fleet_info(sizes), client=self._fleet_client(engines))
        return time.perf_counter() - start

    def arm_fault(self, fault: str, stall_s: float = 3600.0) -> None:
        """For chaos runs: ``fault`` (``kind@point``, reshard's fault injection) fires in this rank's next
        refit; a stall sleeps ``stall_s``."""
        from ...execution import faults

        os.environ["RESHARD_FAULT_STALL_S"] = str(stall_s)
        faults.arm(fault)

    def refit(self, method: str, version: str, directory: str | None = None) -> dict[str, float]:
        """Push the weights by ``method``; the engine serves ``version`` afterwards. Returns ``seconds``
        (this rank)."""
        start = time.perf_counter()
        if method == CHECKPOINT:
            self._checkpoint(version, directory)
        elif method in self.transfers:
            self.transfers[method].send_weights(weight_version=version)
        else:
            raise ValueError(f"refit method {method!r} is not connected")
        return {"seconds": time.perf_counter() - start}

    def overlaps(self, method: str) -> bool:
        """Whether a refit by ``method`` runs in the background here (the reshard backend, staged)."""
        return self.staged and method in SESSION_METHODS

    def refit_start(self, method: str, version: str, directory: str | None = None,
                    snapshot: str | None = None) -> dict[str, Any]:
        """Start a refit by ``method``: in the background where it :meth:`overlaps` (``refit_wait`` ends
        it), else the whole blocking refit. ``snapshot``: a folder to save the weights being sent in,
        first (for a check after: what the engine must hold). Returns ``seconds`` in this call,
        ``started`` (monotonic) and ``overlapped``."""
        if self.pending is not None:
            raise RuntimeError("a refit is still in flight: refit_wait first")
        if snapshot is not None:
            self._save(snapshot)
        started = time.monotonic()
        overlapped = self.overlaps(method)
        if overlapped:
            if method not in self.transfers:
                raise ValueError(f"refit method {method!r} is not connected")
            self.pending = (method, self.transfers[method].send_weights(weight_version=version, wait=False))
        else:
            self.refit(method, version, directory)
        return {"seconds": time.monotonic() - started, "started": started, "overlapped": overlapped}

    def refit_wait(self) -> dict[str, Any]:
        """End the refit :meth:`refit_start` left running (its error raised here, as on every rank):
        ``seconds`` waited here, ``guard_waits`` (optimizer steps that waited for it) and, on rank 0,
        ``pause_s``, each engine's pause as the trainer saw it."""
        if self.pending is None:
            return {"seconds": 0.0, "guard_waits": 0, "pause_s": None}
        (method, handle), self.pending = self.pending, None
        start = time.monotonic()
        handle.wait()
        return {"seconds": time.monotonic() - start, "guard_waits": handle.guard_waits,
                "pause_s": self.transfers[method].last_pause_s if self.rank == 0 else None}

    def stall_next_refit(self, seconds: float) -> None:
        """For tests: this rank's next refit sleeps ``seconds`` before any byte moves (reshard's fault
        injection, ``stall@agreement``); 0 arms nothing."""
        from ...execution import faults

        if seconds > 0:
            os.environ["RESHARD_FAULT_STALL_S"] = str(seconds)
            faults.arm("stall@agreement")

    def save_weights(self, directory: str) -> None:
        """Every rank gathers the full tensors; rank 0 saves them (bf16) in ``directory`` (a reference
        the engines are checked against)."""
        self._save(directory)

    def _save(self, directory: str) -> None:
        """Every rank gathers the full tensors; rank 0 saves them (bf16, the engine's dtype) in ``directory``."""
        from safetensors.torch import save_file

        from ...integrations.vllm import full_checkpoint_tensors

        tensors = {n: t.to(torch.bfloat16).contiguous() for n, t in full_checkpoint_tensors(self.model)}
        if self.rank == 0:
            os.makedirs(directory, exist_ok=True)
            save_file(tensors, os.path.join(directory, "model.safetensors"))

    def _checkpoint(self, version: str, directory: str | None) -> None:
        """Every rank gathers the full tensors; rank 0 saves them and has the engine reload them."""
        if directory is None:
            raise ValueError("a refit by checkpoint needs a directory")
        self._save(directory)
        if self.rank == 0:
            self.client.reload(directory, version)

    def close(self) -> None:
        """Close every connection and leave the trainer group."""
        for engine in {id(e): e for e in self.transfers.values()}.values():
            try:
                engine.shutdown()
            except Exception as e:  # noqa: BLE001 - closing anyway
                logger.warning("closing a refit connection: %s", e)
        self.transfers.clear()
        if self.model is not None and self.dist.is_initialized():
            self.dist.destroy_process_group()


__all__ = [
    "CHECKPOINT",
    "GATHER_BROADCAST",
    "HYBRID",
    "REFIT_METHODS",
    "RESHARD",
    "SESSION_METHODS",
    "PolicyTrainer",
    "save_policy_checkpoint",
]
