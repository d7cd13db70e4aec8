"""The fault-injection suite: randomized refits over real processes, one fault each, counted.

Run from the repository root (about 3 s a scenario on a 2-core machine)::

    python benchmarks/bench_faults.py [--scenarios 200] [--seed 0] [--timeout 2] [--precision fp8]
                                      [--overlap mixed|none|staged|trainer|both]
                                      [--method reshard|hybrid|gather-broadcast|mixed] [--json out.json]

Each scenario is a refit between random small layouts over a standalone gloo group, with a
``kill``, ``stall``, ``raise`` or ``corrupt`` fault at a random rank and point (connect,
agreement, a round, commit, or the recovery after another failure; with ``--precision fp8`` the
engines are FP8 and the quantization steps are fault points too); see
:mod:`reshard.apps.fault_suite` (its scenarios, outcomes and figures are the model both fault
suites share: :mod:`reshard.apps.fault_scenarios`). It prints the counts an on-call engineer
asks about first: hangs, silent corruptions, torn models served or reported as committed (all three should be 0),
time to detection and to recovery (measured, wall clock; a stall is detected by the timeout,
so its detection time is about ``--timeout``), and what each scenario came to.

Each scenario also plays in a family (``--overlap``; default ``mixed``: each scenario's family
drawn apart from the rest of its draw, so the faults and layouts are those of ``--overlap none``
with the same seed): ``none`` (blocking refits, in place), ``staged`` (destinations receive into
staging on a thread while they serve), ``trainer`` (sources refit with ``wait=False`` and take an
optimizer step meanwhile), ``both``. The suite then also counts the destinations that *kept
serving the previous version* after a failed refit against those that should have (every staged
destination, and every in-place one its session left ready), per family; the targets are 0
hangs, 0 silent corruptions, 0 torn models and every destination that should have kept serving
its version doing so (the exit status is 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from rich.console import Console
from rich.progress import Progress

from reshard.apps.fault_scenarios import OVERLAPS, family_figures, missed, print_families, print_figures
from reshard.apps.fault_suite import SCENARIO_METHODS, Driver, random_scenario, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=2.0, help="the refit timeout of every scenario, seconds")
    ap.add_argument("--precision", choices=["keep", "fp8"], default="keep",
                    help="fp8: refit into block-FP8 engines (a dtype policy), faults while quantizing too")
    ap.add_argument("--overlap", choices=["mixed", "none", "staged", "trainer", "both"], default="mixed",
                    help="how each refit overlaps other work (module doc); mixed: each scenario drawn one of the four")
    ap.add_argument("--method", choices=[*SCENARIO_METHODS, "mixed"], default="reshard",
                    help="the refit method of every scenario (mixed: each scenario's drawn apart from the rest)")
    ap.add_argument("--json", help="write every scenario's outcome here")
    args = ap.parse_args(argv)
    if args.scenarios < 1 or not 0 < args.timeout <= 600:
        ap.error("--scenarios must be >= 1 and --timeout in (0, 600]")
    console = Console()
    rng = random.Random(args.seed)
    families = random.Random(f"families {args.seed}")  # apart from rng: the scenarios are those of --overlap none
    methods = random.Random(f"methods {args.seed}")  # apart from both: the same scenarios under every --method
    driver = Driver(workers=5)
    outcomes = []
    start = time.time()
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("scenarios", total=args.scenarios)
            for i in range(args.scenarios):
                method = methods.choice(SCENARIO_METHODS) if args.method == "mixed" else args.method
                s = random_scenario(i, rng, args.timeout, precision=args.precision == "fp8", method=method)
                overlap = families.choice(OVERLAPS) if args.overlap == "mixed" else \
                    "" if args.overlap == "none" else args.overlap
                s = s.in_family(overlap)
                o = driver.run(s)
                outcomes.append(o)
                if (o.hung or o.silent or o.torn or missed(o) or o.notes
                        or o.result in ("recovery failed", "split outcome", "harness error")):
                    console.print(f"[red]{s.describe()}: {o.result}, hung {o.hung}, silent {o.silent}, torn {o.torn}, "
                                  f"kept {o.kept}/{o.kept_due}" + "".join(f"\n    {n}" for n in o.notes))
                progress.advance(task)
    finally:
        driver.close()
    figures = summary(outcomes)
    engines = " into FP8 engines" if args.precision == "fp8" else ""
    print_figures(console, figures, f"fault injection{engines}: {len(outcomes)} scenarios, timeout {args.timeout:g} s, "
                                    f"{time.time() - start:.0f} s wall (measured)")
    print_families(console, family_figures(outcomes), "per family (measured)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": figures, "scenarios": [o.record() for o in outcomes]}, f, indent=1)
    bad = figures["hangs"] + figures["silent corruptions"] + figures["torn models served or committed"]
    return 1 if bad or any(missed(o) for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
