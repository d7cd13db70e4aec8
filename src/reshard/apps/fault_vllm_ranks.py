"""The vLLM fault suite's other refit ranks: trainer rank 1 (a child process the driver replaces when
a fault kills it) and the calls the engine's workers run (``collective_rpc``).

Nothing here imports vLLM, transformers or :mod:`reshard.integrations` at module import time.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch

from ..execution import faults
from ..options import RefitOptions

STATES = (1, 2, 3)  # the trainer's weight states the scenarios move between (0: the checkpoint)
BUCKET_BYTES = 64 << 10  # the refit sessions' staging cap
# Spawning trainer rank 1 and loading its model: ~10 s here, ~30 s with both cores busy; 120 s is a margin of 4x
CHILD_READY_S = 120.0


def quiet_vllm_environment() -> None:
    """vLLM on CPU, offline, quiet: set in this process before vLLM is imported (children inherit it)."""
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", HF_HUB_OFFLINE="1",
                      VLLM_LOGGING_LEVEL="ERROR", TOKENIZERS_PARALLELISM="false")


def set_state(model, base: dict, state: int) -> None:
    """The trainer's weights at ``state``: the checkpoint plus a seeded change (the same in every process)."""
    generator = torch.Generator().manual_seed(1000 + state)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(base[name])
            if state:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)


def trainer_info(rank: int, port: int, workers: int, timeout_s: float, checksum: bool, receive: str = "in-place"):
    """Trainer rank ``rank``'s init info: 2 trainer ranks, one engine of ``workers`` workers (``receive``:
    ``"staged"`` makes them receive while the engine serves)."""
    from ..integrations.vllm import ReshardTrainerInitInfo

    options = RefitOptions(timeout=timeout_s, max_bucket_bytes=BUCKET_BYTES, checksum=checksum, receive=receive)
    return ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port, num_trainer_ranks=2,
                                  world_size=2 + workers, engine_world_sizes=[workers], options=options)


class TrainStep:
    """A trainer's next step on ``model``: a forward and a backward (they read the parameters a refit in
    flight is sending) and an SGD step (it changes them, so the refit's guard must make it wait)."""

    def __init__(self, model) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        vocab = model.config.vocab_size
        self.ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0))

    def __call__(self) -> None:
        self.model(input_ids=self.ids, labels=self.ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def send_in_flight(engine, step: TrainStep, version: str) -> dict:
    """``send_weights(version, wait=False)``, the trainer's step while it is in flight, then ``wait()``:
    how many optimizer steps waited for it and whether it guarded none of the trainer's parameters
    (``{"guard_waits", "guard_broken"}``); the refit's error is raised with them as ``guard``."""
    handle = engine.send_weights(weight_version=version, wait=False)
    broken = int(not handle.storages)  # no guard: the step would not wait (the engine's digest tells if it mattered)
    step()
    guard = {"guard_waits": handle.guard_waits, "guard_broken": broken}
    try:
        handle.wait()
    except Exception as error:
        error.guard = guard
        raise
    return guard


# ---------------------------------------------------------------------------- engine workers (collective_rpc)
def worker_arm(worker, rank: int, fault: str | None, stall_s: float, fire_file: str | None) -> bool:
    """Arm ``fault`` in the worker whose refit rank is ``rank`` (disarm every other); ``fire_file`` gets the
    time it fires."""
    if fault is None or getattr(worker.weight_transfer_engine, "rank", None) != rank:
        faults.arm(None)
        return False
    os.environ["RESHARD_FAULT_STALL_S"] = str(stall_s)

    def fired(point: str) -> None:
        with open(fire_file, "w") as f:
            f.write(repr(time.monotonic()))

    faults.arm(fault, on_fire=fired)
    return True


def worker_checksum(worker) -> bool | None:
    """Whether the worker's refit session checks a digest per message (None: no session)."""
    session = getattr(worker.weight_transfer_engine, "session", None)
    return None if session is None else bool(session.options.checksum)


def engine_processes(llm) -> list:
    """An offline engine's processes (``psutil.Process``: its EngineCore, then the workers under it)."""
    import psutil

    cores = [psutil.Process(p.pid) for p in llm.llm_engine.engine_core.resources.engine_manager.processes]
    return cores + [c for core in cores for c in core.children(recursive=True)]


# ---------------------------------------------------------------------------- trainer rank 1 (a child process)
def trainer_child(conn, ckpt: str, workers: int, timeout_s: float, checksum: bool) -> None:
    """Refit rank 1: obeys ``(op, ...)`` messages, answers ``(status, time, fired_at, detail, ranks at fault,
    guard)`` (``guard``: :func:`send_in_flight`'s figures, for a refit sent in flight)."""
    quiet_vllm_environment()
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from ..integrations.vllm import ReshardSource

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = TrainStep(model)
    step()  # the optimizer's lazy imports (seconds) now, not inside a refit's timeout
    set_state(model, base, 0)
    engine = None
    conn.send(("ready", time.monotonic(), None, None, (), {}))
    while True:
        op, *args = conn.recv()
        fired_at: list[float] = []
        guard: dict = {}
        try:
            if op == "quit":
                if engine is not None:
                    engine.shutdown()
                return
            if op == "state":
                set_state(model, base, args[0])
            elif op == "connect":
                info = trainer_info(1, args[0], workers, timeout_s, checksum, *args[1:])
                if engine is None:
                    engine = WeightTransferTrainerFactory.trainer_init(info, client=None, source=ReshardSource(model))
                else:
                    engine.reconnect(info)
            elif op == "refit":
                version, fault, stall_s, *in_flight = args
                os.environ["RESHARD_FAULT_STALL_S"] = str(stall_s)
                faults.arm(fault, on_fire=lambda point: fired_at.append(time.monotonic()))
                if in_flight and in_flight[0]:
                    guard = send_in_flight(engine, step, version)
                else:
                    engine.send_weights(weight_version=version)
            conn.send(("ok", time.monotonic(), fired_at[0] if fired_at else None, None, (), guard))
        except Exception as e:  # noqa: BLE001 - reported to the driver
            conn.send(("error", time.monotonic(), fired_at[0] if fired_at else None,
                       f"{type(e).__name__}: {getattr(e, 'phase', '')}: {str(e)[:200]}",
                       tuple(getattr(e, "ranks", ())), getattr(e, "guard", guard)))
        finally:
            faults.arm(None)


class TrainerChild:
    """Trainer rank 1's process and its pipe; started ready (its model loaded) or raises."""

    def __init__(self, ckpt: str, workers: int, timeout_s: float, checksum: bool) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=trainer_child, args=(theirs, ckpt, workers, timeout_s, checksum), daemon=True)
        self.proc.start()
        if self.wait(CHILD_READY_S) is None:
            self.close()
            raise RuntimeError(f"trainer rank 1 did not start within {CHILD_READY_S:g} s")

    def send(self, *msg) -> None:
        self.conn.send(msg)

    def wait(self, seconds: float):
        """The next answer, or None if none came within ``seconds`` (or the process died)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.conn.poll(0.05):
                try:
                    return self.conn.recv()
                except EOFError:
                    return None
            if not self.proc.is_alive():
                return self.conn.recv() if self.conn.poll(0) else None
        return None

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.send("quit")
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


__all__ = ["BUCKET_BYTES", "STATES", "TrainStep", "TrainerChild", "send_in_flight", "engine_processes", "quiet_vllm_environment", "set_state",
           "trainer_child", "trainer_info", "worker_arm", "worker_checksum"]
