"""The vLLM fault suite's rig: a live engine, trainer rank 1's process, the references, and waits
that are all bounded (:class:`Hang` past a deadline). :mod:`reshard.apps.fault_suite_vllm` plays the
scenarios on it.

Imports vLLM and transformers only when a rig is built.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from .fault_scenarios import Outcome
from .fault_vllm_ranks import (STATES, TrainerChild, TrainStep, engine_processes, send_in_flight, set_state,
                               trainer_info, worker_checksum)


PROMPTS = ("hello world", "the weights of")  # greedy tokens of these tell an engine's version apart
GREEDY_TOKENS = 8


class Hang(RuntimeError):
    """A bounded wait that ran past its deadline; ``ranks``: the refit ranks it waited for."""

    def __init__(self, message: str, ranks) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class EngineRig:
    """A live engine, trainer rank 1's process, the references (see module doc)."""

    def __init__(self, workdir: str, tp: int = 2, timeout_s: float = 5.0, stall_s: float | None = None,
                 checksum: bool = True) -> None:
        from transformers import AutoModelForCausalLM

        from .toy_models import save_checkpoint

        self.workdir, self.tp, self.timeout_s, self.checksum = workdir, tp, timeout_s, checksum
        self.stall_s = stall_s if stall_s is not None else 3 * timeout_s
        self.engine_ranks = tuple(range(2, 2 + tp))
        self.pool = ThreadPoolExecutor(4)
        self.ckpt = os.path.join(workdir, "ckpt")
        save_checkpoint(self.ckpt, "dense", dtype=torch.float32)
        self.model = AutoModelForCausalLM.from_pretrained(self.ckpt, dtype=torch.float32)
        self.base = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.train_step = TrainStep(self.model)  # trainer rank 0's step while a refit is in flight
        self.train_step()  # the optimizer's lazy imports now, not inside a refit's timeout
        set_state(self.model, self.base, 0)
        self.receive = "in-place"  # how the sessions connected now receive (a scenario's family may change it)
        self.llm, self.llm_procs = self._start_engine()
        self.child: TrainerChild | None = None
        self.engine = None  # trainer rank 0's weight-transfer engine
        self.state, self.version = 0, None
        self.refs: dict[int, list[str]] = {}
        self.tokens: dict[int, list[list[int]]] = {}  # each state's greedy tokens (GREEDY_TOKENS of each prompt)
        self.leaked = 0  # engine processes still up after their engine's shutdown
        self.engine_restarts = 0

    # ------------------------------------------------------------------ the engine
    def _start_engine(self):
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(self.tp))
        llm = LLM(model=self.ckpt, tensor_parallel_size=self.tp, dtype="bfloat16", enforce_eager=True,
                  max_model_len=128, enable_prefix_caching=False,
                  weight_transfer_config=WeightTransferConfig(backend="reshard"))
        return llm, engine_processes(llm)

    def engine_dead(self) -> bool:
        return bool(self.llm.llm_engine.engine_core.resources.engine_dead)

    def _reap(self, procs, notes: list[str] | None) -> None:
        """Wait up to 30 s for ``procs`` to be gone; kill and count (and note) the survivors as leaked."""
        deadline = time.monotonic() + 30
        while any(p.is_running() and p.status() != "zombie" for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        leaked = [p for p in procs if p.is_running() and p.status() != "zombie"]
        for p in leaked:
            if notes is not None:
                notes.append(f"leaked engine process {p.pid} ({' '.join(p.cmdline())[:60]}) still up 30 s after "
                             f"shutdown: killed")
            p.kill()
        self.leaked += len(leaked)

    def replace_engine(self, o: Outcome) -> None:
        """Shut the dead engine down (every process of it gone), then start a new one from the checkpoint."""
        import gc

        from ..integrations.vllm.inspect import close_engine

        _, err, _ = self.bounded(60, self.engine_ranks, close_engine, self.llm)
        if err is not None:
            o.notes.append(f"closing the dead engine: {type(err).__name__}: {err}")
        self._reap(self.llm_procs, o.notes)
        self.llm = None
        gc.collect()
        res, err, _ = self.bounded(600, self.engine_ranks, self._start_engine)
        if err is not None:  # vLLM's start, not reshard's: once more (a process of another run may reap ours)
            o.notes.append(f"the new engine did not start ({type(err).__name__}: {err}); started again")
            res, err, _ = self.bounded(600, self.engine_ranks, self._start_engine)
        if err is not None:
            raise RuntimeError(f"the new engine did not start: {type(err).__name__}: {err}") from err
        self.llm, self.llm_procs = res
        self.engine_restarts += 1

    # ------------------------------------------------------------------ every wait bounded: past it, a hang
    def bounded(self, seconds: float, ranks, fn, *args, **kwargs):
        """``(result, exception, finished at)`` of ``fn``; raises :class:`Hang` (naming ``ranks``) past ``seconds``."""
        def call():
            try:
                return fn(*args, **kwargs), None, time.monotonic()
            except Exception as e:  # noqa: BLE001 - the caller judges it
                return None, e, time.monotonic()

        try:
            return self.pool.submit(call).result(timeout=seconds)
        except FutureTimeout:
            raise Hang(f"{getattr(fn, '__name__', fn)} did not return within {seconds:g} s", ranks) from None

    def rpc(self, fn, *args, seconds: float | None = None):
        out, err, _ = self.bounded(seconds or self.stall_s + 30, self.engine_ranks, self.llm.collective_rpc, fn,
                                   args=args)
        if err is not None:
            raise err
        return out

    def digests(self) -> list[str]:
        from ..integrations.vllm.inspect import engine_digest

        return self.rpc(engine_digest)

    def generate(self):
        from vllm import SamplingParams

        return self.bounded(self.stall_s + 30, self.engine_ranks, self.llm.generate, ["hello world"],
                            SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)

    def greedy(self) -> list[list[int]]:
        """The engine's greedy tokens for :data:`PROMPTS` (raises what ``generate`` raises)."""
        from vllm import SamplingParams

        outs, err, _ = self.bounded(self.stall_s + 30, self.engine_ranks, self.llm.generate, list(PROMPTS),
                                    SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True),
                                    use_tqdm=False)
        if err is not None:
            raise err
        return [list(o.outputs[0].token_ids) for o in outs]

    def transfer_states(self, seconds: float | None = None) -> list[dict]:
        """Every worker's refit state (:func:`~reshard.integrations.vllm.inspect.transfer_state`)."""
        from ..integrations.vllm.inspect import transfer_state

        return self.rpc(transfer_state, seconds=seconds)

    def send_in_flight(self, version: str) -> dict:
        """Rank 0's refit with ``wait=False``, its optimizer step meanwhile, then ``wait()`` (the guard's
        figures; the refit's error raised with them as ``guard``)."""
        return send_in_flight(self.engine, self.train_step, version)

    def child_answer(self, seconds: float, what: str):
        answer = self.child.wait(seconds)
        if answer is None:
            raise Hang(f"trainer rank 1 did not answer its {what}", (1,))
        return answer

    # ------------------------------------------------------------------ setup
    def references(self) -> None:
        """Each state's engine digest, through the gloo_broadcast path; state 0 checked against the load."""
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from ..execution.process_group import free_port
        from ..integrations.vllm import BroadcastTrainerInitInfo

        loaded = self.digests()
        info = BroadcastTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(),
                                        engine_world_sizes=[self.tp], wire_dtype="bfloat16", timeout_s=60)
        baseline = WeightTransferTrainerFactory.trainer_init(info, client=self.llm, source=self.model)
        for state in (*STATES, 0):
            set_state(self.model, self.base, state)
            baseline.send_weights(weight_version=f"reference-{state}")
            self.refs[state] = self.digests()
            self.tokens[state] = self.greedy()
        baseline.shutdown()
        if self.refs[0] != loaded:
            raise RuntimeError(f"the reference path does not reproduce the loaded engine: {self.refs[0]} != {loaded}")
        if len({tuple(d) for d in self.refs.values()}) != len(self.refs):
            raise RuntimeError("two weight states have the same digest")
        self.state, self.version = 0, "reference-0"

    def connect(self, new_engine: bool = False) -> float | None:
        """Both trainer ranks (re)connect on a fresh port (``new_engine``: rank 0 to the engine that replaced
        a dead one); the time it ended, or None if it failed."""
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from ..execution.process_group import free_port
        from ..integrations.vllm import ReshardSource

        port = free_port()
        self.child.send("connect", port, self.receive)
        info = trainer_info(0, port, self.tp, self.timeout_s, self.checksum, self.receive)
        limit = 3 * self.timeout_s + 30
        if self.engine is None:
            res, err, t = self.bounded(limit, (0,), WeightTransferTrainerFactory.trainer_init, info, client=self.llm,
                                       source=ReshardSource(self.model))
            if err is None:
                self.engine = res
        else:
            _, err, t = self.bounded(limit, (0,), self.engine.reconnect, info, client=self.llm if new_engine else None)
        answer = self.child_answer(limit, "connect")
        if err is not None or answer[0] != "ok":
            return None
        return max(t, answer[1])

    def move_to(self, state: int, child: bool = True) -> None:
        """Both trainer ranks' weights to ``state`` (``child`` False: rank 0's only, rank 1 died)."""
        set_state(self.model, self.base, state)
        if not child:
            return
        self.child.send("state", state)
        if self.child_answer(60, "new state")[0] != "ok":
            raise Hang("trainer rank 1 did not take the new state", (1,))

    def clean_refit(self, version: str) -> tuple[bool, float]:
        """A refit without a fault; whether it committed, and when."""
        self.child.send("refit", version, None, self.stall_s)
        limit = 3 * self.timeout_s + 60
        _, err, t = self.bounded(limit, (0,), self.engine.send_weights, weight_version=version)
        answer = self.child_answer(limit, "refit")
        return err is None and answer[0] == "ok", max(t, answer[1])

    def setup(self) -> tuple[int, dict[int, list[int]]]:
        """Trainer rank 1 started, references taken, a first clean refit checked; the plan's rounds, and the
        rounds in which each trainer rank sends."""
        self.child = TrainerChild(self.ckpt, self.tp, self.timeout_s, self.checksum)
        self.references()
        if self.connect() is None:
            raise RuntimeError("the first connect failed")
        self.check_checksum()
        self.move_to(1)
        ok, _ = self.clean_refit("v0")
        if not ok or self.digests() != self.refs[1] or self.llm.get_weight_version() != "v0":
            raise RuntimeError("the first clean refit does not reproduce the reference")
        self.state, self.version = 1, "v0"
        plan = self.engine.session.plan
        return plan.num_rounds, {r: sorted({m.round for m in plan.for_rank(r).sends}) or [0] for r in (0, 1)}

    def restart_child(self, state: int) -> None:
        """A new trainer rank 1 (the old one died), at weight state ``state``."""
        self.child.close()
        self.child = TrainerChild(self.ckpt, self.tp, self.timeout_s, self.checksum)
        self.move_to(state)

    def check_checksum(self) -> None:
        """The init info's ``checksum`` reached every rank's session (trainer rank 0's and the workers')."""
        got = [self.engine.session.options.checksum, *self.rpc(worker_checksum)]
        if got != [self.checksum] * (1 + self.tp):
            raise RuntimeError(f"checksum={self.checksum} in the init info, but the sessions (rank 0, the workers) "
                               f"have {got}")

    def close(self) -> None:
        """Trainer rank 1, rank 0's session and the engine shut down (its processes reaped: see ``leaked``)."""
        from ..integrations.vllm.inspect import close_engine

        if self.child is not None:
            self.child.close()
        if self.engine is not None:
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001 - a broken session: the run ends anyway
                pass
        if self.llm is not None:
            close_engine(self.llm)
            self._reap(self.llm_procs, None)
        self.pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["GREEDY_TOKENS", "PROMPTS", "EngineRig", "Hang"]
