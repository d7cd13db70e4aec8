"""The fault-injection suite against a live vLLM engine: randomized failed refits, each one checked, counted.

Run from the repository root (needs ``vllm``; on a 2-core machine a stall scenario takes ~15 s, an
engine kill ~30-40 s (a new engine starts), most others under 1 s)::

    python benchmarks/bench_faults_vllm.py [--scenarios 30] [--seed 0] [--tp 2] [--timeout 5] [--stall 15]
                                           [--faults kill,stall,raise,corrupt] [--engine-kills N]
                                           [--no-checksum] [--json out.json]

One offline ``vllm.LLM`` (TP=2 by default, on the ``reshard`` backend) serves the run (a new one
replaces it when an engine kill took it down); a trainer of two ranks refits it: refit rank 0 is
this process (it holds the ``LLM``), refit rank 1 a child process (replaced when a fault kills it);
the engine's workers are refit ranks 2.. . The trainer's weights take one of a few fixed states;
each state's reference digest of the engine (:func:`~reshard.integrations.vllm.inspect.engine_digest`,
every tensor the workers compute with) is taken once, at the start, after a refit through the
independent path (``gloo_broadcast``: full tensors through vLLM's ``load_weights``); state 0 is
the checkpoint the engine loaded, which checks that path too.

Each scenario moves the trainer to another state and refits to a new version with one fault armed
(:mod:`reshard.execution.faults`) at a random side and point:

* trainer rank 0 (this process): ``raise``, ``stall``, ``corrupt``;
* trainer rank 1 (the child): ``kill``, ``stall``, ``raise``, ``corrupt``;
* one engine worker (armed through ``collective_rpc``): ``raise``, ``stall``; ``corrupt`` needs a
  sender, and the workers only receive;
* engine kills: ``kill`` in one engine worker (SIGKILL of the worker whose refit rank was drawn,
  from inside it, at the fault point). vLLM's executor then takes the whole engine down. A new
  engine takes ~30 s to start here, so these are drawn apart: ``--engine-kills`` scenarios
  (default 10 % of them, at least 3), at random places in the run.

``--faults`` keeps only the kinds named (``--faults corrupt`` forces corrupt faults).

The fault sits at ``agreement``, ``transfer round j`` (a round the plan has) or ``commit``. Then it checks: the
trainer's ranks raised ``RefitError`` within ``2 x timeout + 10 s`` (plus the stall, up to the
trainer's grace, when an engine worker stalls: rank 0 waits for the engine's call; every wait is bounded; a
wait past its deadline is a hang, and the run stops there: the state is unknown); the engine's
weight version did not move; a refit that failed after bytes may have moved leaves the engine
gated (``generate`` raises ``WeightsPoisonedError``: a generate that succeeds is a torn model
served), one that failed before (connect, agreement) leaves it serving the previous state exactly;
then both trainer ranks reconnect (fresh port) and refit again, and the engine must hold exactly
the reference of the trainer's state: recovered. A refit reported committed whose engine digest
differs from the reference is a silent corruption.

An engine kill is checked the same way, except for the dead engine itself: its front end must
know it is dead within 60 s, both trainer ranks' ``RefitError`` must name the killed worker's rank,
and ``generate`` on it must raise; then the harness shuts it down (every process of it must be
gone; one still up 30 s later is killed and counted as leaked), starts a new engine from the
checkpoint, reconnects the trainer to it (``reconnect(init_info, client=new_llm)``) and refits: the
new engine must hold exactly the reference of the trainer's state.

Checksums: on by default, through the backend's option (``ReshardTrainerInitInfo(checksum=True)``,
carried to the workers' sessions in their init info; the harness checks every session has it):
a ``corrupt`` fault must then fail the refit. ``--no-checksum`` leaves it off; a ``corrupt`` fault
is then undetected (the refit commits), and a silent corruption wherever the flipped byte
changed a weight the engine keeps in bf16.

Detection time: fault fired -> the last trainer rank that did not fault raising ``RefitError``
(rank 0's raise includes gating the engine). Recovery time: detection -> the refit after the
reconnect committed (a killed trainer rank's replacement process start included; an engine
kill's, with the new engine's start, counted apart).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

SIDES = {"trainer 0": ("raise", "stall", "corrupt"), "trainer 1": ("kill", "stall", "raise", "corrupt"),
         "engine": ("raise", "stall")}
KINDS = ("kill", "stall", "raise", "corrupt")
STATES = (1, 2, 3)  # the trainer's weight states the scenarios move between (0: the checkpoint)
NOTHING_MOVED = ("connect", "agreement")


def _environment() -> None:
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", HF_HUB_OFFLINE="1",
                      VLLM_LOGGING_LEVEL="ERROR", TOKENIZERS_PARALLELISM="false")


def set_state(model, base: dict, state: int) -> None:
    """The trainer's weights at ``state``: the checkpoint plus a seeded change (the same in every process)."""
    import torch

    g = torch.Generator().manual_seed(1000 + state)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(base[n])
            if state:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def worker_arm(worker, rank: int, fault: str | None, stall_s: float, fire_file: str | None) -> bool:
    """Arm ``fault`` in the worker whose refit rank is ``rank`` (disarm every other); ``fire_file`` gets the time it fires."""
    from reshard.execution import faults

    if fault is None or getattr(worker.weight_transfer_engine, "rank", None) != rank:
        faults.arm(None)
        return False
    os.environ["RESHARD_FAULT_STALL_S"] = str(stall_s)

    def fired(point: str) -> None:
        with open(fire_file, "w") as f:
            f.write(repr(time.time()))

    faults.arm(fault, on_fire=fired)
    return True


def worker_checksum(worker) -> bool | None:
    """Whether the worker's refit session checks a digest per message (None: no session)."""
    session = getattr(worker.weight_transfer_engine, "session", None)
    return None if session is None else bool(session.options["checksum"])


def engine_processes(llm) -> list:
    """An offline engine's processes (``psutil.Process``: its EngineCore, then the workers under it)."""
    import psutil

    cores = [psutil.Process(p.pid) for p in llm.llm_engine.engine_core.resources.engine_manager.processes]
    return cores + [c for core in cores for c in core.children(recursive=True)]


def trainer_info(rank: int, port: int, workers: int, timeout_s: float, checksum: bool):
    from reshard.integrations.vllm import ReshardTrainerInitInfo

    return ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port, num_trainer_ranks=2,
                                  world_size=2 + workers, engine_world_sizes=[workers], timeout_s=timeout_s,
                                  max_bucket_bytes=64 << 10, checksum=checksum)


# ---------------------------------------------------------------------------- trainer rank 1 (a child process)
def trainer_child(conn, ckpt: str, workers: int, timeout_s: float, checksum: bool) -> None:
    """Refit rank 1: obeys ``(op, ...)`` messages, answers ``(status, time, fired_at, detail, ranks at fault)``."""
    _environment()
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard.execution import faults
    from reshard.integrations.vllm import ReshardSource

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = None
    conn.send(("ready", time.time(), None, None, ()))
    while True:
        op, *args = conn.recv()
        fired_at: list[float] = []
        try:
            if op == "quit":
                if engine is not None:
                    engine.shutdown()
                return
            if op == "state":
                set_state(model, base, args[0])
            elif op == "connect":
                info = trainer_info(1, args[0], workers, timeout_s, checksum)
                if engine is None:
                    engine = WeightTransferTrainerFactory.trainer_init(info, client=None, source=ReshardSource(model))
                else:
                    engine.reconnect(info)
            elif op == "refit":
                version, fault, stall_s = args
                os.environ["RESHARD_FAULT_STALL_S"] = str(stall_s)
                faults.arm(fault, on_fire=lambda point: fired_at.append(time.time()))
                engine.send_weights(weight_version=version)
            conn.send(("ok", time.time(), fired_at[0] if fired_at else None, None, ()))
        except Exception as e:  # noqa: BLE001 - reported to the driver
            conn.send(("error", time.time(), fired_at[0] if fired_at else None,
                       f"{type(e).__name__}: {getattr(e, 'phase', '')}: {str(e)[:200]}",
                       tuple(getattr(e, "ranks", ()))))
        finally:
            faults.arm(None)


class Child:
    """Trainer rank 1's process and its pipe."""

    def __init__(self, ckpt: str, workers: int, timeout_s: float, checksum: bool) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=trainer_child, args=(theirs, ckpt, workers, timeout_s, checksum), daemon=True)
        self.proc.start()
        if self.wait(120) is None:
            raise RuntimeError("trainer rank 1 did not start")

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


# ---------------------------------------------------------------------------- scenarios
@dataclass
class Scenario:
    index: int
    side: str
    kind: str
    point: str
    rank: int  # the refit rank at fault

    @property
    def fault(self) -> str:
        return f"{self.kind}@{self.point}"

    def describe(self) -> str:
        return f"#{self.index} {self.fault} on {self.side} (refit rank {self.rank})"


@dataclass
class Outcome:
    scenario: Scenario
    fired: bool = False
    result: str = ""
    phase: str | None = None
    hang: str | None = None
    silent: int = 0
    torn: int = 0
    late: bool = False
    detection_s: float | None = None
    recovery_s: float | None = None
    engine_restart: bool = False  # an engine worker was killed: the engine was replaced
    named: bool | None = None  # (engine kills) both trainer ranks' RefitError named the killed worker's rank
    undetected: bool = False  # a corrupt fault fired, yet the refit committed
    notes: list[str] = field(default_factory=list)


def random_scenario(index: int, rng: random.Random, workers: int, rounds: int,
                    send_rounds: dict[int, list[int]], kinds: tuple[str, ...] = KINDS,
                    engine_kill: bool = False) -> Scenario:
    """``send_rounds``: the rounds in which each trainer rank sends (a ``corrupt`` fault needs a send);
    ``kinds``: the fault kinds to draw from; ``engine_kill``: this scenario kills an engine worker."""
    if engine_kill:
        side, kind = "engine", "kill"
    else:
        sides = {side: [k for k in ks if k in kinds] for side, ks in SIDES.items()}
        side = rng.choice([side for side, ks in sides.items() if ks])
        kind = rng.choice(sides[side])
    rank = {"trainer 0": 0, "trainer 1": 1}[side] if side != "engine" else 2 + rng.randrange(workers)
    point = rng.choice(("agreement", "round", "commit")) if kind != "corrupt" else "round"
    if point == "round":
        j = rng.choice(send_rounds[rank]) if kind == "corrupt" else rng.randrange(max(rounds, 1))
        point = f"transfer round {j}"
    return Scenario(index, side, kind, point, rank)


class Suite:
    def __init__(self, args, workdir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from reshard.apps.toy_models import save_checkpoint

        self.args, self.workdir = args, workdir
        self.timeout_s, self.stall_s = args.timeout, args.stall if args.stall is not None else 3 * args.timeout
        self.pool = ThreadPoolExecutor(4)
        self.ckpt = os.path.join(workdir, "ckpt")
        save_checkpoint(self.ckpt, "dense", dtype=torch.float32)
        self.model = AutoModelForCausalLM.from_pretrained(self.ckpt, dtype=torch.float32)
        self.base = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.llm, self.llm_procs = self._start_engine()
        self.child: Child | None = None
        self.engine = None
        self.state = 0
        self.version: str | None = None
        self.refs: dict[int, list[str]] = {}
        self.leaked = 0  # engine processes still up after their engine's shutdown
        self.engine_restarts = 0

    def _start_engine(self):
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        tp = self.args.tp
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
        llm = LLM(model=self.ckpt, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                  enable_prefix_caching=False,
                  weight_transfer_config=WeightTransferConfig(backend="reshard"))
        return llm, engine_processes(llm)

    def engine_dead(self) -> bool:
        return bool(self.llm.llm_engine.engine_core.resources.engine_dead)

    def replace_engine(self, o: Outcome) -> None:
        """Shut the dead engine down (every process of it gone: a survivor is killed and noted as leaked),
        then start a new one from the checkpoint (state 0)."""
        import gc

        from reshard.integrations.vllm.inspect import close_engine

        dead, procs = self.llm, self.llm_procs
        _, err, _ = self.bounded(60, close_engine, dead)
        if err is not None:
            o.notes.append(f"closing the dead engine: {type(err).__name__}: {err}")
        deadline = time.monotonic() + 30
        while any(p.is_running() and p.status() != "zombie" for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        leaked = [p for p in procs if p.is_running() and p.status() != "zombie"]
        for p in leaked:
            o.notes.append(f"leaked engine process {p.pid} ({' '.join(p.cmdline())[:60]}) still up 30 s after "
                           f"shutdown: killed")
            p.kill()
        self.leaked += len(leaked)
        self.llm = None
        del dead
        gc.collect()
        res, err, _ = self.bounded(600, self._start_engine)
        if err is not None:  # vLLM's start, not reshard's: once more (a process of another run may reap ours)
            o.notes.append(f"the new engine did not start ({type(err).__name__}: {err}); started again")
            res, err, _ = self.bounded(600, self._start_engine)
        if err is not None:
            raise RuntimeError(f"the new engine did not start: {type(err).__name__}: {err}") from err
        self.llm, self.llm_procs = res
        self.engine_restarts += 1

    # every wait bounded: a call past its deadline is a hang
    def bounded(self, seconds: float, fn, *args, **kwargs):
        """``(result, exception, finished at)``; raises ``Hang`` past ``seconds``."""
        def run():
            try:
                return fn(*args, **kwargs), None, time.time()
            except Exception as e:  # noqa: BLE001 - the caller judges it
                return None, e, time.time()

        try:
            return self.pool.submit(run).result(timeout=seconds)
        except FutureTimeout:
            raise Hang(f"{getattr(fn, '__name__', fn)} did not return within {seconds:g} s") from None

    def rpc(self, fn, *args, seconds: float | None = None):
        out, err, _ = self.bounded(seconds or self.stall_s + 30, self.llm.collective_rpc, fn, args=args)
        if err is not None:
            raise err
        return out

    def digests(self) -> list[str]:
        from reshard.integrations.vllm.inspect import engine_digest

        return self.rpc(engine_digest)

    def generate(self):
        from vllm import SamplingParams

        return self.bounded(self.stall_s + 30, self.llm.generate, ["hello world"],
                            SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)

    # ------------------------------------------------------------------ setup
    def references(self) -> None:
        """Each state's engine digest, through the gloo_broadcast path; state 0 checked against the load."""
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from reshard.execution.process_group import free_port
        from reshard.integrations.vllm import BroadcastTrainerInitInfo

        loaded = self.digests()
        info = BroadcastTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(),
                                        engine_world_sizes=[self.args.tp], wire_dtype="bfloat16", timeout_s=60)
        baseline = WeightTransferTrainerFactory.trainer_init(info, client=self.llm, source=self.model)
        for s in (*STATES, 0):
            set_state(self.model, self.base, s)
            baseline.send_weights(weight_version=f"reference-{s}")
            self.refs[s] = self.digests()
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

        from reshard.execution.process_group import free_port
        from reshard.integrations.vllm import ReshardSource

        port = free_port()
        self.child.send("connect", port)
        info = trainer_info(0, port, self.args.tp, self.timeout_s, self.args.checksum)
        if self.engine is None:
            fn = WeightTransferTrainerFactory.trainer_init
            res, err, t = self.bounded(3 * self.timeout_s + 30, fn, info, client=self.llm,
                                       source=ReshardSource(self.model))
            if err is None:
                self.engine = res
        else:
            _, err, t = self.bounded(3 * self.timeout_s + 30, self.engine.reconnect, info,
                                     client=self.llm if new_engine else None)
        answer = self.child.wait(3 * self.timeout_s + 30)
        if answer is None:
            raise Hang("trainer rank 1 did not answer its connect")
        if err is not None or answer[0] != "ok":
            return None
        return max(t, answer[1])

    def move_to(self, state: int) -> None:
        set_state(self.model, self.base, state)
        self.child.send("state", state)
        if (self.child.wait(60) or ("",))[0] != "ok":
            raise Hang("trainer rank 1 did not take the new state")

    def clean_refit(self, version: str) -> tuple[bool, float]:
        """A refit without a fault; whether it committed, and when."""
        self.child.send("refit", version, None, self.stall_s)
        _, err, t = self.bounded(3 * self.timeout_s + 60, self.engine.send_weights, weight_version=version)
        answer = self.child.wait(3 * self.timeout_s + 60)
        if answer is None:
            raise Hang("trainer rank 1 did not answer its refit")
        return err is None and answer[0] == "ok", max(t, answer[1])

    def setup(self) -> int:
        self.child = Child(self.ckpt, self.args.tp, self.timeout_s, self.args.checksum)
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

    def check_checksum(self) -> None:
        """The init info's ``checksum`` reached every rank's session (trainer rank 0's and the workers')."""
        want = self.args.checksum
        got = [self.engine.session.options["checksum"], *self.rpc(worker_checksum)]
        if got != [want] * (1 + self.args.tp):
            raise RuntimeError(f"checksum={want} in the init info, but the sessions (rank 0, the workers) have {got}")

    # ------------------------------------------------------------------ one scenario
    def run(self, s: Scenario, rng: random.Random) -> Outcome:
        from reshard.execution import faults
        from reshard.integrations.vllm import WeightsPoisonedError
        from reshard.refit import RefitError

        o = Outcome(s)
        engine_kill = s.side == "engine" and s.kind == "kill"
        new = rng.choice([x for x in STATES if x != self.state])
        self.move_to(new)
        version = f"v{s.index + 1}"
        fire_file = os.path.join(self.workdir, f"fired-{s.index}")
        main_fired: list[float] = []
        if s.side == "engine":
            self.rpc(worker_arm, s.rank, s.fault, self.stall_s, fire_file)
        elif s.side == "trainer 0":
            os.environ["RESHARD_FAULT_STALL_S"] = str(self.stall_s)
            faults.arm(s.fault, on_fire=lambda point: main_fired.append(time.time()))
        self.child.send("refit", version, s.fault if s.side == "trainer 1" else None, self.stall_s)
        start = time.time()
        # rank 0 may also wait for the engine's calls: the grace for its update call, twice that to gate it
        limit = 3 * self.timeout_s + self.stall_s + 3 * self.engine.grace_s + 30
        try:
            _, err0, t0 = self.bounded(limit, self.engine.send_weights, weight_version=version)
        finally:
            faults.arm(None)
        answer = self.child.wait(limit)
        if answer is None and self.child.proc.is_alive():
            raise Hang("trainer rank 1 did not answer its refit")
        fired_at = main_fired[0] if main_fired else answer[2] if answer else None
        if s.side == "engine" and os.path.exists(fire_file):
            with open(fire_file) as f:
                fired_at = float(f.read())
        dead = False
        if engine_kill and fired_at is not None:
            # the killed worker's engine must die as a whole (vLLM's executor watches its workers), and its
            # front end must know it, within a bound
            deadline = time.monotonic() + 60
            while not (dead := self.engine_dead()) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not dead:
                raise Hang("an engine worker was killed, but the engine is not dead 60 s later")
            o.engine_restart = True
        if s.side == "engine" and not dead:
            self.rpc(worker_arm, -1, None, self.stall_s, None)  # disarm: a fault that did not fire must not linger
        child_dead = answer is None
        o.fired = fired_at is not None or (s.kind == "kill" and child_dead)
        if child_dead and fired_at is None:
            fired_at = start  # killed before it could say: count from the refit's start (an upper bound)

        committed0, committed1 = err0 is None, answer is not None and answer[0] == "ok"
        if committed0 or committed1:
            o.result = "committed" if (committed0 and committed1) else "split outcome"
            if not o.fired:
                o.result += " (fault did not fire)"
            if dead:
                o.notes.append("a trainer rank reported the refit committed, though an engine worker was killed in it")
            elif committed0:
                got = self.digests()
                if got != self.refs[new] or self.llm.get_weight_version() != version:
                    o.silent += 1
                    o.notes.append(f"committed {version} but the engine holds {got}, not {self.refs[new]}")
                elif s.kind == "corrupt" and o.fired:
                    o.notes.append("a byte was flipped on the wire, yet the engine holds exactly the reference "
                                   "(the flip changed no bf16 weight: most likely a low byte of an fp32 value)")
                self.state, self.version = new, version
            if s.kind == "corrupt" and o.fired:
                o.undetected = True
                o.result += ", corruption undetected" + ("" if self.args.checksum else " (checksum off)")
            if o.result.startswith("committed") and not dead:
                return o
        if err0 is not None and not isinstance(err0, RefitError):
            o.notes.append(f"rank 0 raised {type(err0).__name__}: {err0}")
        o.phase = getattr(err0, "phase", None)
        if engine_kill and o.fired:  # both trainer ranks must name the killed worker's rank
            named = [tuple(getattr(err0, "ranks", ()) or ()), tuple(answer[4]) if answer else ()]
            o.named = all(s.rank in r for r in named)
            if not o.named:
                o.notes.append(f"the killed worker is refit rank {s.rank}; the trainer ranks' errors name ranks "
                               f"{named[0]} and {named[1]}")
        # detection: the last trainer rank that did not fault raising
        ends = [t for r, t in ((0, t0 if err0 is not None else None),
                               (1, answer[1] if answer and answer[0] == "error" else None))
                if t is not None and r != s.rank]
        if fired_at is not None and ends:
            o.detection_s = max(ends) - fired_at
        # a session's waits end within two timeouts (a round's, then the decision's); rank 0 also waits for the
        # engine's update call before gating it, which a stalled worker holds until it wakes (at most the grace)
        bound = 2 * self.timeout_s + 10.0
        if s.side == "engine" and s.kind == "stall":
            bound += min(self.stall_s, self.engine.grace_s)
        if ends and max(ends) - start > bound:
            o.late = True
            o.notes.append(f"a trainer rank raised {max(ends) - start:.1f} s after the refit began (bound {bound:g} s)")
        # the engine: version unmoved; gated if bytes may have moved, else whole at the previous state
        if err0 is not None and dead:  # a dead engine serves nothing: generate must raise, at once
            _, gen_err, _ = self.generate()
            if gen_err is None:
                o.torn += 1
                o.notes.append("generate succeeded on an engine whose worker was killed in a refit")
        elif err0 is not None:
            now = self.llm.get_weight_version()
            if now != self.version:
                o.torn += 1
                o.notes.append(f"the engine reports version {now!r} after a failed refit (was {self.version!r})")
            out, gen_err, _ = self.generate()
            if o.phase in NOTHING_MOVED:
                if gen_err is not None or self.digests() != self.refs[self.state]:
                    o.torn += 1
                    o.notes.append(f"failed at {o.phase} but the engine does not serve the previous weights: "
                                   f"{gen_err!r}")
            elif gen_err is None:
                o.torn += 1
                o.notes.append(f"generate succeeded on weights a refit failed into ({o.phase})")
            elif not isinstance(gen_err, WeightsPoisonedError):
                o.notes.append(f"generate raised {type(gen_err).__name__}: {gen_err}")
        # recovery: a new engine if it died, a fresh trainer rank 1 if it died, a reconnect on a fresh port, a refit
        if dead:
            self.replace_engine(o)
            self.state, self.version = 0, None  # the new engine loaded the checkpoint
        if child_dead:
            self.child.close()
            self.child = Child(self.ckpt, self.args.tp, self.timeout_s, self.args.checksum)
            self.move_to(new)
        if self.connect(new_engine=dead) is None:
            o.result = "recovery failed (reconnect)"
            return o
        if dead:
            self.check_checksum()
        ok, t_rec = self.clean_refit(version + "r")
        if not ok:
            o.result = "recovery failed (refit)"
            return o
        self.state, self.version = new, version + "r"
        got = self.digests()
        out, gen_err, _ = self.generate()
        if got != self.refs[new] or self.llm.get_weight_version() != self.version:
            o.silent += 1
            o.result = "recovered, wrong weights"
            o.notes.append(f"committed {self.version} but the engine holds {got}, not {self.refs[new]}")
        elif gen_err is not None:
            o.result = "recovered, not serving"
            o.notes.append(f"generate after recovery: {gen_err!r}")
        else:
            o.result = "recovered" if err0 is not None else "split outcome, recovered"
            if dead:
                o.result += " (new engine)"
        if o.detection_s is not None and ends:
            o.recovery_s = t_rec - max(ends)
        return o

    def close(self) -> None:
        from reshard.integrations.vllm.inspect import close_engine

        if self.child is not None:
            self.child.close()
        if self.engine is not None:
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001 - a broken session: the run ends anyway
                pass
        if self.llm is not None:
            close_engine(self.llm)
            deadline = time.monotonic() + 30
            while any(p.is_running() and p.status() != "zombie" for p in self.llm_procs) and time.monotonic() < deadline:
                time.sleep(0.1)
            for p in self.llm_procs:
                if p.is_running() and p.status() != "zombie":
                    self.leaked += 1
                    p.kill()
        self.pool.shutdown(wait=False, cancel_futures=True)


class Hang(RuntimeError):
    """A bounded wait that ran past its deadline."""


def summary(outcomes: list[Outcome], leaked: int = 0) -> dict:
    import numpy as np

    def pct(xs, q):
        return float(np.percentile(xs, q)) if xs else float("nan")

    det = [o.detection_s for o in outcomes if o.detection_s is not None]
    rec = [o.recovery_s for o in outcomes if o.recovery_s is not None and not o.engine_restart]
    kills = [o for o in outcomes if o.scenario.side == "engine" and o.scenario.kind == "kill"]
    kill_det = [o.detection_s for o in kills if o.detection_s is not None]
    kill_rec = [o.recovery_s for o in kills if o.recovery_s is not None and o.engine_restart]
    out = {"scenarios": len(outcomes), "faults fired": sum(o.fired for o in outcomes),
           "hangs": sum(o.hang is not None for o in outcomes),
           "silent corruptions": sum(o.silent for o in outcomes),
           "torn models served or committed": sum(o.torn for o in outcomes),
           "RefitError later than the bound": sum(o.late for o in outcomes),
           "corrupt faults fired / undetected (refit committed)": (
               f"{sum(o.fired for o in outcomes if o.scenario.kind == 'corrupt')} / "
               f"{sum(o.undetected for o in outcomes)}"),
           "detection p50 s": pct(det, 50), "detection p95 s": pct(det, 95),
           "recovery p50 s (no engine restart)": pct(rec, 50), "recovery p95 s (no engine restart)": pct(rec, 95),
           "engine kills (a worker SIGKILLed in a refit)": len(kills),
           "engine kills: engine died, replaced, recovered": sum(
               o.engine_restart and o.result.startswith("recovered") for o in kills),
           "engine kills: RefitError named the killed rank": sum(bool(o.named) for o in kills),
           f"engine kills: detection p50/p95 s ({len(kill_det)})": (pct(kill_det, 50), pct(kill_det, 95)),
           f"engine kills: recovery p50/p95 s, new engine's start included ({len(kill_rec)})":
               (pct(kill_rec, 50), pct(kill_rec, 95)),
           "engine processes leaked after shutdown": leaked}
    for kind in ("kill", "stall", "raise", "corrupt"):
        d = [o.detection_s for o in outcomes if o.detection_s is not None and o.scenario.kind == kind]
        out[f"detection p50/p95 s, {kind} ({len(d)})"] = (pct(d, 50), pct(d, 95))
    for side in SIDES:
        out[f"scenarios at {side}"] = sum(o.scenario.side == side for o in outcomes)
    out["recovered"] = sum(o.result.startswith("recovered") and not o.notes for o in outcomes)
    results: dict[str, int] = {}
    for o in outcomes:
        key = "hang" if o.hang else o.result
        results[key] = results.get(key, 0) + 1
    out["outcomes"] = dict(sorted(results.items(), key=lambda kv: -kv[1]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=2, help="the engine's tensor parallel size")
    ap.add_argument("--timeout", type=float, default=5.0, help="the refit sessions' timeout, seconds")
    ap.add_argument("--stall", type=float, help="how long a stall fault sleeps, seconds (default 3 x --timeout)")
    ap.add_argument("--no-checksum", dest="checksum", action="store_false",
                    help="leave the per-message checksum off (a corrupt fault then goes undetected)")
    ap.add_argument("--faults", default=",".join(KINDS),
                    help="the fault kinds to draw from, comma-separated (default: all of kill,stall,raise,corrupt)")
    ap.add_argument("--engine-kills", type=int,
                    help="how many scenarios kill an engine worker (each restarts the engine, ~30 s); default 10%% "
                         "of --scenarios, at least 3 (none when --faults leaves out kill)")
    ap.add_argument("--json", help="write every scenario's outcome here")
    args = ap.parse_args(argv)
    if args.scenarios < 1 or not 0 < args.timeout <= 300 or args.tp < 1:
        ap.error("--scenarios and --tp must be >= 1, --timeout in (0, 300]")
    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--faults: a comma-separated subset of {','.join(KINDS)}")
    if args.engine_kills is None:
        args.engine_kills = max(3, round(0.1 * args.scenarios)) if "kill" in kinds else 0
    if not 0 <= args.engine_kills <= args.scenarios or (args.engine_kills and "kill" not in kinds):
        ap.error("--engine-kills: between 0 and --scenarios, and only with kill in --faults")
    _environment()
    from rich.console import Console

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_faults import print_figures

    console = Console()
    rng = random.Random(args.seed)
    engine_kills = set(rng.sample(range(args.scenarios), args.engine_kills))  # which scenarios kill an engine worker
    outcomes: list[Outcome] = []
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_faults_vllm") as workdir:
        suite = Suite(args, workdir)
        try:
            rounds, send_rounds = suite.setup()
            console.print(f"engine TP={args.tp} up, references taken, {rounds} transfer rounds per refit; "
                          f"(trainer ranks send in rounds {send_rounds}); setup {time.time() - start:.0f} s")
            for i in range(args.scenarios):
                s = random_scenario(i, rng, args.tp, rounds, send_rounds, kinds, engine_kill=i in engine_kills)
                t = time.time()
                try:
                    o = suite.run(s, rng)
                except Hang as e:
                    o = Outcome(s, hang=str(e), result="hang")
                except Exception:  # noqa: BLE001 - the harness cannot go on (a new engine did not start, ...)
                    import traceback

                    o = Outcome(s, result="harness error", notes=[traceback.format_exc()])
                    if suite.llm is not None and suite.engine_dead():
                        o.result = "harness error: the engine died, no engine kill armed"
                outcomes.append(o)
                bad = o.hang or o.silent or o.torn or o.late or o.notes or not o.result.startswith(
                    ("recovered", "committed"))
                console.print(f"{'[red]' if bad else ''}{s.describe()}: {o.result}"
                              f"{f' at {o.phase}' if o.phase else ''}, {time.time() - t:.1f} s"
                              + "".join(f"\n    {n}" for n in o.notes) + (f"\n    hang: {o.hang}" if o.hang else ""),
                              highlight=False)
                if o.hang or o.result.startswith("harness error"):
                    console.print("[red]stopping: the engine's state is unknown")
                    break
        finally:
            closing = threading.Thread(target=suite.close, daemon=True)
            closing.start()
            closing.join(120)
    figures = summary(outcomes, suite.leaked)
    print_figures(console, figures, f"fault injection, vLLM backend (TP={args.tp}, 2 trainer ranks): "
                                    f"{len(outcomes)} scenarios, timeout {args.timeout:g} s, stall {suite.stall_s:g} s, "
                                    f"checksum {'on' if args.checksum else 'off'}, {time.time() - start:.0f} s wall "
                                    f"(measured)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": figures, "scenarios": [
                {**asdict(o), "scenario": o.scenario.describe()} for o in outcomes]}, f, indent=1)
    bad = figures["hangs"] + figures["silent corruptions"] + figures["torn models served or committed"]
    code = 1 if bad or len(outcomes) < args.scenarios else 0
    if figures["hangs"]:  # a thread is still stuck in the call that hung: do not wait for it at exit
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
