"""The RL loop over several engines, with faults and membership changes: it keeps training through them.

``RLConfig(engines=N, chaos=SPEC)`` runs this loop in place of the one-engine loop. The trainer
ranks hold one reshard session with every engine of the refit group (:class:`~.fleet.Fleet`); each
step's prompts are split over the engines that serve (:func:`~.fleet.assign`)::

    step k     driver                                    engines
    1          membership: grow starts an engine,        a leaver is closed; new engines come up
               shrink takes one out of the group         in the background
    2          engine faults fire (kill, stall)          one worker SIGKILLed / SIGSTOPped
    3          generate: each serving engine its share,  a dead engine's call fails, a stalled one's
               bounded by gen_timeout_s; the share of    times out: it is fenced (every process of
               an engine that fails goes to the others   it killed) and a replacement starts
    4          every rollout checked: labelled with the
               version its engine committed, that engine
               serving (not joining, gated or dead)
    5          train (GRPO step, FSDP2)
    6          reconnect if the group changed; refit     the refit catches joiners up; a joiner
               (trainer faults fire inside it); a failed serves only once its weights are digest-
               refit is retried on a new session          equal to a serving peer's
               (max_refit_attempts)

With ``asynchronous=True`` the generation of step k+1 (by version k) runs beside the training of
step k (one-step off-policy, staleness bound 1); the refit waits for both, so no batch straddles a
weight change. If every engine is lost mid-batch there, the batch is generated again after the
refit (at version k+1).

Detection and recovery of each fault are logged (:class:`~.fleet.FaultRecord`); every step ends
within :func:`step_bound_s`. At the end every engine in the group must be bit-equal (engine
digests) to the trainer's last committed weights: one engine reloads a checkpoint of them and its
digests must not change, and every other engine's must equal them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from . import chaos
from .fleet import DEAD, JOINING, LEFT, SERVING, STARTING, FaultRecord, Fleet, EngineSlot, assign
from .orchestrate import START_TIMEOUT_S, thread_future, kill_engine_processes
from .policy import RESHARD
from .rollout import VERSION0

logger = logging.getLogger(__name__)
STALL_POINT, RAISE_POINT, CORRUPT_POINT = "stall@agreement", "raise@agreement", "corrupt@transfer round"


class RolloutCheckError(AssertionError):
    """A rollout came from an engine that was not serving the committed version (poisoned, stale,
    mid-swap or joining), or a batch mixed versions beyond the staleness bound."""


class HangError(AssertionError):
    """A step took longer than its stated bound."""


def step_bound_s(cfg) -> float:
    """The longest a step may take: the generation twice (once more after a fault), a replacement
    starting, the training call, and every refit attempt with its reconnect, each at its timeout."""
    refit_attempt = 2 * (cfg.refit_timeout_s + 30.0) + cfg.timeout_s  # reconnect + refit (rank 0's grace: 30 s)
    return (2 * cfg.gen_timeout_s + START_TIMEOUT_S + (cfg.timeout_s + 60) + cfg.max_refit_attempts * refit_attempt
            + 2 * cfg.refit_timeout_s)


@dataclass
class FleetStep:
    """Per step: the engines that generated, the faults and membership changes that happened, the
    step's seconds since the run's start at its end, its reconnect seconds and refit attempts."""

    step: int
    engines: list[str]
    events: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    reconnect_s: float = 0.0
    refit_attempts: int = 1
    staleness: int = 0


class ChaosLoop:
    """One run's steps over a fleet (see module doc). ``rig``: the loop's :class:`~.loop.Rig`."""

    def __init__(self, rig) -> None:
        self.rig, self.cfg = rig, rig.cfg
        self.t0 = time.monotonic()
        spec = chaos.parse(self.cfg.chaos) if self.cfg.chaos else None
        self.stall_s = spec.stall_s if spec else chaos.FOREVER_S
        self.events = spec.events(self.cfg.steps, engines=self.cfg.engines, trainers=self.cfg.trainers) if spec else []
        self.fleet = Fleet()
        pids = [a.call("worker_pids") for a in rig.cluster.engines]
        for actor, workers in zip(rig.cluster.engines, pids):
            slot = self.fleet.add(actor, self.cfg.tp, 0.0, SERVING)
            slot.version, slot.workers = VERSION0, workers.result(self.cfg.timeout_s)
        self.faults: list[FaultRecord] = []
        self.starts: list[tuple[EngineSlot, Future, FaultRecord | None]] = []
        self.lock = threading.RLock()
        self.version = VERSION0
        self.rollouts = 0
        self.reconnect_needed = False
        self.timers: list[threading.Timer] = []
        self.step_events: dict[int, list[str]] = {}
        self.faulted: set[int] = set()  # steps whose engine faults fired
        self.deferred: list[chaos.Event] = []  # shrinks waiting for a second serving engine
        self.leaving: list[tuple[EngineSlot, FaultRecord]] = []
        self.closing: list[Future] = []  # leavers being closed

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------ membership

    def _note(self, step: int, text: str) -> None:
        logger.info("step %d: %s", step, text)
        self.step_events.setdefault(step, []).append(text)

    def _start_engine(self, record: FaultRecord | None) -> EngineSlot:
        slot = self.fleet.add(None, self.cfg.tp, self.now(), STARTING)
        self.starts.append((slot, thread_future(self.rig.cluster.start_engine), record))
        return slot

    def _poll_starts(self, wait_s: float = 0.0) -> None:
        """Engines that came up since the last look join the group (their first refit catches them up);
        with ``wait_s``, wait that long for the first one."""
        deadline = time.monotonic() + wait_s
        for slot, future, record in list(self.starts):
            try:
                actor = future.result(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                continue
            except Exception as error:  # noqa: BLE001 - logged; the run goes on with the others
                self.starts.remove((slot, future, record))
                self.fleet.set(slot, DEAD, self.now(), f"did not start: {error}")
                if record is not None:
                    record.outcome = f"replacement failed to start: {error}"
                continue
            self.starts.remove((slot, future, record))
            slot.actor, slot.record = actor, record
            slot.version = VERSION0
            slot.workers = actor.call("worker_pids").result(self.cfg.timeout_s)
            self._warm_up([actor])
            self.fleet.set(slot, JOINING, self.now())
            self.reconnect_needed = True

    def _warm_up(self, actors: list) -> None:
        """One tiny batch on each new engine (all at once), bounded by the call timeout, so that its first
        real batch (oneDNN's first kernels take seconds here) is not mistaken for a stall."""
        for result in [actor.call("generate", [[1, 2, 3]], 1, 2, 1.0, [0]) for actor in actors]:
            result.result(self.cfg.timeout_s)

    def _fence(self, slot: EngineSlot, error: BaseException, step: int) -> None:
        """An engine that failed a call: every process of it killed, out of the group, a replacement started."""
        with self.lock:
            if slot.state in (DEAD, LEFT):
                return
            killed = kill_engine_processes(slot.actor.engine_id)
            slot.actor.alive = False
            self.fleet.set(slot, DEAD, self.now(), f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            self.reconnect_needed = True
            record = next((f for f in self.faults if f.target == slot.key and f.detected is None), None)
            if record is None:  # not injected by the schedule: still logged, and replaced
                record = FaultRecord("unplanned", step, slot.key, self.now())
                self.faults.append(record)
            record.detected = self.now()
            record.detail = f"{slot.reason}; fenced (killed pids {sorted(killed)})"
            replacement = self._start_engine(record)
            record.outcome = f"replaced by {replacement.key}"
            self._note(step, f"{slot.key} fenced after {record.kind} ({slot.reason[:80]}); "
                             f"{replacement.key} starting")

    def _membership(self, step: int) -> None:
        """The grow and shrink events of ``step`` (and shrinks deferred from earlier steps: an engine
        leaves only while another one serves)."""
        events = self.deferred + [e for e in self.events if e.step == step and e.kind in chaos.MEMBERSHIP]
        self.deferred = []
        for event in events:
            if event.kind == "grow":
                record = FaultRecord("grow", step, "", self.now(), detected=self.now())
                self.faults.append(record)
                slot = self._start_engine(record)
                record.target, record.outcome = slot.key, "joined"
                self._note(step, f"grow: {slot.key} starting")
                continue
            serving = self.fleet.serving()
            if len(serving) < 2:
                if event.step == step:
                    self._note(step, "shrink deferred: it would leave no engine serving")
                self.deferred.append(event)
                continue
            slot = serving[event.target % len(serving)]
            record = FaultRecord("shrink", step, slot.key, self.now(), detected=self.now(), outcome="left",
                                 detail=f"scheduled at step {event.step}" if event.step != step else "")
            self.faults.append(record)
            self.fleet.set(slot, LEFT, self.now(), "shrink")
            self.reconnect_needed = True
            self.leaving.append((slot, record))
            self._note(step, f"shrink: {slot.key} leaves")

    def _close_leavers(self) -> None:
        """Engines that left (out of the group since the last reconnect) are closed in the background:
        their vLLM shutdown takes seconds, and nothing waits for it but the end of the run."""
        for slot, record in self.leaving:
            self.closing.append(thread_future(lambda slot=slot, record=record: self._close(slot, record)))
        self.leaving = []

    def _close(self, slot: EngineSlot, record: FaultRecord) -> None:
        try:
            slot.actor.call("close").result(60.0)
        except Exception as error:  # noqa: BLE001 - its processes are killed next
            logger.warning("closing %s: %s", slot.key, error)
        slot.actor.stop()
        left = kill_engine_processes(slot.actor.engine_id)
        slot.actor.alive = False
        record.detail = (record.detail + "; " if record.detail else "") + (
            f"closed in {self.now() - record.detected:.1f} s; {len(left)} of its processes had to be killed" if left
            else f"closed in {self.now() - record.detected:.1f} s")

    # ------------------------------------------------------------------ engine faults

    def _engine_faults(self, step: int) -> None:
        if step in self.faulted:  # once per step (a batch generated again does not fire them again)
            return
        self.faulted.add(step)
        for event in [e for e in self.events if e.step == step and e.kind in chaos.ENGINE_FAULTS]:
            serving = self.fleet.serving()
            if not serving:
                continue
            slot = serving[event.target % len(serving)]
            record = FaultRecord(event.kind, step, slot.key, self.now())
            self.faults.append(record)
            if event.kind == "kill-engine":
                os.kill(slot.workers[0], signal.SIGKILL)
                record.detail = f"SIGKILL of worker pid {slot.workers[0]}"
            else:
                for pid in slot.workers:
                    os.kill(pid, signal.SIGSTOP)
                record.detail = f"SIGSTOP of worker pids {slot.workers} for {self.stall_s:g} s"
                timer = threading.Timer(self.stall_s, self._unstall, (slot, record))
                timer.daemon = True
                timer.start()
                self.timers.append(timer)
            self._note(step, f"{event.kind} {slot.key}: {record.detail}")

    def _unstall(self, slot: EngineSlot, record: FaultRecord) -> None:
        with self.lock:
            if slot.state == SERVING:  # the stall ended before any timeout saw it
                for pid in slot.workers:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except OSError:
                        pass
                record.recovered, record.outcome = self.now(), "absorbed: the engine went on by itself"

    # ------------------------------------------------------------------ generation

    def generate(self, step: int) -> tuple[list[list[int]], list[list[dict]], list[str]] | None:
        """The batch of ``step``: its prompts (token ids), every prompt's group from a serving engine,
        each rollout checked (module doc, 4), and the engine of each. None if every engine was lost and
        none can take over now (async)."""
        from .loop import step_prompts

        cfg = self.cfg
        prompts, seeds = step_prompts(cfg, step, self.rig.task, self.rig.tokenizer)
        self._engine_faults(step)
        todo, done = list(range(len(prompts))), {}
        while todo:
            serving = self.fleet.serving()
            if not serving:
                return None
            parts = assign(len(todo), [s.key for s in serving])
            calls = []
            for key, (a, b) in parts.items():
                slot, chosen = self.fleet.by_key(key), todo[a:b]
                calls.append((slot, chosen, slot.actor.call(
                    "generate", [prompts[i] for i in chosen], cfg.group, cfg.max_tokens, cfg.temperature,
                    [seeds[i] for i in chosen])))
            deadline = time.monotonic() + cfg.gen_timeout_s
            for slot, chosen, result in calls:
                try:
                    groups = result.result(max(0.0, deadline - time.monotonic()))
                except Exception as error:  # noqa: BLE001 - a dead or stalled engine: fenced, its share redone
                    self._fence(slot, error, step)
                    continue
                for i, group in zip(chosen, groups):
                    self._check(slot, group)
                    done[i] = (group, slot.key)
            todo = [i for i in todo if i not in done]
        self.rollouts += sum(len(group) for group, _ in done.values())
        return prompts, [done[i][0] for i in range(len(prompts))], [done[i][1] for i in range(len(prompts))]

    def _check(self, slot: EngineSlot, group: list[dict]) -> None:
        """Every completion labelled, token for token, with the version its engine committed; the engine serving."""
        from .loop import VersionError, batch_version

        if slot.state != SERVING:
            raise RolloutCheckError(f"rollouts from {slot.key}, which is {slot.state}")
        try:
            batch_version([group], slot.version)
        except VersionError as error:
            raise RolloutCheckError(f"rollouts of {slot.key}: {error}") from None

    # ------------------------------------------------------------------ refit

    def connect(self) -> float:
        from ...options import RefitOptions

        options = RefitOptions(method=RESHARD, timeout=self.cfg.refit_timeout_s, checksum=True)
        group = self.fleet.group()
        return self.rig.trainers.all("connect_fleet", [(s.key, s.actor) for s in group], [s.tp for s in group],
                                     self.rig.cluster.host, options.to_json())[0]

    def _reconnect(self) -> float:
        while not self.fleet.group():  # nothing to refit into: wait for an engine coming up
            if not self.starts:
                raise RuntimeError("every engine is gone and none is starting")
            self._poll_starts(START_TIMEOUT_S + 30)
        group = self.fleet.group()
        seconds = self.rig.trainers.all("reconnect_fleet", [(s.key, s.actor) for s in group], [s.tp for s in group])[0]
        self.reconnect_needed = False
        return seconds

    def _left_group(self) -> None:
        """Shrinks are done once a session without the leaver is up."""
        for f in self.faults:
            if f.kind == "shrink" and f.recovered is None and self.fleet.by_key(f.target).state == LEFT:
                f.recovered = self.now()

    def _arm_trainer_faults(self, step: int) -> list[FaultRecord]:
        armed = []
        for event in [e for e in self.events if e.step == step and e.on_trainer]:
            point = {"trainer-stall": STALL_POINT, "trainer-raise": RAISE_POINT, "corrupt": CORRUPT_POINT}[event.kind]
            # a stalled trainer rank outlives the refit's timeout, then wakes (this loop restarts no trainer)
            stall = min(self.stall_s, 1.5 * self.cfg.refit_timeout_s)
            self.rig.trainers.handles[event.target].call("arm_fault", point, stall).result(self.cfg.timeout_s)
            record = FaultRecord(event.kind, step, f"trainer rank {event.target}", self.now(),
                                 detail=point + (f" ({stall:g} s)" if event.kind == "trainer-stall" else ""))
            self.faults.append(record)
            armed.append(record)
            self._note(step, f"{event.kind} armed on trainer rank {event.target} ({point})")
        return armed

    def refit(self, step: int, record: FleetStep) -> None:
        """The refit after ``step``'s update, retried on a new session until it commits (module doc, 6)."""
        version = str(step + 1)
        self._poll_starts()
        armed = self._arm_trainer_faults(step)
        for attempt in range(1, self.cfg.max_refit_attempts + 1):
            record.refit_attempts = attempt
            if self.reconnect_needed:
                record.reconnect_s += self._reconnect()
                self._left_group()
            try:
                self.rig.trainers.all("refit", RESHARD, version, None)
                break
            except Exception as error:  # noqa: BLE001 - reached every rank; a new session, then again
                failed_at = self.now()
                lines = [line.strip() for line in str(error).splitlines() if line.strip()]
                summary = next((line for line in reversed(lines) if "Error:" in line), lines[-1] if lines else "")
                self._note(step, f"refit to {version} failed (attempt {attempt}): {summary[:160]}")
                for r in armed:
                    if r.detected is None:
                        r.detected, r.detail = failed_at, f"{r.detail}; {summary[:160]}"
                self._probe(step)
                self.reconnect_needed = True
        else:
            raise RuntimeError(f"the refit to version {version} failed {self.cfg.max_refit_attempts} times")
        self._close_leavers()
        for slot in self.fleet.group():
            slot.version = version
        self.version = version
        for r in armed:
            if r.detected is None:
                r.outcome = "absorbed: the refit committed within its timeout"
                r.detected = self.now()
            else:
                r.outcome = f"refit retried on a new session: committed (attempt {record.refit_attempts})"
            r.recovered = self.now()
        self._admit(step)

    def _probe(self, step: int) -> None:
        """After a failed refit: any engine of the group that does not answer is fenced."""
        calls = [(s, s.actor.call("weight_version")) for s in self.fleet.group()]
        for slot, result in calls:
            try:
                result.result(min(30.0, self.cfg.gen_timeout_s))
            except Exception as error:  # noqa: BLE001 - dead or stalled
                self._fence(slot, error, step)

    def _admit(self, step: int) -> None:
        """Joiners caught up by the refit serve once their weights equal a serving peer's (digests)."""
        joiners = self.fleet.where(JOINING)
        if not joiners:
            return
        peers = self.fleet.serving()
        if not peers and len(joiners) > 1:  # no engine served through the refit: the joiners against each other
            peers = joiners[:1]
        reference = peers[0].actor.call("digests").result(self.cfg.timeout_s) if peers else None
        for slot in joiners:
            served = slot.actor.call("weight_version").result(self.cfg.timeout_s)
            digests = slot.actor.call("digests").result(self.cfg.timeout_s)
            if served != self.version or (reference is not None and digests != reference):
                raise RolloutCheckError(f"{slot.key} joined at version {served!r} with weights unlike its peers'")
            self.fleet.set(slot, SERVING, self.now())
            checked = (f"digest-equal to {peers[0].key}" if peers and peers[0] is not slot else
                       "the first of the engines caught up together: version label checked" if peers else
                       "no other engine: version label checked")
            self._note(step, f"{slot.key} caught up to version {self.version} ({checked}); serving")
            if slot.record is not None:  # the fault it replaces an engine for, or its grow
                slot.record.recovered = self.now()

    # ------------------------------------------------------------------ the steps

    def run(self, on_step: Callable) -> list:
        from .loop import StepRecord, scored, shards

        cfg, rig = self.cfg, self.rig
        self._warm_up([slot.actor for slot in self.fleet.serving()])
        self.connect_s = self.connect()
        records, self.fleet_steps = [], []
        bound = step_bound_s(cfg)
        loop_started = last_end = time.perf_counter()
        self._membership(0)
        t = time.perf_counter()
        batch = self._generate_sync(0)
        generation = time.perf_counter() - t  # this step's batch, generated on the driver's thread
        try:
            for step in range(cfg.steps):
                # a step's time runs from the end of the one before to the end of its refit: batch k is
                # generated in it (sync) or beside the training before it (async: the wait for it counts)
                prompts, groups, engines = batch
                version = self._version_of(groups)
                staleness = step - int(version)
                if not 0 <= staleness <= (1 if cfg.asynchronous else 0):
                    raise RolloutCheckError(f"step {step} trains on version {version}: staleness {staleness}")
                fleet_step = FleetStep(step, sorted(set(engines)), staleness=staleness)
                rewards, samples, num_tokens = scored(rig.task, prompts, groups)
                ahead: Future | None = None
                if cfg.asynchronous and step + 1 < cfg.steps:
                    ahead = thread_future(lambda: self.generate(step + 1))
                t = time.perf_counter()
                metrics = rig.trainers.each("train", [(s, num_tokens) for s in shards(samples, cfg.trainers)])
                training = time.perf_counter() - t
                t = time.perf_counter()
                nxt = ahead.result(cfg.gen_timeout_s * 2 + START_TIMEOUT_S) if ahead is not None else None
                generation += time.perf_counter() - t
                t = time.perf_counter()
                self.refit(step, fleet_step)
                refit = time.perf_counter() - t
                if step + 1 < cfg.steps:
                    self._membership(step + 1)
                end = time.perf_counter()
                total, last_end = end - last_end, end
                fleet_step.wall_s = self.now()
                fleet_step.events = self.step_events.pop(step, [])
                rec = StepRecord(step=step, method=RESHARD, version=version, reward=float(rewards.mean()),
                                 generation=generation, training=training, refit=refit,
                                 other=max(0.0, total - generation - training - refit), total=total,
                                 loss=sum(m["loss"] for m in metrics), grad_norm=metrics[0]["grad_norm"],
                                 logprob_gap=sum(m["logprob_gap"] for m in metrics) / len(metrics),
                                 blocked=refit, staleness=staleness, warmup=step == 0)
                if total > bound:
                    raise HangError(f"step {step} took {total:.0f} s, beyond its bound of {bound:.0f} s")
                records.append(rec)
                self.fleet_steps.append(fleet_step)
                on_step(rec)
                t = time.perf_counter()
                if step + 1 < cfg.steps and nxt is None:
                    nxt = self._generate_sync(step + 1)
                batch, generation = nxt, time.perf_counter() - t
            self.drain()
            self.loop_s = time.perf_counter() - loop_started
            self.final = self.final_check()
        finally:
            for timer in self.timers:
                timer.cancel()
            for slot, future, _ in self.starts:  # engines still coming up: closed with the cluster
                future.cancel()
        return records

    def _generate_sync(self, step: int):
        """Generate ``step``'s batch on this thread: if every engine is lost, wait for one to come up
        and be caught up (a refit of the current version: the trainer's weights have not moved)."""
        while (batch := self.generate(step)) is None:
            self._poll_starts(START_TIMEOUT_S + 30)
            self._catch_up(step, "no engine served: caught the new ones up")
        return batch

    def _catch_up(self, step: int, why: str) -> None:
        """A session with the engines now and a refit of the version committed (the trainer's weights
        have not moved since), so that the joiners hold it; then they are admitted."""
        seconds = self._reconnect()
        self.rig.trainers.all("refit", RESHARD, self.version, None)
        for slot in self.fleet.group():
            slot.version = self.version
        self._admit(step)
        self._note(step, f"{why} to version {self.version} (reconnect {seconds:.1f} s)")

    def drain(self) -> None:
        """After the last step: engines still coming up join and are caught up (a refit of the last
        version), and shrinks still deferred take place, so that the final check sees every engine."""
        step = self.cfg.steps
        if self.starts:
            self._poll_starts(START_TIMEOUT_S + 30)  # each start is bounded by START_TIMEOUT_S itself
        if self.fleet.where(JOINING):
            self._catch_up(step, "after the last step: joiners caught up")
        self._membership(step)
        if self.leaving:
            self._reconnect()
            self._left_group()
            self._close_leavers()
        for future in self.closing:
            future.result(120.0)  # each close is bounded (60 s, then its processes killed)
        self.drained = self.step_events.pop(step, [])

    @staticmethod
    def _version_of(groups: list[list[dict]]) -> str:
        seen = {v for group in groups for c in group for v, _, _ in c["versions"]}
        if len(seen) != 1:
            raise RolloutCheckError(f"a batch mixes versions {sorted(seen)}")
        return seen.pop()

    def final_check(self) -> dict[str, Any]:
        """Every engine of the group bit-equal to the trainer's last committed weights (module doc)."""
        import tempfile

        group = self.fleet.group()
        digests = {s.key: s.actor.call("digests").result(self.cfg.timeout_s) for s in group}
        versions = {s.key: s.actor.call("weight_version").result(self.cfg.timeout_s) for s in group}
        with tempfile.TemporaryDirectory(dir=os.path.dirname(self.rig.ckpt)) as directory:
            self.rig.trainers.all("save_weights", directory)
            first = group[0]
            first.actor.call("reload", directory, self.version).result(self.cfg.timeout_s)
            reference = first.actor.call("digests").result(self.cfg.timeout_s)
        unequal = [k for k, d in digests.items() if d != reference]
        wrong = {k: v for k, v in versions.items() if v != self.version}
        if unequal or wrong:
            raise AssertionError(f"at the end, engines {unequal} differ from the trainer's version {self.version} "
                                 f"(reloaded into {first.key}); versions {wrong}")
        return {"version": self.version, "engines": sorted(digests), "bit_equal": True,
                "reference": f"{first.key} reloaded a checkpoint of the trainer's weights"}

    def extras(self) -> dict[str, Any]:
        return {"faults": [f.to_json() for f in self.faults], "fleet": [asdict(s) for s in self.fleet_steps],
                "engines": [{"key": s.key, "state": s.state, "since": s.since, "reason": s.reason}
                            for s in self.fleet.slots],
                "rollouts_checked": self.rollouts, "step_bound_s": step_bound_s(self.cfg),
                "final": getattr(self, "final", None), "connect_s": getattr(self, "connect_s", None),
                "after_last_step": getattr(self, "drained", []), "loop_s": getattr(self, "loop_s", None),
                "deferred": [asdict(e) for e in self.deferred]}


def run(cfg, **options):
    """The loop of :func:`reshard.apps.rl.loop.run` (same options) with this module's steps."""
    from .loop import run as run_loop

    return run_loop(cfg, steps=run_steps, **options)


def run_steps(rig, on_step: Callable) -> list:
    """The chaos loop's steps (``loop.run(..., steps=run_steps)``); its log lands in ``rig.extras``."""
    loop = ChaosLoop(rig)
    try:
        return loop.run(on_step)
    finally:
        rig.extras.update(loop.extras())


__all__ = ["ChaosLoop", "FleetStep", "HangError", "RolloutCheckError", "run", "run_steps", "step_bound_s"]
