"""The fault-injection suite against a live vLLM engine: randomized failed refits, each one checked, counted.

Run from the repository root (needs ``vllm``; on a 2-core machine a stall scenario takes ~15 s, an
engine kill ~30-40 s (a new engine starts), most others under 1 s)::

    python benchmarks/bench_faults_vllm.py [--scenarios 30] [--seed 0] [--tp 2] [--timeout 5] [--stall 15]
                                           [--faults kill,stall,raise,corrupt] [--engine-kills N]
                                           [--no-checksum] [--overlap mixed|none|staged|trainer|both]
                                           [--json out.json]

What a scenario is, and how each one is checked: :mod:`reshard.apps.fault_suite_vllm` (a driver
of the model both fault suites share, :mod:`reshard.apps.fault_scenarios`). An engine kill (``kill``
in one engine worker) takes the whole engine down and a new one starts (~30 s here), so these are
drawn apart: ``--engine-kills`` scenarios (default 10 % of them, at least 3), at random places in
the run. ``--faults`` keeps only the kinds named (``--faults corrupt`` forces corrupt faults).

Checksums: on by default, through the backend's option (``ReshardTrainerInitInfo(checksum=True)``,
carried to the workers' sessions in their init info; the harness checks every session has it):
a ``corrupt`` fault must then fail the refit. ``--no-checksum`` leaves it off; a ``corrupt`` fault
is then undetected (the refit commits), and a silent corruption wherever the flipped byte
changed a weight the engine keeps in bf16.

Families (``--overlap``; default ``mixed``: each scenario's family drawn apart from its faults):
``none`` (blocking refits into an engine that receives in place), ``staged`` (the workers receive
on a thread while the engine serves, ``RefitOptions(receive="staged")``; before trainer rank 0
sends, the harness checks that every worker's receive is in flight and that the engine's greedy
tokens and digests are its version's), ``trainer`` (both trainer ranks ``send_weights(...,
wait=False)`` and take an optimizer step of their model meanwhile, which must wait for the refit,
then ``wait()``), ``both``. Besides hangs, silent corruptions and torn models, the suite counts the
engines that *kept serving the previous version* after a failed refit (not gated, vLLM's version
unmoved, every worker ready at its version, greedy tokens and digests of that version) against
those that should have: a staged engine that had not begun its apply step, or an in-place one
whose workers all say no byte reached them. The exit status is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time

from rich.console import Console

from reshard.apps.fault_scenarios import KINDS, OVERLAPS, family_figures, missed, print_families, print_figures
from reshard.apps.fault_suite_vllm import EngineDriver, engine_summary, needs_a_look, play, random_scenario, side_of
from reshard.apps.fault_vllm_ranks import quiet_vllm_environment
from reshard.apps.fault_vllm_rig import EngineRig

__all__ = ["KINDS", "main", "random_scenario"]  # random_scenario: the vLLM suite's draws, as before


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
    ap.add_argument("--overlap", choices=["mixed", "none", "staged", "trainer", "both"], default="mixed",
                    help="how each refit overlaps the engine's serving and the trainer's step (module doc)")
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
    quiet_vllm_environment()
    console = Console()
    rng = random.Random(args.seed)
    engine_kills = set(rng.sample(range(args.scenarios), args.engine_kills))  # which scenarios kill an engine worker
    outcomes = []
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_faults_vllm") as workdir:
        rig = EngineRig(workdir, tp=args.tp, timeout_s=args.timeout, stall_s=args.stall, checksum=args.checksum)
        try:
            rounds, send_rounds = rig.setup()
            console.print(f"engine TP={args.tp} up, references taken, {rounds} transfer rounds per refit; "
                          f"(trainer ranks send in rounds {send_rounds}); setup {time.time() - start:.0f} s")
            overlaps = OVERLAPS if args.overlap == "mixed" else ("" if args.overlap == "none" else args.overlap,)
            for o, seconds in play(EngineDriver(rig), rng, args.scenarios, engine_kills, kinds, rounds, send_rounds,
                                   overlaps, random.Random(f"families {args.seed}")):
                outcomes.append(o)
                s = o.scenario
                console.print(f"{'[red]' if needs_a_look(o) else ''}{s.describe(side_of(s))}: {o.result}"
                              f"{f' at {o.phase}' if o.phase else ''}, {seconds:.1f} s"
                              + (f", kept serving {o.kept}/{o.kept_due}" if o.kept_due else "")
                              + "".join(f"\n    {n}" for n in o.notes), highlight=False)
                if o.hung or o.result.startswith("harness error"):
                    console.print("[red]stopping: the engine's state is unknown")
        finally:
            closing = threading.Thread(target=rig.close, daemon=True)
            closing.start()
            closing.join(120)
    figures = engine_summary(outcomes, rig.leaked)
    print_figures(console, figures, f"fault injection, vLLM backend (TP={args.tp}, 2 trainer ranks): "
                                    f"{len(outcomes)} scenarios, timeout {args.timeout:g} s, stall {rig.stall_s:g} s, "
                                    f"checksum {'on' if args.checksum else 'off'}, {time.time() - start:.0f} s wall "
                                    f"(measured)")
    print_families(console, family_figures(outcomes), "per family (measured)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": figures, "scenarios": [o.record(side_of(o.scenario)) for o in outcomes]}, f,
                      indent=1)
    bad = figures["hangs"] + figures["silent corruptions"] + figures["torn models served or committed"]
    code = 1 if bad or len(outcomes) < args.scenarios or any(missed(o) for o in outcomes) else 0
    if figures["hangs"]:  # a thread is still stuck in the call that hung: do not wait for it at exit
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
