"""The fault suite against a live vLLM engine: a driver of :mod:`reshard.apps.fault_scenarios`.

One offline ``vllm.LLM`` (TP=``tp``, on the ``reshard`` backend) serves the run (a new one replaces
it when an engine kill took it down); two trainer ranks refit it: refit rank 0 is this process (it
holds the ``LLM``), refit rank 1 a child (:class:`~reshard.apps.fault_vllm_ranks.TrainerChild`,
replaced when a fault kills it); the engine's workers are refit ranks 2.. . The trainer's weights
take one of a few fixed states; each state's reference digest of the engine (every tensor the
workers compute with) is taken once, at the start, after a refit through the independent path
(``gloo_broadcast``: full tensors through vLLM's ``load_weights``); state 0 is the checkpoint the
engine loaded, which checks that path too.

Each scenario moves the trainer to another state and refits to a new version with one fault at a
random side and point (:func:`random_scenario`): trainer rank 0 (``raise``, ``stall``, ``corrupt``),
trainer rank 1 (``kill`` too), one engine worker (``raise``, ``stall``: workers only receive), or an
engine kill (``kill`` in a worker: vLLM then takes the whole engine down; a new one starts). The
fault sits at ``agreement``, ``transfer round j`` or ``commit``. Then it checks: the trainer's ranks
raised ``RefitError`` within ``2 x timeout + 10 s`` (plus the stall, up to the trainer's grace, when
an engine worker stalls); every wait is bounded, and one past its deadline is a hang (the run stops:
the state is unknown); the engine's weight version did not move; a refit that failed after bytes
may have moved leaves the engine gated (``generate`` raises ``WeightsPoisonedError``; one that
succeeds is a torn model served); one that failed before (connect, agreement) leaves it serving
the previous state exactly; then both trainer ranks reconnect (fresh port) and refit again, and
the engine must hold exactly the reference of the trainer's state. A refit reported committed whose
engine digest differs from the reference is a silent corruption. An engine kill: its front end
must know it is dead within 60 s, both trainer ranks' errors must name the killed worker's rank,
``generate`` must raise; the dead engine's processes must all be gone 30 s after its shutdown (a
survivor is killed and counted as leaked); a new engine from the checkpoint is reconnected and
refitted to the reference.

Each scenario also plays in a family (:attr:`~reshard.apps.fault_scenarios.Scenario.overlap`). With
``staged`` the sessions connect with ``receive="staged"`` (every rank reconnects when the family
changes): the workers receive on a thread while the engine serves, and before trainer rank 0 sends
(its session's ``refit``, wrapped for the attempt) the harness checks that every worker's receive
of the new version has started and that the engine's greedy tokens and digests are still those of
the state it holds (otherwise a torn model served); not in an engine-kill scenario, whose engine
vLLM is shutting down by then (the check's calls would wait on it and hold rank 0's refit back), and
the check's own time is left out of rank 0's detection time and bound. With ``trainer`` both
trainer ranks call ``send_weights(v, wait=False)``, run a forward, a backward and an SGD step of their model while it
is in flight (the step must wait for the refit: a handle guarding none of the parameters is a broken
guard, and a step let through would leave the engine with other weights than the reference, a
silent corruption), then ``wait()``,
which must give the error a blocking refit gives; the harness then puts the trainer back at the
state the refit carried. ``both``: the two together. After a failed refit, an engine that had not
started putting bytes in place (a staged one: the apply step comes only after the commit; an
in-place one whose workers all report no byte reached them, ``ready`` at the version they had)
must have *kept serving its previous version*: not gated, vLLM's version unmoved, every worker ``ready`` at the version it had with no
receive left over, its greedy tokens and digests those of its state's reference.

Detection time: fault fired -> the last trainer rank that did not fault raising ``RefitError``.
Recovery time: detection -> the refit after the reconnect committed (an engine kill's, with the new
engine's start, counted apart). Imports vLLM only when a suite starts.
"""


from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

from ..execution import faults
from ..refit import RefitError
from .fault_scenarios import KINDS, Outcome, Scenario, missed, percentile, summary
from .fault_vllm_ranks import BUCKET_BYTES, STATES, worker_arm
from .fault_vllm_rig import EngineRig, Hang

SIDES = {"trainer 0": ("raise", "stall", "corrupt"), "trainer 1": ("kill", "stall", "raise", "corrupt"),
         "engine": ("raise", "stall")}


def side_of(s: Scenario) -> str:
    """The faulty rank's role: ``trainer 0``, ``trainer 1`` or ``engine``."""
    return f"trainer {s.fault_rank}" if s.fault_rank < s.sources else "engine"


def is_engine_kill(s: Scenario) -> bool:
    return side_of(s) == "engine" and s.kind == "kill"


def random_scenario(index: int, rng: random.Random, workers: int, rounds: int, send_rounds: dict[int, list[int]],
                    kinds: tuple[str, ...] = KINDS, engine_kill: bool = False, checksum: bool = True,
                    timeout_s: float = 5.0, overlap: str = "") -> Scenario:
    """A random fault in a refit from the 2 trainer ranks to ``workers`` engine workers of ``rounds`` rounds;
    ``send_rounds``: the rounds in which each trainer rank sends (a ``corrupt`` fault needs a send);
    ``kinds``: the fault kinds to draw from; ``engine_kill``: this scenario kills an engine worker;
    ``overlap``: its family (:attr:`~reshard.apps.fault_scenarios.Scenario.overlap`)."""
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
    return Scenario(index, 0, 2, workers, f"{kind}@{point}", rank, checksum=checksum, timeout_s=timeout_s,
                    bucket_bytes=BUCKET_BYTES).in_family(overlap)


@dataclass
class Attempt:
    """One refit with a fault armed, as the trainer ranks saw it."""

    version: str
    state: int  # the trainer's weight state it carried
    start: float
    error0: Exception | None  # trainer rank 0's (None: it committed)
    end0: float
    answer: tuple | None  # trainer rank 1's (None: it died)
    fired_at: float | None
    engine_dead: bool
    before: list[dict]  # every worker's transfer_state before the refit


class EngineDriver:
    """Plays scenarios on an :class:`~reshard.apps.fault_vllm_rig.EngineRig` and judges each (see module doc)."""

    def __init__(self, rig: EngineRig) -> None:
        self.rig = rig

    def run(self, s: Scenario, rng: random.Random) -> Outcome:
        """One scenario; raises :class:`~reshard.apps.fault_vllm_rig.Hang` when a wait ran past its bound."""
        o = Outcome(s)
        attempt = self._attempt(s, rng, o)
        if self._judge_commit(s, attempt, o):
            return o
        ends = self._judge_failure(s, attempt, o)
        self._check_engine(attempt, o)
        return self._recover(attempt, o, ends)

    def run_guarded(self, s: Scenario, rng: random.Random) -> Outcome:
        """:meth:`run`, with a hang or a harness failure as the outcome."""
        try:
            return self.run(s, rng)
        except Hang as e:
            return Outcome(s, hung=list(e.ranks), result="hang", notes=[f"hang: {e}", *self._after_hang()])
        except Exception:  # noqa: BLE001 - the harness cannot go on (a new engine did not start, ...)
            import traceback

            o = Outcome(s, result="harness error", notes=[traceback.format_exc()])
            if self.rig.llm is not None and self.rig.engine_dead():
                o.result = "harness error: the engine died, no engine kill armed"
            return o

    def _after_hang(self) -> list[str]:
        """What can still be read after a hang, for the report: the workers' states (a short wait: their
        main threads may be the ones stuck), whether the trainer gated the engine, its version."""
        from ..integrations.vllm.clients import as_client

        rig, out = self.rig, []
        try:
            out.append(f"workers: {rig.transfer_states(seconds=10)}")
        except Exception as e:  # noqa: BLE001 - reported as it is
            out.append(f"workers' states unreadable: {type(e).__name__}: {e}")
        try:
            out.append(f"gated: {as_client(rig.llm).gated!r}; engine dead: {rig.engine_dead()}; "
                       f"version {rig.llm.get_weight_version()!r}")
        except Exception as e:  # noqa: BLE001
            out.append(f"engine unreadable: {type(e).__name__}: {e}")
        return out

    def _arm(self, s: Scenario, fire_file: str, fired: list[float]) -> None:
        rig, side = self.rig, side_of(s)
        if side == "engine":
            rig.rpc(worker_arm, s.fault_rank, s.fault, rig.stall_s, fire_file)
        elif side == "trainer 0":
            os.environ["RESHARD_FAULT_STALL_S"] = str(rig.stall_s)
            faults.arm(s.fault, on_fire=lambda point: fired.append(time.monotonic()))

    def _attempt(self, s: Scenario, rng: random.Random, o: Outcome) -> Attempt:
        """The trainer to another state, a refit to a new version with the fault armed, the fault disarmed."""
        rig, side = self.rig, side_of(s)
        receive = "staged" if s.staged else "in-place"
        if rig.receive != receive:  # the family's sessions: every rank reconnects with the other receive
            rig.receive = receive
            if rig.connect() is None:
                raise RuntimeError(f"reconnecting with receive={receive!r} failed")
        state = rng.choice([x for x in STATES if x != rig.state])
        rig.move_to(state)
        version = f"v{s.index + 1}"
        fire_file = os.path.join(rig.workdir, f"fired-{s.index}")
        main_fired: list[float] = []
        before = rig.transfer_states()
        self._arm(s, fire_file, main_fired)
        rig.child.send("refit", version, s.fault if side == "trainer 1" else None, rig.stall_s, s.in_flight)
        start = time.monotonic()
        # rank 0 may also wait for the engine's calls: the grace for its update call, twice that to gate it
        limit = 3 * rig.timeout_s + rig.stall_s + 3 * rig.engine.grace_s + 30
        session = rig.engine.session
        if s.staged and not is_engine_kill(s):  # a worker killed at its fault point takes its engine down: a
            # check's calls would then wait on vLLM's shutdown (seconds) and hold rank 0's refit back behind them
            session.refit = self._serving_check(s, o, session.refit, version)
        try:
            if s.in_flight:
                guard0, error0, end0 = rig.bounded(limit, (0,), rig.send_in_flight, version)
                guard0 = guard0 or getattr(error0, "guard", {})
            else:
                guard0, error0, end0 = {}, *rig.bounded(limit, (0,), rig.engine.send_weights,
                                                        weight_version=version)[1:]
        finally:
            faults.arm(None)
            session.__dict__.pop("refit", None)
        answer = rig.child.wait(limit)
        if answer is None and rig.child.proc.is_alive():
            raise Hang("trainer rank 1 did not answer its refit", (1,))
        if s.in_flight:  # the steps changed the weights: back to the state the refit carried, on every live rank
            for guard in (guard0, answer[5] if answer else {}):
                o.guard_waits += guard.get("guard_waits", 0)
                o.guard_broken += guard.get("guard_broken", 0)
            if o.guard_broken:
                o.notes.append("a refit in flight guarded none of the trainer's parameters")
            rig.move_to(state, child=answer is not None)
        fired_at = main_fired[0] if main_fired else answer[2] if answer else None
        if side == "engine" and os.path.exists(fire_file):
            with open(fire_file) as f:
                fired_at = float(f.read())
        dead = False
        if is_engine_kill(s) and fired_at is not None:
            # the killed worker's engine must die as a whole (vLLM's executor watches its workers), and its
            # front end must know it, within a bound
            deadline = time.monotonic() + 60
            while not (dead := rig.engine_dead()) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not dead:
                raise Hang("an engine worker was killed, but the engine is not dead 60 s later", (s.fault_rank,))
            o.engine_restart = True
        if side == "engine" and not dead:
            rig.rpc(worker_arm, -1, None, rig.stall_s, None)  # disarm: a fault that did not fire must not linger
        o.fired = fired_at is not None or (s.kind == "kill" and answer is None)
        if answer is None and fired_at is None:
            fired_at = start  # killed before it could say: count from the refit's start (an upper bound)
        return Attempt(version, state, start, error0, end0, answer, fired_at, dead, before)

    def _serving_check(self, s: Scenario, o: Outcome, refit, version: str):
        """Trainer rank 0's session refit, preceded by a check that the engine serves its version while
        its workers receive: every worker's receive of ``version`` started (on its thread), and the
        engine's greedy tokens and digests equal the reference's of the state it holds. A mismatch
        is a torn model served."""
        rig = self.rig

        def checked(*args, **kwargs):
            began = time.monotonic()
            try:
                receiving = [st["receiving"] for st in rig.transfer_states()]
                tokens, digests = rig.greedy(), rig.digests()
            except Exception as e:  # noqa: BLE001 - judged below, and the refit goes on
                o.notes.append(f"serving while receiving: {type(e).__name__}: {e}")
            else:
                if receiving != [version] * rig.tp:
                    o.notes.append(f"the serving check found the workers receiving {receiving}, not {version!r}")
                if tokens != rig.tokens[rig.state] or digests != rig.refs[rig.state]:
                    o.torn += 1
                    o.notes.append(f"while receiving {version}, the engine served other weights than its version's "
                                   f"(tokens {tokens} vs {rig.tokens[rig.state]})")
                else:
                    o.served += 1
            # the harness's time, not the trainer's: left out of its detection and bound (_check_after)
            o.harness_at, o.harness_s = began, time.monotonic() - began
            return refit(*args, **kwargs)

        return checked

    def _judge_commit(self, s: Scenario, a: Attempt, o: Outcome) -> bool:
        """A refit some trainer rank reported committed: checked; True when the scenario ends there."""
        rig = self.rig
        committed0, committed1 = a.error0 is None, a.answer is not None and a.answer[0] == "ok"
        if not (committed0 or committed1):
            return False
        o.result = "committed" if (committed0 and committed1) else "split outcome"
        if not o.fired:
            o.result += " (fault did not fire)"
        if a.engine_dead:
            o.notes.append("a trainer rank reported the refit committed, though an engine worker was killed in it")
        elif committed0:
            got = rig.digests()
            if got != rig.refs[a.state] or rig.llm.get_weight_version() != a.version:
                o.silent += 1
                o.notes.append(f"committed {a.version} but the engine holds {got}, not {rig.refs[a.state]}")
            elif s.kind == "corrupt" and o.fired:
                o.notes.append("a byte was flipped on the wire, yet the engine holds exactly the reference "
                               "(the flip changed no bf16 weight: most likely a low byte of an fp32 value)")
            rig.state, rig.version = a.state, a.version
        if s.kind == "corrupt" and o.fired:
            o.undetected = True
            o.result += ", corruption undetected" + ("" if rig.checksum else " (checksum off)")
        return o.result.startswith("committed") and not a.engine_dead

    def _judge_failure(self, s: Scenario, a: Attempt, o: Outcome) -> list[float]:
        """The trainer ranks' errors: named ranks, detection time, the bound; when the ranks that did not
        fault raised."""
        rig, error0, answer = self.rig, a.error0, a.answer
        if error0 is not None and not isinstance(error0, RefitError):
            o.notes.append(f"rank 0 raised {type(error0).__name__}: {error0}")
        o.phase = getattr(error0, "phase", None)
        o.moved = getattr(error0, "moved", True)
        if is_engine_kill(s) and o.fired:  # both trainer ranks must name the killed worker's rank
            named = [tuple(getattr(error0, "ranks", ()) or ()), tuple(answer[4]) if answer else ()]
            o.named = all(s.fault_rank in r for r in named)
            if not o.named:
                o.notes.append(f"the killed worker is refit rank {s.fault_rank}; the trainer ranks' errors name "
                               f"ranks {named[0]} and {named[1]}")
        raised = [(r, t) for r, t in ((0, a.end0 if error0 is not None else None),
                                      (1, answer[1] if answer and answer[0] == "error" else None))
                  if t is not None and r != s.fault_rank]
        ends = [t for _, t in raised]

        def took(since: float) -> float:  # the last rank's raise after ``since``, rank 0's without the check
            return max(t - since - (self._check_after(o, since) if r == 0 else 0.0) for r, t in raised)

        if a.fired_at is not None and ends:
            o.detection_s = took(a.fired_at)
        # a session's waits end within two timeouts (a round's, then the decision's); rank 0 also waits for the
        # engine's update call before gating it, which a stalled worker holds until it wakes (at most the grace)
        bound = 2 * rig.timeout_s + 10.0
        if side_of(s) == "engine" and s.kind == "stall":
            bound += min(rig.stall_s, rig.engine.grace_s)
        if ends and took(a.start) > bound:
            o.late = True
            o.notes.append(f"a trainer rank raised {took(a.start):.1f} s after the refit began (bound {bound:g} s)")
        return ends

    @staticmethod
    def _check_after(o: Outcome, moment: float) -> float:
        """Seconds of the harness's serving check (staged receives) after ``moment``: trainer rank 0's refit
        starts after it, so that time is the harness's, left out of rank 0's detection and bound."""
        if o.harness_at is None:
            return 0.0
        return max(0.0, o.harness_at + o.harness_s - max(o.harness_at, moment))

    def _check_engine(self, a: Attempt, o: Outcome) -> None:
        """After a failed refit: the engine's version unmoved; gated if bytes may have moved, else whole."""
        from ..integrations.vllm import WeightsPoisonedError

        rig = self.rig
        if a.error0 is None:
            return
        if a.engine_dead:  # a dead engine serves nothing: generate must raise, at once
            if rig.generate()[1] is None:
                o.torn += 1
                o.notes.append("generate succeeded on an engine whose worker was killed in a refit")
            return
        now = rig.llm.get_weight_version()
        if now != rig.version:
            o.torn += 1
            o.notes.append(f"the engine reports version {now!r} after a failed refit (was {rig.version!r})")
        _, gen_err, _ = rig.generate()
        # had not started putting bytes in place, so it should serve its version: a staged engine (the apply step
        # comes only after the commit), or one whose workers all say no byte reached them (ready at their version)
        untouched = [st["state"] == "ready" and st["version"] == was["version"]
                     for st, was in zip(rig.transfer_states(), a.before)]
        if o.scenario.staged or all(untouched):
            o.kept_due += 1
            o.kept += int(self._kept_serving(a, now, gen_err, o))
        if not o.moved:
            if gen_err is not None or rig.digests() != rig.refs[rig.state]:
                o.torn += 1
                o.notes.append(f"failed at {o.phase} but the engine does not serve the previous weights: {gen_err!r}")
        elif gen_err is None:
            o.torn += 1
            o.notes.append(f"generate succeeded on weights a refit failed into ({o.phase})")
        elif not isinstance(gen_err, WeightsPoisonedError):
            o.notes.append(f"generate raised {type(gen_err).__name__}: {gen_err}")

    def _kept_serving(self, a: Attempt, version: str | None, gen_err: Exception | None, o: Outcome) -> bool:
        """Whether the engine, after the failed refit, serves the version it had: vLLM's version unmoved,
        not gated, every worker ready at its version with no receive left, the greedy tokens and the
        digests of that version's reference, bit for bit."""
        rig = self.rig
        problems = []
        if version != rig.version:
            problems.append(f"version {version!r}, was {rig.version!r}")
        if gen_err is not None:
            problems.append(f"generate raised {type(gen_err).__name__}")
        else:
            if rig.greedy() != rig.tokens[rig.state]:
                problems.append("its greedy tokens are not its version's")
            if rig.digests() != rig.refs[rig.state]:
                problems.append("its digests are not its version's")
        now = rig.transfer_states()
        if any(st["state"] != "ready" or st["version"] != was["version"] or st["receiving"] is not None
               for st, was in zip(now, a.before)):
            problems.append(f"workers {[(st['state'], st['version'], st['receiving']) for st in now]}, were "
                            f"{[(st['state'], st['version']) for st in a.before]}")
        if problems:
            o.notes.append("did not keep serving its version: " + "; ".join(problems))
        return not problems

    def _recover(self, a: Attempt, o: Outcome, ends: list[float]) -> Outcome:
        """A new engine if it died, a new trainer rank 1 if it died, a reconnect on a fresh port, a clean refit."""
        rig = self.rig
        if a.engine_dead:
            rig.replace_engine(o)
            rig.state, rig.version = 0, None  # the new engine loaded the checkpoint
        if a.answer is None:
            rig.restart_child(a.state)
        if rig.connect(new_engine=a.engine_dead) is None:
            o.result = "recovery failed (reconnect)"
            return o
        if a.engine_dead:
            rig.check_checksum()
        ok, committed_at = rig.clean_refit(a.version + "r")
        if not ok:
            o.result = "recovery failed (refit)"
            return o
        rig.state, rig.version = a.state, a.version + "r"
        got = rig.digests()
        _, gen_err, _ = rig.generate()
        if got != rig.refs[a.state] or rig.llm.get_weight_version() != rig.version:
            o.silent += 1
            o.result = "recovered, wrong weights"
            o.notes.append(f"committed {rig.version} but the engine holds {got}, not {rig.refs[a.state]}")
        elif gen_err is not None:
            o.result = "recovered, not serving"
            o.notes.append(f"generate after recovery: {gen_err!r}")
        else:
            o.result = "recovered" if a.error0 is not None else "split outcome, recovered"
            if a.engine_dead:
                o.result += " (new engine)"
        if o.detection_s is not None and ends:
            o.recovery_s = committed_at - max(ends)
        return o


def play(driver: EngineDriver, rng: random.Random, scenarios: int, engine_kills: set[int], kinds: tuple[str, ...],
         rounds: int, send_rounds: dict[int, list[int]], overlaps=("",), families: random.Random | None = None):
    """Draw and run ``scenarios`` scenarios (``engine_kills``: the indices that kill an engine worker; each in
    a family drawn from ``overlaps`` by ``families``, a generator apart from ``rng``, so that the faults are
    those of a blocking run of the same seed); yields ``(outcome, seconds)`` each, and stops after a hang or a harness error
    (the engine's state is unknown)."""
    rig = driver.rig
    families = families or random.Random("families")
    for index in range(scenarios):
        overlap = families.choice(overlaps) if len(overlaps) > 1 else overlaps[0]
        s = random_scenario(index, rng, rig.tp, rounds, send_rounds, kinds, engine_kill=index in engine_kills,
                            checksum=rig.checksum, timeout_s=rig.timeout_s, overlap=overlap)
        start = time.monotonic()
        o = driver.run_guarded(s, rng)
        yield o, time.monotonic() - start
        if o.hung or o.result.startswith("harness error"):
            return


def needs_a_look(o: Outcome) -> bool:
    """Anything but a clean commit or recovery (the suite prints it in red)."""
    return bool(o.hung or o.silent or o.torn or o.late or o.notes or missed(o)
                or not o.result.startswith(("recovered", "committed")))


def engine_figures(outcomes: list[Outcome], leaked: int) -> dict:
    """The vLLM suite's own figures (:func:`~reshard.apps.fault_scenarios.summary` takes them as ``extra``)."""
    kills = [o for o in outcomes if is_engine_kill(o.scenario)]
    kill_detection = [o.detection_s for o in kills if o.detection_s is not None]
    kill_recovery = [o.recovery_s for o in kills if o.recovery_s is not None and o.engine_restart]
    out = {"RefitError later than the bound": sum(o.late for o in outcomes),
           "engine kills (a worker SIGKILLed in a refit)": len(kills),
           "engine kills: engine died, replaced, recovered": sum(
               o.engine_restart and o.result.startswith("recovered") for o in kills),
           "engine kills: RefitError named the killed rank": sum(bool(o.named) for o in kills),
           f"engine kills: detection p50/p95 s ({len(kill_detection)})":
               (percentile(kill_detection, 50), percentile(kill_detection, 95)),
           f"engine kills: recovery p50/p95 s, new engine's start included ({len(kill_recovery)})":
               (percentile(kill_recovery, 50), percentile(kill_recovery, 95)),
           "engine processes leaked after shutdown": leaked}
    for side in SIDES:
        out[f"scenarios at {side}"] = sum(side_of(o.scenario) == side for o in outcomes)
    out["recovered"] = sum(o.result.startswith("recovered") and not o.notes for o in outcomes)
    return out


def engine_summary(outcomes: list[Outcome], leaked: int = 0) -> dict:
    """:func:`~reshard.apps.fault_scenarios.summary` with the vLLM suite's own figures."""
    return summary(outcomes, engine_figures(outcomes, leaked))


__all__ = [
    "SIDES",
    "Attempt",
    "EngineDriver",
    "engine_figures",
    "engine_summary",
    "is_engine_kill",
    "needs_a_look",
    "play",
    "random_scenario",
    "side_of",
]
