"""Where the loop's actors run: plain local processes, or Ray actors placed with placement groups.

Both give the same :class:`Cluster`: ``trainers`` (one :class:`~.policy.PolicyTrainer` per rank) and
``engine`` (a :class:`~.rollout.RolloutEngine`), as actor handles with one method::

    handle.call("method", *args, **kwargs)   -> a future: .result(timeout_s)

An actor runs one call at a time, in the order they arrive (a Ray actor's default). Handles can be
passed to other actors (trainer rank 0 gets the engine's, to drive its weight sync). Ray is
imported here only, and only for ``orchestrator="ray"``: reshard itself knows nothing of it.

Cleanup is bounded and complete, on success and on error: every actor's ``close`` (engine: its
EngineCore and workers), then the actor's process; with Ray, the placement groups are removed and
Ray shut down. Every process of a cluster carries its ``run_id`` in its environment (``RESHARD_RL_RUN``;
vLLM's processes inherit it): whatever still runs with it after that is killed, and named in
``Cluster.reaped``.
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Listener
from typing import Any

logger = logging.getLogger(__name__)
LOCAL, RAY = "local", "ray"
RUN_ENV = "RESHARD_RL_RUN"  # every process of a cluster has its run id here
ENGINE_ENV = "RESHARD_RL_ENGINE"  # every process of one engine (its actor, EngineCore, workers) has its id here
ORCHESTRATORS = (LOCAL, RAY)
START_TIMEOUT_S = 300.0  # an actor's process must answer within this (a vLLM engine takes ~20 s here)


class ActorError(RuntimeError):
    """A call raised inside an actor; the message carries its traceback."""


def thread_future(fn: Callable[[], Any]) -> Future:
    """``fn()`` on a daemon thread of its own; its future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


class Result:
    """A call's outcome; ``result(timeout_s)`` waits at most that long (``TimeoutError`` after)."""

    def __init__(self, wait: Callable[[float | None], Any]) -> None:
        self._wait = wait

    def result(self, timeout_s: float | None = None) -> Any:
        return self._wait(timeout_s)


def wait_all(results: list[Result], timeout_s: float) -> list[Any]:
    """Every result, within one deadline."""
    deadline = time.monotonic() + timeout_s
    return [r.result(max(0.0, deadline - time.monotonic())) for r in results]


# ---------------------------------------------------------------------- local actors


def _serve(target: str, args: tuple, kwargs: dict, env: dict[str, str], log: str | None, conn) -> None:
    """A local actor's process: build ``target(*args, **kwargs)``, then answer calls until told to exit.
    With ``log``, its output (and its children's: vLLM's processes) goes to that file."""
    os.environ.update(env)
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    module, _, name = target.partition(":")
    # a Unix socket: over TCP, multiprocessing's small writes meet Nagle and delayed ACKs (40 ms a call)
    listener = Listener(family="AF_UNIX", authkey=kwargs.pop("_authkey"))
    try:
        instance = getattr(importlib.import_module(module), name)(*args, **kwargs)
    except BaseException:  # noqa: BLE001 - reported to the creator
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", listener.address))
    lock, done = threading.Lock(), threading.Event()

    def answer(c) -> None:
        with c:
            try:
                method, call_args, call_kwargs = c.recv()
            except (EOFError, OSError):
                return
            if method == "__exit__":
                done.set()
                c.send(("ok", None))
                return
            with lock:
                try:
                    reply = ("ok", getattr(instance, method)(*call_args, **call_kwargs))
                except BaseException:  # noqa: BLE001 - sent back to the caller
                    reply = ("error", traceback.format_exc())
            try:
                c.send(reply)
            except (OSError, ValueError):
                pass

    def accept() -> None:
        while not done.is_set():
            try:
                c = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(c,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    done.wait()
    listener.close()


class LocalActor:
    """``target`` (``"module:Class"``) built in a spawned process and called over a Unix socket (the
    handle pickles: any process of this machine can call it). One call at a time, like a Ray actor."""

    def __init__(self, address, authkey: bytes, pid: int) -> None:
        self.address, self.authkey, self.pid = address, authkey, pid
        self.process = None  # the creator's handle on the process (not pickled)
        self.engine_id: str | None = None  # an engine's RESHARD_RL_ENGINE id
        self.alive = True  # False once its processes were killed on purpose

    def __getstate__(self) -> dict:
        return {"address": self.address, "authkey": self.authkey, "pid": self.pid, "process": None,
                "engine_id": self.engine_id, "alive": self.alive}

    @classmethod
    def start(cls, target: str, *args, env: dict[str, str] | None = None, log: str | None = None,
              timeout_s: float = START_TIMEOUT_S, **kwargs) -> LocalActor:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        authkey = secrets.token_bytes(16)
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_serve, args=(target, args, {**kwargs, "_authkey": authkey}, env or {}, log, child),
                              name=f"rl-{target.rpartition(':')[2]}")
        process.start()
        child.close()
        if not parent.poll(timeout_s):
            process.kill()
            raise TimeoutError(f"{target} did not start within {timeout_s:g} s")
        try:
            kind, value = parent.recv()
        except EOFError:
            process.join(5)
            raise ActorError(f"{target} died while starting (exit code {process.exitcode})") from None
        if kind == "error":
            process.join(5)
            raise ActorError(f"{target} failed to start:\n{value}")
        actor = cls(value, authkey, process.pid)
        actor.process = process
        return actor

    def call(self, method: str, *args, **kwargs) -> Result:
        def run():
            with Client(self.address, authkey=self.authkey) as c:
                c.send((method, args, kwargs))
                kind, value = c.recv()
            if kind == "error":
                raise ActorError(f"{method} failed in actor {self.pid}:\n{value}")
            return value

        future = thread_future(run)

        def wait(timeout_s):
            try:
                return future.result(timeout_s)
            except FutureTimeout:
                raise TimeoutError(f"{method}: no answer from actor {self.pid} within {timeout_s:g} s") from None

        return Result(wait)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the process to exit; kill it if it does not within ``timeout_s``."""
        try:
            self.call("__exit__").result(timeout_s)
        except Exception as e:  # noqa: BLE001 - killed below
            logger.debug("actor %s did not exit on request (%s): killing it", self.pid, e)
        if self.process is not None:
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)


# ---------------------------------------------------------------------- Ray actors


class RayActor:
    """A Ray actor handle with :class:`LocalActor`'s ``call``."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def call(self, method: str, *args, **kwargs) -> Result:
        import ray

        ref = getattr(self.handle, method).remote(*args, **kwargs)

        def wait(timeout_s):
            try:
                return ray.get(ref, timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"{method}: no answer from the Ray actor within {timeout_s:g} s") from None
            except ray.exceptions.RayTaskError as e:
                raise ActorError(f"{method} failed in a Ray actor:\n{e}") from None

        return Result(wait)


# ---------------------------------------------------------------------- clusters


@dataclass
class Cluster:
    """The loop's actors; ``host``: the trainer rank 0's address (the refit stores bind there);
    ``engines``: every engine started, in order (``engine``: the first). With local actors,
    ``start_engine()`` starts one more (the caller waits; it is closed with the cluster)."""

    trainers: list
    engine: Any
    host: str
    run_id: str = field(default_factory=lambda: secrets.token_hex(8))
    reaped: list[int] = field(default_factory=list)  # processes still running after the cleanup, killed
    engines: list = field(default_factory=list)
    start_engine: Callable[[], Any] | None = None


def run_processes(run_id: str, key: str = RUN_ENV) -> set[int]:
    """The processes of this machine whose environment carries ``key=run_id`` (this one excepted)."""
    marker = f"{key}={run_id}".encode()
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    out.add(int(pid))
        except OSError:
            continue
    out.discard(os.getpid())
    return out


def _reap(cluster: Cluster, grace_s: float = 10.0) -> None:
    """Kill what still runs with the cluster's run id once ``grace_s`` has passed (exiting processes
    get that long), and name it in ``cluster.reaped``."""
    deadline = time.monotonic() + grace_s
    while (left := run_processes(cluster.run_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        cluster.reaped.append(pid)


def kill_engine_processes(engine_id: str) -> list[int]:
    """SIGKILL every process of one engine (its actor, EngineCore and workers: they carry
    ``RESHARD_RL_ENGINE=engine_id``); the pids killed."""
    killed = []
    for pid in run_processes(engine_id, ENGINE_ENV):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            continue
    return killed


def _close_actors(cluster: Cluster, timeout_s: float) -> None:
    """Every actor's ``close`` (trainers first: they close their connections to the engine), all at once."""
    engines = cluster.engines or [cluster.engine]
    for group in (cluster.trainers, engines):
        closing = [(a, a.call("close")) for a in group if a is not None and getattr(a, "alive", True)]
        for actor, result in closing:
            try:
                result.result(timeout_s)
            except Exception as e:  # noqa: BLE001 - the process is stopped, or reaped
                logger.warning("closing an RL actor failed: %s", e)


@contextmanager
def local_cluster(path: str, *, trainers: int, tp: int, lr: float, seed: int, timeout_s: float,
                  log: str | None = None, engines: int = 1) -> Iterator[Cluster]:
    """Trainer ranks and ``engines`` engines as local processes (all start at once); ``log``: a file
    for their output (default: this process's). Each engine's processes carry their own
    ``RESHARD_RL_ENGINE`` id (:func:`kill_engine_processes`)."""
    from ...execution.process_group import free_port

    actors: list[LocalActor] = []
    cluster = Cluster([], None, "127.0.0.1")
    env = {RUN_ENV: cluster.run_id}
    lock, one_at_a_time = threading.Lock(), threading.Lock()
    up = threading.Event()  # the cluster is up: later engines start one at a time (two vLLM starts on
    # the same cores each take longer than both in turn)

    started = [0]  # engines started so far: engine i's workers are bound from core i * tp on

    def start_engine() -> LocalActor:
        engine_id = secrets.token_hex(6)
        with lock:
            first_core, started[0] = started[0] * tp, started[0] + 1
        if up.is_set():
            with one_at_a_time:
                return _start(engine_id, first_core)
        return _start(engine_id, first_core)

    def _start(engine_id: str, first_core: int) -> LocalActor:
        actor = LocalActor.start("reshard.apps.rl.rollout:RolloutEngine", path, tp, seed, first_core=first_core,
                                 env={**env, ENGINE_ENV: engine_id}, log=log)
        actor.engine_id = engine_id
        with lock:
            actors.append(actor)
            cluster.engines.append(actor)
        return actor

    try:
        starting = [thread_future(start_engine) for _ in range(engines)]
        starting += [thread_future(lambda r=r: LocalActor.start("reshard.apps.rl.policy:PolicyTrainer", r, trainers,
                                                                 path, lr, timeout_s, env=env, log=log))
                     for r in range(trainers)]
        failure, ranks = None, []
        for f in starting:
            try:
                actor = f.result(START_TIMEOUT_S + 30)
            except Exception as e:  # noqa: BLE001 - the others are stopped below, then it is raised
                failure = failure or e
                continue
            if actor.engine_id is None:
                ranks.append(actor)
                actors.append(actor)
        if failure is not None:
            raise failure
        cluster.trainers, cluster.engines = ranks, [f.result() for f in starting[:engines]]
        cluster.engine, cluster.start_engine = cluster.engines[0], start_engine
        store = f"127.0.0.1:{free_port()}"
        wait_all([t.call("setup", store) for t in cluster.trainers], timeout_s)
        up.set()
        yield cluster
    finally:
        _close_actors(cluster, 60.0)
        for actor in actors:
            actor.stop()
        _reap(cluster)


@contextmanager
def ray_cluster(path: str, *, trainers: int, tp: int, lr: float, seed: int, timeout_s: float,
                log: str | None = None, engines: int = 1) -> Iterator[Cluster]:
    """Trainer ranks and the engine as Ray actors: one placement group of one bundle per trainer rank
    (packed), one for the engine (its workers' cores). A Ray runtime is started here and shut down
    after (logical CPUs: one per trainer rank and per engine worker; workers at normal priority); the
    actors' output stays in Ray's session logs (``log`` is not used). One engine only (several:
    :func:`local_cluster`)."""
    if engines != 1:
        raise ValueError(f"{engines} engines: the Ray cluster runs one engine; several run as local actors")
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from .policy import PolicyTrainer
    from .rollout import RolloutEngine

    cluster = Cluster([], None, "127.0.0.1")
    started = not ray.is_initialized()
    if started:
        # worker_niceness 0: Ray starts its workers at nice 15 by default, so anything else busy on the
        # machine starves the actors (an engine's start took over 300 s beside two busy cores)
        ray.init(num_cpus=trainers + tp, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 configure_logging=False, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
                 _system_config={"worker_niceness": 0})
    groups, handles = [], []
    try:
        train_pg = placement_group([{"CPU": 1}] * trainers, strategy="PACK", name="rl-trainers")
        engine_pg = placement_group([{"CPU": tp}], strategy="PACK", name="rl-engine")
        groups = [train_pg, engine_pg]
        ray.get([g.ready() for g in groups], timeout=timeout_s)

        def placed(cls, pg, index: int, cpus: float):
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
            return ray.remote(cls).options(num_cpus=cpus, scheduling_strategy=strategy, max_restarts=0,
                                           runtime_env={"env_vars": {RUN_ENV: cluster.run_id}})

        engine = placed(RolloutEngine, engine_pg, 0, tp).remote(path, tp, seed)
        ranks = [placed(PolicyTrainer, train_pg, r, 1).remote(r, trainers, path, lr, timeout_s)
                 for r in range(trainers)]
        handles = [engine, *ranks]
        cluster.trainers, cluster.engine = [RayActor(h) for h in ranks], RayActor(engine)
        cluster.engines = [cluster.engine]
        wait_all([a.call("pid") for a in [cluster.engine, *cluster.trainers]], START_TIMEOUT_S)  # all up
        cluster.host = ray.get(ranks[0].__ray_call__.remote(lambda self: ray.util.get_node_ip_address()),
                               timeout=timeout_s)
        store = f"{cluster.host}:{cluster.trainers[0].call('free_port').result(timeout_s)}"
        wait_all([t.call("setup", store) for t in cluster.trainers], timeout_s)
        yield cluster
    finally:
        _close_actors(cluster, 60.0)
        for h in handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception as e:  # noqa: BLE001 - gone already
                logger.debug("ray.kill: %s", e)
        for g in groups:
            try:
                remove_placement_group(g)
            except Exception as e:  # noqa: BLE001 - Ray shuts down next
                logger.debug("removing a placement group: %s", e)
        if started:
            ray.shutdown()
        _reap(cluster)


def cluster(orchestrator: str, path: str, **options):
    """:func:`local_cluster` or :func:`ray_cluster` by name."""
    if orchestrator == LOCAL:
        return local_cluster(path, **options)
    if orchestrator == RAY:
        return ray_cluster(path, **options)
    raise ValueError(f"unknown orchestrator {orchestrator!r}; choose from {', '.join(ORCHESTRATORS)}")


__all__ = [
    "LOCAL",
    "ORCHESTRATORS",
    "RAY",
    "RUN_ENV",
    "ENGINE_ENV",
    "ActorError",
    "Cluster",
    "LocalActor",
    "RayActor",
    "Result",
    "cluster",
    "kill_engine_processes",
    "local_cluster",
    "ray_cluster",
    "run_processes",
    "thread_future",
    "wait_all",
]
