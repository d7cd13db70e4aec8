"""Refits under load: many refits in a row, with resident memory, file descriptors and time per refit.

Run from the repository root (``make bench-soak`` does)::

    python benchmarks/bench_soak.py [--refits 100] [--quick] [--layers 1] [--vocab 8192] [--config 2-2:2x1]

One process group (CPU, gloo, as ``reshard demo`` does) of M training and N inference ranks moves
a small Qwen3-0.6B-shaped model (``--layers`` decoder layers, ``--vocab`` rows of embedding and
head) ``--refits`` times in each of three modes, one after another in the same processes:

    session            one RefitSession (its own standalone group over a TCP store), refit N times
    reshard fresh      a ReshardExecutor built over the default group, run once, closed; N times
    g&b fresh          a GatherBroadcastExecutor built (a broadcast subgroup split off the default
                       group), run once, closed; N times
    g&b fresh, standalone   the same over a standalone group (Group.connect): its subgroups are
                       standalone too

After every refit each rank samples its resident memory (``/proc/self/statm``), its open file
descriptors (``/proc/self/fd``) and the refit's wall time (from a barrier to the end of the
refit, executor construction included in the fresh modes). Every destination byte is verified
after the last refit of each mode. The table compares the start of each run with its end; the
first refit is left out of the early window (it pays one-time costs: first touches, lazy
connections).

Each run happens twice, in two jobs (``--malloc``): with glibc's allocator as it comes, and with
its mmap threshold fixed at 1 MiB (``MALLOC_MMAP_THRESHOLD_``). As it comes, glibc raises the
threshold each time a large block is freed, up to 32 MiB; staging and gathered tensors below it
then come from the heap, whose freed space glibc keeps, so RSS used to climb by 73-160 MiB over
100 refits in the fresh modes with no live object behind it. The executors now hand free heap
back after each run (:func:`reshard.execution.heap.return_free_heap`, glibc's ``malloc_trim``),
so both rows show what the processes really hold on to.

Verdict "flat" when all three hold, else "grows" (naming which):
    fds      on every rank, open descriptors at the last refit <= at refit 10
    RSS      on every rank, RSS at the last refit - at refit 10 < 5 % of RSS at refit 10 + 8 MiB
    time     mean time of the last 10 refits <= 1.5 x the mean of refits 2-11 (slowest rank each refit)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import reshard as rs
from reshard import verify
from reshard.apps.bench_support import parse_configs, print_header, spawn_for_json
from reshard.execution.group import Group
from reshard.execution.process_group import free_port
from reshard.frameworks.parallel import model_layouts
from reshard.models import DEMO_MODEL, get_arch
from reshard.refit import RefitSession, Side

MiB = 1 << 20
MODES = ("session", "reshard fresh", "g&b fresh", "g&b fresh, standalone")
WINDOW = 10  # refits per window (early: refits 2-11, late: the last 10)
RSS_SLACK_FRACTION, RSS_SLACK_MIB, TIME_RATIO = 0.05, 8.0, 1.5
MMAP_ENV, MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_", 1 << 20
GLIBC, FIXED = "glibc", "mmap 1 MiB"
ALLOCATORS = [GLIBC, FIXED]


@contextlib.contextmanager
def malloc_env(allocator: str):
    """Spawned ranks get glibc's allocator as is, or with its mmap threshold fixed (see module doc)."""
    old = os.environ.pop(MMAP_ENV, None)
    if allocator == FIXED:
        os.environ[MMAP_ENV] = str(MMAP_THRESHOLD)
    try:
        yield
    finally:
        os.environ.pop(MMAP_ENV, None)
        if old is not None:
            os.environ[MMAP_ENV] = old


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _worker(rank: int, world: int, path: str, config: str, layers: int, vocab: int, refits: int,
            store_addr: str, group_addr: str) -> None:
    (train, infer), = parse_configs(config)
    lay = model_layouts(get_arch(DEMO_MODEL).with_overrides(layers=layers, vocab=vocab), train, infer)
    src = verify.fill_source(lay.source, rank) if rank in lay.source_ranks else {}
    dst = lay.destination.empty_buffers(rank)
    plan = rs.plan(lay.source, lay.destination, max_bucket_bytes=16 * MiB)
    session = RefitSession.connect(
        source=Side.from_layout(lay.source, rank, src) if src else None,
        destination=Side.from_layout(lay.destination, rank, dst) if dst else None,
        store_addr=store_addr, rank=rank, world_size=world, max_bucket_bytes=16 * MiB)

    standalone = Group.connect(group_addr, rank, world)

    def fresh(cls, group=None):
        def refit(i: int) -> None:
            with cls(plan, group) as executor:
                executor.run(src, dst)
        return refit

    runs = {"session": session.refit, "reshard fresh": fresh(rs.ReshardExecutor),
            "g&b fresh": fresh(rs.GatherBroadcastExecutor),
            "g&b fresh, standalone": fresh(rs.GatherBroadcastExecutor, standalone)}
    out = {}
    for mode in MODES:
        refit = runs[mode]
        times, rss, fds = [], [], []
        for i in range(refits):
            if i == refits - 1:
                for t in dst.values():
                    t.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            refit(i)
            times.append(time.perf_counter() - t0)
            rss.append(rss_mib())
            fds.append(open_fds())
        bad = verify.check_destination(lay.destination, rank, dst) if rank in lay.destination_ranks else []
        out[mode] = {"time": times, "rss": rss, "fds": fds, "bad": bad[:5]}
        if mode == "session":
            session.close()
    standalone.close()
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"ranks": everyone}, f)


def summarize(mode: str, ranks: list[dict]) -> dict:
    """One mode's figures over every rank (see module doc for the rule)."""
    per = [r[mode] for r in ranks]
    n = len(per[0]["time"])
    slowest = [max(p["time"][i] for p in per) for i in range(n)]
    early = slowest[1:1 + WINDOW]
    late = slowest[-WINDOW:]
    at = min(WINDOW, n) - 1  # refit 10
    rss_growth = [p["rss"][-1] - p["rss"][at] for p in per]
    rss_ok = all(p["rss"][-1] - p["rss"][at] < RSS_SLACK_FRACTION * p["rss"][at] + RSS_SLACK_MIB for p in per)
    fds_ok = all(p["fds"][-1] <= p["fds"][at] for p in per)
    t_early, t_late = sum(early) / len(early), sum(late) / len(late)
    time_ok = t_late <= TIME_RATIO * t_early
    grows = [what for what, ok in (("fds", fds_ok), ("RSS", rss_ok), ("time", time_ok)) if not ok]
    return {
        "refits": n, "t_early": t_early, "t_late": t_late,
        "rss_at": max(p["rss"][at] for p in per), "rss_end": max(p["rss"][-1] for p in per),
        "rss_growth": max(rss_growth), "fds_at": [p["fds"][at] for p in per], "fds_end": [p["fds"][-1] for p in per],
        "verdict": "flat" if not grows else f"grows ({', '.join(grows)})",
        "bad": [b for p in per for b in p["bad"]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refits", type=int, default=100, help="refits per mode (default %(default)s; at least 21)")
    ap.add_argument("--quick", action="store_true", help="30 refits, vocabulary 2048 (a smoke run)")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers of the demo model (default %(default)s)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary rows (default %(default)s)")
    ap.add_argument("--malloc", choices=ALLOCATORS + ["both"], default="both",
                    help="glibc's allocator as is, with its mmap threshold fixed, or both runs (default %(default)s)")
    ap.add_argument("--config", default="2-2:2x1",
                    help="M-N:TPxDP: FSDP2 over M sources -> N destinations, TP x DP (default %(default)s)")
    args = ap.parse_args(argv)
    if args.quick:
        args.refits, args.vocab = min(args.refits, 30), min(args.vocab, 2048)
    if args.refits < 2 * WINDOW + 1:
        ap.error(f"--refits must be at least {2 * WINDOW + 1} (two windows of {WINDOW} after the first refit)")
    console = Console(width=max(Console().width, 190))
    print_header(console, "benchmarks/bench_soak.py", argv)
    (train, infer), = parse_configs(args.config)
    model = get_arch(DEMO_MODEL).with_overrides(layers=args.layers, vocab=args.vocab)
    world = train.world + infer.world
    start = time.perf_counter()
    rows = {}  # (allocator, mode) -> summary
    for allocator in ALLOCATORS if args.malloc == "both" else [args.malloc]:
        with console.status(f"{allocator}: {world} processes, {len(MODES)} x {args.refits} refits ..."), \
                malloc_env(allocator):
            res = spawn_for_json(_worker, world, args.config, args.layers, args.vocab, args.refits,
                                 f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
        rows.update(((allocator, mode), summarize(mode, res["ranks"])) for mode in MODES)
    bad = [b for s in rows.values() for b in s["bad"]]
    if bad:
        console.print("[bold red]VERIFICATION FAILED[/]")
        for line in bad[:20]:
            console.print(f"  {line}")
        return 1
    t = Table(title=f"{args.refits} refits per mode, measured: Qwen3-0.6B-like, {args.layers} layers, vocab "
                    f"{args.vocab}, {model.num_params / 1e6:.0f} M params, {model.nbytes / MiB:.0f} MiB bf16; "
                    f"{args.config} ({world} ranks, gloo)")
    n = args.refits
    cols = ["malloc", "mode", "refits", "ms 2-11", f"ms {n - WINDOW + 1}-{n}", "late/early", "RSS MiB @10", f"RSS MiB @{n}",
            "RSS growth", "fds @10", f"fds @{n}", "verdict"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("malloc", "mode", "verdict") else "right", no_wrap=True)
    for (allocator, mode), s in rows.items():
        if mode == MODES[0] and len(t.rows):
            t.add_section()
        t.add_row(allocator if mode == MODES[0] else "", mode, str(s["refits"]), f"{s['t_early'] * 1e3:.1f}", f"{s['t_late'] * 1e3:.1f}",
                  f"{s['t_late'] / s['t_early']:.2f}x", f"{s['rss_at']:.0f}", f"{s['rss_end']:.0f}",
                  f"{s['rss_growth']:+.1f}", " ".join(map(str, s["fds_at"])), " ".join(map(str, s["fds_end"])),
                  s["verdict"] if s["verdict"] == "flat" else f"[bold red]{s['verdict']}[/]")
    t.caption = (f"measured in one run, one process per rank. ms: wall time of one refit, slowest rank, mean over "
                 f"the window (fresh modes include building the executor). RSS: largest rank; growth: largest "
                 f"per-rank change from refit 10 to the last. fds: open descriptors of each rank. flat: every "
                 f"rank's fds do not grow, every rank's RSS grows < {RSS_SLACK_FRACTION:.0%} + "
                 f"{RSS_SLACK_MIB:g} MiB, late <= {TIME_RATIO:g}x early. Destinations verified after each mode.")
    t.caption_justify = "left"
    console.print(t)
    console.print(f"total {time.perf_counter() - start:.0f} s")
    return 0  # a verdict is a measurement on a shared machine, not a test: only wrong bytes fail


if __name__ == "__main__":
    sys.exit(main())
