"""Fault injection over real processes: does every failure reach every rank, and is no torn model served?

Each scenario is a refit between two random small layouts (M source ranks -> N destination ranks,
1-3 tensors, shards and replicas, several rounds; :data:`TENSOR_NAMES`) over a standalone gloo group whose TCP store
the driver hosts, with one fault (:mod:`reshard.execution.faults`) at one rank and one point:
connect, agreement, a round, commit, or the recovery that follows another failure. An FP8
scenario (``precision=True``) refits into FP8 engines under a dtype policy (block FP8 on 4 x 4
blocks, tensor ``t2`` kept): blocks quantized on the senders or, where a source split cuts a
block, on the destinations; its faults may also strike either quantization step, and its bytes
and scales are checked against the reference quantizer. Every rank:

    1. connects with its destination holding version 0 (the session's version: None), refits to version 1
    2. on RefitError: checks that its destination is poisoned or still holds version 0 exactly,
       then recovers (new group without the ranks that did not come back) and refits to version 2
    3. checks every committed destination against the expected values, byte for byte

A scenario's family (:attr:`Scenario.overlap`, the fault_scenarios module doc) says how the refit
overlaps other work. ``staged``: every rank connects with ``receive="staged"``; a destination runs
``session.receive(v)`` on a thread and meanwhile *serves*, reading its live buffers every
``SERVE_EVERY_S`` and checking that they hold its version exactly (a mix is a torn model served),
then checks them once more after the commit and calls ``session.apply()``; after a failed receive
it must be ``ready`` at version 0 with version 0's bytes: it *kept serving the previous version*.
``trainer``: a source's buffers are a :class:`Trainer`'s parameters; it calls
``session.refit(v, wait=False)``, runs a forward, a backward and an SGD step that takes its
parameters to the next version in place (the step must wait for the refit: a handle that guards
none of the parameters is counted as a broken guard, and a step the guard let through would send
the next version's bytes, a silent corruption), then ``wait()``: the refit's
stats or its ``RefitError``, which every rank must raise as a blocking refit would. The recovery
refit then sends what the step made (version 2). ``both``: the two together.

The driver runs the ranks as persistent worker processes (a killed one is replaced; no scenario
starts before every worker says it is ready), bounds each scenario, and judges it into an
:class:`~reshard.apps.fault_scenarios.Outcome` (the model the vLLM suite shares): hangs (a live
rank that never reported), silent corruptions (a committed destination whose bytes are wrong),
torn models reported as committed, time to detection (fault -> the last live rank raising), time
to recover (detection -> the next refit committed). Events carry ``time.monotonic()``: Linux's
``CLOCK_MONOTONIC`` is one clock for every process of the host and, unlike the wall clock, never
steps, so a duration between two ranks' events is a duration.

    python benchmarks/bench_faults.py --scenarios 200
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import time
import traceback
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..execution import faults
from ..execution.control import RefitError
from ..execution.process_group import free_port
from ..layout import Layout
from ..placements import Replicate, Shard
from ..planning.methods import METHODS
from ..planning.precision import KEEP, DtypePolicy, FP8Block, precision_layout
from ..quant import FP8_DTYPE, SCALE_SUFFIX, quantize_blocks
from ..refit.background import RefitHandle
from ..refit.session import RefitSession
from ..refit.sides import Side
from ..refit.states import DestinationState
from ..tensors import TensorSpec, box_slices, buffer_view
from .fault_scenarios import KINDS, Outcome, Scenario, summary

# the methods a scenario can refit by: those needing no option the suite does not give (hierarchical needs domains)
SCENARIO_METHODS = tuple(name for name, method in METHODS.items() if not method.needs)
POINTS = ("connect", "agreement", "round", "commit", "recovery")
FP8_POINTS = POINTS + ("quantize at source", "quantize at destination")
FP8_BLOCK = (4, 4)


def random_scenario(index: int, rng: random.Random, timeout_s: float = 2.0, precision: bool = False,
                    method: str = "reshard") -> Scenario:
    """A random scenario: 1-2 sources, 1-3 destinations, a random fault kind, rank and point (FP8
    engines when ``precision``), refitted by ``method``. A method that takes no checksum (gather-broadcast)
    cannot catch a corrupted byte: its ``corrupt`` faults become ``raise`` faults at the same point, and
    the draws stay those of the other methods."""
    sources, destinations = rng.randint(1, 2), rng.randint(1, 3)
    world = sources + destinations
    kind, point = rng.choice(KINDS), rng.choice(FP8_POINTS if precision else POINTS)
    if kind == "corrupt":
        point = "round"  # a corrupted byte is in a message
    where = f"transfer round {rng.randint(0, 2)}" if point == "round" else point
    fault_rank = rng.randrange(world) if kind != "corrupt" else rng.randrange(sources)
    first = None
    if point == "recovery":
        first = rng.choice([r for r in range(world) if r != fault_rank])
    seed = rng.randrange(1 << 30)
    checksum = kind == "corrupt" or rng.random() < 0.5
    if "checksum" not in METHODS[method].takes:
        kind, checksum = "raise" if kind == "corrupt" else kind, False
    return Scenario(index, seed, sources, destinations, f"{kind}@{where}", fault_rank, checksum=checksum,
                    timeout_s=timeout_s, bucket_bytes=rng.choice([512, 2048, 1 << 20]), first_fault_rank=first,
                    precision=precision, method=method)


# ---------------------------------------------------------------------------- layouts and values
# The scenarios' tensors, in the order drawn: the first is one the hybrid's default rule moves by
# reshard (an FFN projection), the others go by its broadcast part; so a hybrid scenario of one
# tensor is all reshard part, and one of two or three tensors runs both parts, a fault striking
# either. ``t2`` stays unquantized in FP8 scenarios (:func:`fp8_policy`).
TENSOR_NAMES = ("t0.up_proj.weight", "t1", "t2")


def scenario_layouts(s: Scenario) -> tuple[Layout, Layout]:
    """Random small source and destination layouts of 1-3 tensors (float32, :data:`TENSOR_NAMES`)."""
    rng = random.Random(s.seed)
    src_ranks = list(range(s.sources))
    dst_ranks = list(range(s.sources, s.world))
    # every source holds everything: losing one source is survivable (FP8: fewer, so that more blocks are cut)
    replicated = rng.random() < (0.25 if s.precision else 0.5)
    src, dst = [], []
    for i in range(rng.randint(1, 3)):
        # FP8: whole blocks on every destination piece; an odd count of blocks per destination cut
        # by two sources (blocks quantized at the destination)
        shape = (tuple(b * s.destinations * rng.choice([1, 3]) for b in FP8_BLOCK) if s.precision
                 else (rng.randint(4, 40), rng.randint(4, 24)))
        spec = TensorSpec(TENSOR_NAMES[i], shape, torch.float32)
        src.append(Layout.from_placements(spec, src_ranks, (len(src_ranks),),
                                          [Replicate() if replicated else _placement(rng)]))
        dst.append(Layout.from_placements(spec, dst_ranks, (len(dst_ranks),), [_placement(rng)]))
    return Layout.merge(src), Layout.merge(dst)


def _placement(rng: random.Random):
    return rng.choice([Shard(0), Shard(1), Replicate()])


def fp8_policy() -> DtypePolicy:
    """The dtype policy of FP8 scenarios: ``t2`` kept, every other tensor block FP8."""
    return DtypePolicy(rules=((r"^t2$", KEEP),), default=FP8Block(FP8_BLOCK))


def engine_layout(s: Scenario, destination: Layout) -> Layout:
    """The layout destinations hold: ``destination``, or for an FP8 scenario its FP8 weights and scales."""
    return precision_layout(destination, fp8_policy()) if s.precision else destination


def full_value(spec: TensorSpec, version: int) -> torch.Tensor:
    """Version ``version`` of a tensor: distinct, exactly representable values."""
    n = int(np.prod(spec.shape))
    salt = sum(map(ord, spec.name)) % 97
    return (torch.arange(n, dtype=torch.float32) % 509 + 1000 * version + salt).view(spec.shape)


def expected_value(layout: Layout, name: str, version: int) -> torch.Tensor:
    """Version ``version`` of ``layout``'s tensor ``name``: :func:`full_value`, or for an FP8 weight
    ``w`` and its ``w_scale_inv`` the reference quantizer's bytes and scales of ``w``'s values."""
    base = name.removesuffix(SCALE_SUFFIX)
    weight = layout.specs.get(base)
    if weight is not None and weight.dtype == FP8_DTYPE:
        q, scales = quantize_blocks(full_value(TensorSpec(base, weight.shape, torch.float32), version), FP8_BLOCK)
        return q if name == base else scales
    return full_value(layout.specs[name], version)


def rank_buffers(layout: Layout, rank: int, version: int) -> dict[str, torch.Tensor]:
    """``rank``'s buffers of ``layout`` holding ``version``."""
    out = {b: torch.zeros(shape, dtype=dtype) for b, (shape, dtype) in layout.buffers(rank).items()}
    for p in layout.pieces(rank):
        buffer_view(out[p.buffer], p.buffer_offsets, p.sizes).copy_(
            expected_value(layout, p.tensor, version)[box_slices(p.offsets, p.sizes)])
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def holds_version(layout: Layout, rank: int, buffers: dict[str, torch.Tensor], version: int) -> bool:
    """Whether every piece of ``rank`` holds ``version`` exactly (FP8 bytes bit for bit)."""
    return all(torch.equal(_bits(buffer_view(buffers[p.buffer], p.buffer_offsets, p.sizes)),
                           _bits(expected_value(layout, p.tensor, version)[box_slices(p.offsets, p.sizes)]))
               for p in layout.pieces(rank))


# ---------------------------------------------------------------------------- one rank
STEP = 1000.0  # one optimizer step takes a source from version v to v + 1 (full_value: 1000 apart per version)
SERVE_EVERY_S = 0.01  # how often a staged destination reads its live weights while its receive is in flight


class Trainer:
    """A source rank as a trainer holds it: its buffers are parameters, and one forward, backward and
    SGD step (lr 1, every gradient ``-STEP``) takes them exactly to the next version, in place, so that
    a refit reading them after the step would send the next version's bytes."""

    def __init__(self, buffers: dict[str, torch.Tensor]) -> None:
        self.params = {name: torch.nn.Parameter(t) for name, t in buffers.items()}
        self.optimizer = torch.optim.SGD(list(self.params.values()), lr=1.0)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The parameters' storage, as the refit's source side reads it."""
        return {name: p.detach() for name, p in self.params.items()}

    def step(self) -> None:
        """Forward and backward (they read the parameters), then the optimizer step (it changes them)."""
        if not self.params:
            return
        loss = sum((p * -STEP).sum() for p in self.params.values())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def _refit(s: Scenario, session: RefitSession, version: int, out: dict, *, trainer: Trainer | None = None,
           serving: tuple | None = None):
    """One refit of ``session`` to ``version`` in the scenario's family (fault_scenarios module doc):
    a source in flight steps ``trainer`` meanwhile (if given); a staged destination receives on a thread
    while it serves, checking its live weights each ``SERVE_EVERY_S`` against ``serving`` (``(layout,
    rank, buffers, version they hold)``; None: it holds no whole version, nothing to check), then puts
    the version in place. Raises what the refit raises."""
    if s.in_flight and session.source is not None:
        handle = session.refit(version, wait=False)
        if trainer is not None:
            # the guard: the optimizer step waits for the refit reading its parameters. Whether it waited long
            # enough is the destinations' byte check (a step it let through sends the next version's bytes: a
            # silent corruption); handle.done() right after the step is no test, since the guard lets the step
            # through once this rank's sources were sent, before the refit ends
            if not handle.storages:
                out["guard_broken"] += 1
                out["notes"].append(f"rank {session.rank}: the refit to version {version} in flight guards none of "
                                    f"the {len(trainer.params)} parameters it reads")
            trainer.step()
        out["guard_waits"] += handle.guard_waits
        return handle.wait()
    if not (s.staged and session.destination is not None):
        return session.refit(version)
    handle = RefitHandle(lambda: session.receive(version), name=f"fault-suite-receive-{version}")
    while not handle.done():  # serving: the live weights stay one whole version throughout
        if serving is not None:
            if not holds_version(*serving):
                out["torn"] += 1
                out["notes"].append(f"rank {session.rank}: its live weights held a mix while it received version "
                                    f"{version}")
                serving = None
            else:
                out["served"] += 1
        time.sleep(SERVE_EVERY_S)
    stats = handle.wait()  # the receive's error, raised here
    if serving is not None and not holds_version(*serving):
        out["torn"] += 1  # committed, not yet applied: still the previous version
        out["notes"].append(f"rank {session.rank}: version {version} reached its live weights before apply()")
    session.apply()
    return stats


def run_rank(s: Scenario, rank: int, store_addr: str) -> dict:
    """Play ``rank``'s part of scenario ``s``; returns what happened (see module doc)."""
    host, _, port = store_addr.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
    out = {"rank": rank, "events": [], "fault_fired": False, "silent": 0, "torn": 0, "kept": 0, "kept_due": 0,
           "served": 0, "guard_waits": 0, "guard_broken": 0, "notes": []}

    def fired(point: str) -> None:
        store.set(f"fault/{rank}", repr(time.monotonic()))

    fault = s.fault if rank == s.fault_rank else None
    if s.first_fault_rank == rank:
        fault = "raise@transfer round 0"
    faults.arm(fault, on_fire=fired)
    os.environ["RESHARD_FAULT_STALL_S"] = str(6 * s.timeout_s + 10)
    src_layout, dst_layout = scenario_layouts(s)
    held = engine_layout(s, dst_layout)  # what destinations hold: FP8 weights and scales in FP8 scenarios
    timeout = timedelta(seconds=s.timeout_s)
    trainer, source = None, None
    if rank < s.sources:
        src_buffers = rank_buffers(src_layout, rank, 1)
        if s.in_flight:
            trainer = Trainer(src_buffers)
            src_buffers = trainer.tensors()
        source = Side.from_layout(src_layout, rank, src_buffers)
    dst_buffers = rank_buffers(held, rank, 0) if rank >= s.sources else {}
    destination = Side.from_layout(dst_layout, rank, dst_buffers) if dst_buffers else None
    serving = (held, rank, dst_buffers, 0)
    session = None
    try:
        session = RefitSession.connect(source=source, destination=destination, store_addr=store_addr, rank=rank,
                                       world_size=s.world, timeout=timeout, host_store=False, method=s.method,
                                       checksum=s.checksum, max_bucket_bytes=s.bucket_bytes,
                                       member=f"rank{rank}", precision=fp8_policy() if s.precision else None,
                                       receive="staged" if s.staged else "in-place")
        _refit(s, session, 1, out, trainer=trainer, serving=serving)
        out["events"].append(("committed", 1, time.monotonic()))
        _check(out, held, rank, dst_buffers, 1, destination)
        return out
    except RefitError as e:
        out["events"].append(("error", e.phase, list(e.ranks), str(e)[:300], time.monotonic()))
        if destination is not None and session is not None:
            state, previous = session.state, session.version or 0
            whole = state == DestinationState.READY and holds_version(held, rank, dst_buffers, previous)
            if not (state == DestinationState.POISONED or whole):
                out["torn"] += 1
            # a staged destination puts bytes in place only after the commit; an in-place one its session
            # left ready received none: either should still serve the version it had, bit for bit
            if s.staged or state == DestinationState.READY:
                out["kept_due"] += 1
                out["kept"] += int(whole and previous == 0)
                if not (whole and previous == 0):
                    out["notes"].append(f"rank {rank}: {state} at version {session.version!r} after the failed refit, "
                                        f"{'holding' if whole else 'not holding'} version {previous}")
            serving = (held, rank, dst_buffers, previous) if whole else None
    if session is None:
        return out  # nothing to recover: connecting failed
    if s.first_fault_rank is not None and rank == s.fault_rank:
        faults.arm(s.fault, on_fire=fired)  # the recovery fault, now that the first failure happened
    try:
        recovered = session.recover()
        if recovered.source is not None and trainer is None:
            for t in recovered.source.tensors.values():
                t.add_(STEP)  # version 1 -> version 2 (a trainer in flight took its step already)
        _refit(s, recovered, 2, out, serving=serving)
        out["events"].append(("recovered", recovered.group.size, time.monotonic()))
        _check(out, held, rank, dst_buffers, 2, recovered.destination)
        recovered.close()
    except RefitError as e:
        out["events"].append(("recovery failed", e.phase, list(e.ranks), str(e)[:300], time.monotonic()))
    return out


def _check(out: dict, layout: Layout, rank: int, buffers: dict, version: int, destination) -> None:
    if destination is not None and not holds_version(layout, rank, buffers, version):
        out["silent"] += 1


# ---------------------------------------------------------------------------- driver
# Spawning a worker and importing torch and reshard takes ~3-5 s on a 2-core machine, ~10-20 s with
# both cores busy: 120 s is a margin of 6x or more. No scenario starts before every worker is ready,
# so the scenarios' own timeouts (2 s) never include a process start.
READY_TIMEOUT_S = 120.0


class WorkerNotReady(RuntimeError):
    """A fault-suite worker process died or did not become ready within the driver's bound."""


def _worker(slot: int, tasks, results) -> None:
    torch.set_num_threads(1)
    Trainer({"w": torch.zeros(2)}).step()  # the optimizer's lazy imports (seconds), before any scenario's timeout
    results.put({"ready": slot, "pid": os.getpid()})  # imports done (this module's, at unpickling)
    while True:
        task = tasks.get()
        if task is None:
            return
        run_id, s, rank, addr = task
        try:
            report = run_rank(s, rank, addr)
        except Exception:  # noqa: BLE001 - a harness bug: report it, do not hang the driver
            report = {"rank": rank, "events": [("harness error", traceback.format_exc()[-800:])],
                      "fault_fired": False, "silent": 0, "torn": 0, "kept": 0, "kept_due": 0, "served": 0,
                      "guard_waits": 0, "guard_broken": 0, "notes": []}
        results.put({**report, "run": run_id})
        faults.arm(None)


class Driver:
    """Persistent worker processes and a TCP store per scenario (see module doc). Every worker, a
    replacement included, has said it is ready before a scenario starts (``ready_timeout_s`` bounds
    the wait; past it, or if a worker dies first, :class:`WorkerNotReady`)."""

    def __init__(self, workers: int = 5, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        self.ready_timeout_s = ready_timeout_s
        self.runs = 0  # scenarios run: a report names its run, so a late one is never taken for the next's
        self.pool: list[tuple] = [self._start(slot) for slot in range(workers)]
        try:
            self._await_ready(range(workers))
        except BaseException:
            self.close()
            raise

    def _start(self, slot: int):
        tasks = self.ctx.Queue()
        p = self.ctx.Process(target=_worker, args=(slot, tasks, self.results), daemon=True)
        p.start()
        return p, tasks

    def _await_ready(self, slots) -> None:
        """Wait until the workers in ``slots`` said they are ready (messages of earlier runs are dropped)."""
        waiting = set(slots)
        deadline = time.monotonic() + self.ready_timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerNotReady(f"fault-suite workers {sorted(waiting)} not ready within "
                                     f"{self.ready_timeout_s:g} s (spawning a process, importing torch)")
            try:
                message = self.results.get(timeout=min(0.2, left))
            except queue.Empty:
                dead = [slot for slot in sorted(waiting) if not self.pool[slot][0].is_alive()]
                if dead:
                    p = self.pool[dead[0]][0]
                    raise WorkerNotReady(f"fault-suite worker {dead[0]} (pid {p.pid}) exited with code "
                                         f"{p.exitcode} before it was ready") from None
                continue
            slot = message.get("ready")
            if slot in waiting and message["pid"] == self.pool[slot][0].pid:
                waiting.discard(slot)

    def run(self, s: Scenario) -> Outcome:
        self.runs += 1
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30),
                              wait_for_workers=False)
        for rank in range(s.world):
            self.pool[rank][1].put((self.runs, s, rank, f"127.0.0.1:{port}"))
        deadline = time.monotonic() + 12 * s.timeout_s + 30
        reports: dict[int, dict] = {}
        lost = {s.fault_rank} if s.kind in ("kill", "stall") else set()
        while len(reports) < s.world and time.monotonic() < deadline:
            missing = [r for r in range(s.world) if r not in reports]
            if all(r in lost for r in missing) and self._fault_fired(store, s):
                break  # the killed or stalled rank will not report
            try:
                rep = self.results.get(timeout=0.2)
            except queue.Empty:
                continue
            if rep.get("run") == self.runs:
                reports[rep["rank"]] = rep
        outcome = self._judge(s, store, reports, lost)
        replaced = []
        for rank in range(s.world):  # replace what died or is stuck
            p, _ = self.pool[rank]
            if rank not in reports or not p.is_alive():
                p.kill()
                p.join(10)
                self.pool[rank] = self._start(rank)
                replaced.append(rank)
        self._await_ready(replaced)
        return outcome

    @staticmethod
    def _fault_fired(store, s: Scenario) -> bool:
        return store.check([f"fault/{s.fault_rank}"])

    def _judge(self, s: Scenario, store, reports: dict[int, dict], lost: set[int]) -> Outcome:
        fired_ranks = [r for r in range(s.world) if store.check([f"fault/{r}"])]
        fired = s.fault_rank in fired_ranks
        o = Outcome(s, fired, reports=list(reports.values()))
        o.hung = [r for r in range(s.world) if r not in reports and not (r in lost and fired)]
        o.silent = sum(r["silent"] for r in reports.values())
        o.torn = sum(r["torn"] for r in reports.values())
        for key in ("kept", "kept_due", "served", "guard_waits", "guard_broken"):
            setattr(o, key, sum(r[key] for r in reports.values()))
        o.notes = [n for r in reports.values() for n in r["notes"]]
        errors = [e for r in reports.values() for e in r["events"] if e[0] == "error"]
        if fired_ranks and errors:
            t0 = min(float(store.get(f"fault/{r}").decode()) for r in fired_ranks)
            o.detection_s = max(e[-1] for e in errors) - t0
        o.result = _classify(s, reports)
        o.undetected = fired and s.kind == "corrupt" and o.result == "committed"
        if o.result == "recovered":
            rec = [e[-1] for r in reports.values() for e in r["events"] if e[0] == "recovered"]
            o.recovery_s = max(rec) - max(e[-1] for e in errors)
        return o

    def close(self) -> None:
        for p, tasks in self.pool:
            tasks.put(None)
        for p, _ in self.pool:
            p.join(10)
            if p.is_alive():
                p.kill()


UNRECOVERABLE = {"is not fully held by any source": "unrecoverable: a source's only copy was lost",
                 "no rank holds a destination side": "unrecoverable: no destination left",
                 "no rank holds a source side": "unrecoverable: no source left"}


def _classify(s: Scenario, reports: dict[int, dict]) -> str:
    """What a scenario came to: committed, recovered, unrecoverable (and why), or a failure to look at."""
    events = {r: [e[0] for e in rep["events"]] for r, rep in reports.items()}
    if any("harness error" in ev for ev in events.values()):
        return "harness error"
    if all(ev == ["committed"] for ev in events.values()):
        return "committed"
    if any("committed" in ev for ev in events.values()):
        return "split outcome"  # some ranks committed, others raised: the defect the decision prevents
    faulty = {s.fault_rank, s.first_fault_rank}
    others = {r: rep for r, rep in reports.items() if r not in faulty}
    if not others:
        return "every rank faulted"
    if not any("recovered" in events[r] or "recovery failed" in events[r] for r in others):
        return "detected at connect" if all(e[1] == "connect" for rep in reports.values() for e in rep["events"]
                                            if e[0] == "error") else "detected, no recovery"
    if all("recovered" in events[r] for r in others):
        return "recovered"
    texts = [e[3] for rep in others.values() for e in rep["events"] if e[0] == "recovery failed"]
    for needle, label in UNRECOVERABLE.items():
        if texts and all(needle in t for t in texts):
            return label
    return "recovery failed"


__all__ = ["READY_TIMEOUT_S", "SCENARIO_METHODS", "Driver", "Outcome", "Scenario", "WorkerNotReady", "engine_layout",
           "fp8_policy", "holds_version", "random_scenario", "rank_buffers", "run_rank", "scenario_layouts", "summary"]
