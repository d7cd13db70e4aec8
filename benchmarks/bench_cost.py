"""Calibrate the cost model's "cpu" topology on this machine, then check it against real gloo refits.

Run from the repository root (``make bench-cost`` does)::

    python benchmarks/bench_cost.py [--configs 4-4:4x1,8-4:2x2] [--repeat 3] [--layers 4]

Section 1 (this process): bandwidth and per-box cost of ``reshard.execution.packing.pack`` and
``unpack`` as the executor calls them (2 MiB messages of strided tensor-parallel boxes
through one reused staging buffer, as the executor's staging arena).

Then, for each configuration, one gloo process group of M + N processes (TCP
loopback; ``batch_isend_irecv`` like the executor). Section 2: median one-way
latency of a 1-byte ping-pong (ranks 0, 1); the CPU cost per message end, from
rounds in which each of ranks 0-3 sends 16 bytes to every other; one pair's
bandwidth, and the host's total with every process in a pair sending at once, 16
messages of 2 MiB back to back into one reused receive buffer (the executor's staging arena).
The machine is shared, so these are measured again, in the same
minute, before each refit; they fill ``Topology.preset("cpu")`` (the first
configuration's values are printed ready for ``CPU_MEASURED`` in
``src/reshard/topology.py``). Section 3: a real refit of a small Qwen3-shaped
model (FSDP-style ``Shard(0)`` sources -> tensor-parallel destinations, as
``make bench`` does) with ``reshard.ReshardExecutor``, every destination byte
verified, and the measured time (slowest rank's ``RunStats.seconds``, best of
``--repeat`` after one warm-up run) beside the model's prediction from
``cost.traffic_from_plan`` + ``cost.model_time``. Beside it, one round of
16-byte messages on every source-destination pair, modeled and measured among
the refit's own processes: how far the per-message cost measured with 4
processes carries over to 8 or 12.
Target (issue 4): within 30 %.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from reshard.apps.bench_support import parse_configs, print_header, spawn_for_json
from rich.console import Console
from rich.table import Table

import reshard as rs
from reshard import verify
from reshard.execution.packing import pack, unpack
from reshard.frameworks.parallel import InferParallel, TrainParallel, model_layouts
from reshard.modeling.reshard_time import model_time
from reshard.modeling.topology import CPU_MEASURED, Placement, cpu_topology
from reshard.modeling.traffic import traffic_from_pairs, traffic_from_plan
from reshard.models import DEMO_MODEL, get_arch
from reshard.planning.schedule import Copy, Message

MiB = 1 << 20
DEFAULT_CONFIGS = "4-4:4x1,8-4:2x2"


def best(fn, repeat: int) -> float:
    """Fastest of ``repeat`` timed calls (the machine is shared: the minimum is the least disturbed)."""
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


# ------------------------------------------------------------------ section 1: pack / unpack
def _block_messages(rows: int, cols: int, dtype: torch.dtype, message_bytes: int) -> list[Message]:
    """A [rows, cols] weight cut into tensor-parallel column halves, packed as messages of about
    ``message_bytes`` (strided 2-D boxes, as a refit's messages are)."""
    half = cols // 2
    row_bytes = half * dtype.itemsize
    step = max(1, message_bytes // row_bytes)
    out = []
    for c0 in (0, half):
        for r0 in range(0, rows, step):
            r = min(step, rows - r0)
            out.append(Message(1, 0, [Copy("w", (r0, c0), (r, half), "w", (r0, c0), "w", (r0, c0), dtype)]))
    return out


def measure_copies(repeat: int = 5, message_bytes: int = 2 * MiB) -> dict:
    """Bytes/s of pack + unpack as the executor calls them (each message through one reused staging
    buffer, like the executor's arena), and the fixed cost per copied box."""
    torch.set_num_threads(1)
    dt = torch.bfloat16
    src = {"w": torch.randn(4096, 4096).to(dt)}  # 32 MiB, bigger than the caches
    dst = {"w": torch.empty_like(src["w"])}
    msgs = _block_messages(4096, 4096, dt, message_bytes)
    nbytes = sum(m.payload_bytes for m in msgs)

    stage = torch.empty(max(m.nbytes for m in msgs), dtype=torch.uint8)

    def round_trip():
        for m in msgs:
            unpack(m, pack(m, src, out=stage[: m.nbytes]), dst)

    bw = 2 * nbytes / best(round_trip, repeat)
    # many one-element boxes: the per-box cost (pack + unpack, per box)
    small = {"w": torch.randn(64, 64).to(dt)}
    sdst = {"w": torch.empty_like(small["w"])}
    copies = [Copy("w", (i // 64, i % 64), (1, 1), "w", (i // 64, i % 64), "w", (i // 64, i % 64), dt)
              for i in range(2048)]
    smsg = Message(1, 0, copies)
    per_copy = best(lambda: unpack(smsg, pack(smsg, small), sdst), repeat) / (2 * len(copies))
    return {"copy_bytes_per_s": bw, "copy_overhead_s": per_copy}


# ------------------------------------------------------------------ section 2: gloo loopback
def _exchange(rank: int, peer: int, tensors: list[torch.Tensor], send: bool) -> None:
    op = dist.isend if send else dist.irecv
    for w in dist.batch_isend_irecv([dist.P2POp(op, t, peer) for t in tensors]):
        w.wait()


def rounds_back_to_back(sends: list[int], recvs: list[int], rounds: int = 20, repeat: int = 5) -> float:
    """Collective: seconds per round of 16-byte messages to ``sends`` and from ``recvs``, ``rounds`` rounds
    back to back as the executor runs them (median of ``repeat``; slowest rank). Rounds are not timed
    one by one: leaving a barrier takes the processes of a crowded host milliseconds apart."""
    sb = [torch.zeros(16, dtype=torch.uint8) for _ in sends]
    rb = [torch.zeros(16, dtype=torch.uint8) for _ in recvs]
    out = []
    for _ in range(repeat):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(rounds):
            ops = [dist.P2POp(dist.isend, b, p) for b, p in zip(sb, sends)]
            ops += [dist.P2POp(dist.irecv, b, p) for b, p in zip(rb, recvs)]
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        dt = torch.tensor([(time.perf_counter() - t) / rounds])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        out.append(float(dt))
    return statistics.median(out)


def calibrate(rank: int, world: int, nbytes: int, repeat: int) -> dict:
    """Collective over the whole group; only ranks 0-3 exchange (the others wait at the barriers).

    Ranks pair up as (0, 1), (2, 3), ... Measures: the median one-way time of a 1-byte ping-pong
    (0 <-> 1); the median round in which each of ranks 0-3 sends 16 bytes to and receives 16 bytes
    from each of the 3 others, rounds back to back; one pair's bandwidth, and the total of every
    pair sending at once (the host with all its processes busy), 16 ``nbytes`` messages back to back.
    """
    peer = rank ^ 1
    sender = rank % 2 == 0
    active = rank < 4
    res = {}
    tiny = [torch.zeros(1, dtype=torch.uint8)]

    def collect(value: float) -> float:
        out = torch.tensor([value])
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return float(out)

    def pingpong(n: int) -> float:
        """Median one-way time of ``n`` round trips, each timed alone (robust to other jobs' bursts)."""
        dist.barrier()
        times = []
        if rank < 2:
            for _ in range(n):
                t = time.perf_counter()
                _exchange(rank, peer, tiny, sender)
                _exchange(rank, peer, tiny, not sender)
                times.append((time.perf_counter() - t) / 2)
        return collect(statistics.median(times) if times else 0.0)

    pingpong(20)
    res["latency_s"] = pingpong(200)

    others = [r for r in range(4) if r != rank] if active else []
    res["all_pairs_round_s"] = rounds_back_to_back(others, others)

    paired = world - world % 2  # ranks (0, 1), (2, 3), ... for the host's total with every process busy
    big = torch.zeros(nbytes if rank < paired else 1, dtype=torch.uint8)

    def stream(pairs: set[int], count: int = 16) -> float:
        """Best of ``repeat``: ``count`` messages back to back into one reused receive buffer, as the
        executor's staging arena is."""
        times = []
        for _ in range(repeat):
            dist.barrier()
            t = time.perf_counter()
            if rank in pairs:
                for _ in range(count):
                    _exchange(rank, peer, [big], sender)
            times.append(collect(time.perf_counter() - t))
        return min(times) / count

    stream({0, 1}, 2)  # warm the connection
    res["pair_bytes_per_s"] = nbytes / stream({0, 1})
    res["host_bytes_per_s"] = paired // 2 * nbytes / stream(set(range(paired)))
    return res


CPU_MEASURED_COPIES = {k: CPU_MEASURED[k] for k in ("copy_bytes_per_s", "copy_overhead_s")}


def topology_from(copies: dict, loop: dict, cores: int):
    """The cpu topology's measured fields from section 1's and section 2's measurements."""
    return dict(nic_bytes_per_s=loop["pair_bytes_per_s"], host_bytes_per_s=loop["host_bytes_per_s"],
                net_latency_s=loop["latency_s"], launch_latency_s=0.0, copy_bytes_per_s=copies["copy_bytes_per_s"],
                message_overhead_s=message_cost(loop["all_pairs_round_s"], loop["latency_s"], 4, cores),
                copy_overhead_s=copies["copy_overhead_s"], host_cores=cores)


# ------------------------------------------------------------------ section 3: real refits
def _message_costs(rank: int, sources: list[int], dests: list[int]) -> dict:
    """One-way latency (ping-pong of one source and one destination) and seconds per round of 16-byte
    messages on every source -> destination pair, measured with all of this refit's processes alive:
    on a host with fewer cores than processes both depend on how many processes there are."""
    tiny = [torch.zeros(1, dtype=torch.uint8)]
    a, b = sources[0], dests[0]
    dist.barrier()
    lat = []
    if rank in (a, b):
        for _ in range(50):
            t = time.perf_counter()
            _exchange(rank, b if rank == a else a, tiny, rank == a)
            _exchange(rank, b if rank == a else a, tiny, rank == b)
            lat.append((time.perf_counter() - t) / 2)
    one_way = torch.tensor([statistics.median(lat) if lat else 0.0])
    dist.all_reduce(one_way, op=dist.ReduceOp.MAX)
    return {"latency_s": float(one_way),
            "empty_round_s": rounds_back_to_back(dests if rank in sources else [], sources if rank in dests else [])}


def _refit_worker(rank: int, world: int, out_path: str, model, train: TrainParallel, infer: InferParallel,
                  bucket: int | None, repeat: int, stream_bytes: int) -> None:
    calib = calibrate(rank, world, stream_bytes, repeat)
    lay = model_layouts(model, train, infer)
    plan = rs.plan(lay.source, lay.destination, max_bucket_bytes=bucket)
    src = verify.fill_source(lay.source, rank) if rank in lay.source_ranks else {}
    dst = lay.destination.empty_buffers(rank)
    ex = rs.ReshardExecutor(plan)
    costs = _message_costs(rank, lay.source_ranks, lay.destination_ranks)
    secs = []
    for i in range(repeat + 1):  # the first run warms up
        for b in dst.values():
            b.zero_()
        dist.barrier()
        stats = ex.run(src, dst)
        t = torch.tensor([stats.seconds])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i:
            secs.append(float(t))
    bad = verify.check_destination(lay.destination, rank, dst) if rank in lay.destination_ranks else []
    seen: list = [None] * world
    dist.all_gather_object(seen, len(bad))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"seconds": secs, "mismatches": sum(seen), "calibration": calib, **costs}, f)


def message_cost(round_s: float, latency_s: float, p: int, cores: int) -> float:
    """CPU seconds per message end that make the cost model reproduce a measured round in which each
    of ``p`` processes sends 16 bytes to and receives 16 bytes from every other: the model gives that
    round ``latency + p * 2 (p - 1) * cost / cores`` on a shared host with at least as many processes
    as cores."""
    return max(round_s - latency_s, 0.0) * cores / (p * 2 * (p - 1))


def empty_round_model(topo, m: int, n: int) -> float:
    """Modeled seconds of one round of 16-byte messages on every source -> destination pair."""
    place = Placement.contiguous(topo, m, n)
    pairs = {(s, m + d): 16 for s in range(m) for d in range(n)}
    return model_time(traffic_from_pairs([pairs], place, topo), topo).seconds


def run_refit(model, train: TrainParallel, infer: InferParallel, bucket: int | None, repeat: int,
              stream_bytes: int) -> dict:
    return spawn_for_json(_refit_worker, train.world + infer.world, model, train, infer, bucket, repeat,
                          stream_bytes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="M-N:TPxDP refits to run (default %(default)s)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the model (default %(default)s)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (default %(default)s)")
    ap.add_argument("--max-bucket-mb", type=float, default=8.0,
                    help="staging cap per rank in MiB (several rounds at these sizes; default %(default)s)")
    ap.add_argument("--stream-mb", type=float, default=2.0,
                    help="message size for loopback bandwidth, 16 back to back (MiB; default %(default)s)")
    ap.add_argument("--stored", action="store_true",
                    help="model with the values stored in topology.py instead of this run's")
    args = ap.parse_args(argv)
    console = Console(width=max(Console().width, 200))
    print_header(console, "benchmarks/bench_cost.py", argv)
    start = time.perf_counter()
    cores = os.cpu_count() or 1
    copies = None
    if not args.stored:
        with console.status("measuring pack/unpack ..."):
            copies = measure_copies(args.repeat + 2)
    model = get_arch(DEMO_MODEL).with_overrides(layers=args.layers, vocab=args.vocab)
    bucket = int(args.max_bucket_mb * MiB) or None
    res = Table(title=f"modeled vs measured refit (ReshardExecutor over gloo): Qwen3-shaped, {args.layers} layers, "
                      f"vocab {args.vocab}, {model.nbytes / 1e6:.1f} MB bf16; staging cap {args.max_bucket_mb:g} MiB")
    for c in ("config", "procs", "wire MB", "rounds", "msgs", "modeled s", "measured s", "measured/modeled",
              "within 30%", "bottleneck", "empty round ms: modeled", "measured"):
        res.add_column(c, justify="left" if c in ("config", "bottleneck") else "right")
    calib = Table(title="cpu topology, measured in each configuration's process group just before its refit"
                  + (" (not used: --stored)" if args.stored else ""))
    calib.add_column("quantity")
    calib.add_column("how")
    ok = True
    values: list[list[str]] = []
    first = None
    for train, infer in parse_configs(args.configs):
        m, n = train.world, infer.world
        label = f"{m}->{n} tp{infer.tp}" + (f"xdp{infer.dp}" if infer.dp > 1 else "")
        lay = model_layouts(model, train, infer)
        plan = rs.plan(lay.source, lay.destination, max_bucket_bytes=bucket)
        with console.status(f"{label}: {m + n} processes ..."):
            got = run_refit(model, train, infer, bucket, args.repeat, int(args.stream_mb * MiB))
        if got["mismatches"]:
            console.print(f"[bold red]{label}: {got['mismatches']} wrong destination elements")
            return 1
        measured = dict(CPU_MEASURED) if args.stored else topology_from(copies, got["calibration"], cores)
        first = first or measured
        topo = cpu_topology(**measured)
        fresh = cpu_topology(**topology_from(copies or CPU_MEASURED_COPIES, got["calibration"], cores))
        calib.add_column(label, justify="right")
        values.append([f"{fresh.copy_bytes_per_s / 1e9:.2f} GB/s", f"{fresh.copy_overhead_s * 1e6:.1f} us",
                       f"{fresh.nic_bytes_per_s / 1e9:.2f} GB/s", f"{fresh.host_bytes_per_s / 1e9:.2f} GB/s",
                       f"{fresh.net_latency_s * 1e6:.0f} us", f"{fresh.message_overhead_s * 1e6:.0f} us",
                       str(fresh.host_cores)])
        place = Placement.contiguous(topo, m, n)
        est = model_time(traffic_from_plan(plan, place, topo), topo)
        meas = min(got["seconds"])
        ratio = meas / est.seconds
        within = abs(ratio - 1) <= 0.30
        ok &= within
        b = est.bottleneck
        res.add_row(label, str(m + n), f"{plan.wire_bytes / 1e6:.1f}", str(plan.num_rounds), str(plan.num_messages),
                    f"{est.seconds:.3f}", f"{meas:.3f}", f"{ratio:.2f}", "yes" if within else "NO",
                    f"{b.kind} {'node' if b.kind == 'host' else 'GPU'} {b.where}" if b else "-",
                    f"{empty_round_model(topo, m, n) * 1e3:.2f}", f"{got['empty_round_s'] * 1e3:.2f}")
        console.print(f"  {label}: measured {', '.join(f'{s:.3f}' for s in got['seconds'])} s (verified)")
    hows = ["reshard.execution.packing.pack + unpack of 2 MiB messages of 4 KiB-row boxes, one reused staging buffer, 1 thread",
            "pack + unpack of 2048 one-element boxes", f"ranks 0 -> 1, 16 x {args.stream_mb:g} MiB back to back",
            "every process in a pair (0 -> 1, 2 -> 3, ...), all at once, total bytes (reused receive buffer)", "0 <-> 1, half a 1-byte ping-pong, median of 200",
            "ranks 0-3 each send 16 B to each other, 20 rounds back to back: (round - latency) x cores / 24 "
            "message ends",
            "os.cpu_count()"]
    names = ["pack+unpack bandwidth", "per-copy overhead", "one pair's bandwidth", "host bandwidth",
             "message latency", "CPU per message end", "shared cores"]
    for i, (name, how) in enumerate(zip(names, hows)):
        calib.add_row(name, how, *[v[i] for v in values])
    console.print(calib)
    if first is not None and not args.stored:
        console.print("first configuration's values, for CPU_MEASURED in src/reshard/topology.py: " + ", ".join(
            f"{k}={v!r}" if isinstance(v, int) else f"{k}={v:.4g}" for k, v in first.items()), highlight=False)
    res.caption = ("measured: slowest rank's RunStats.seconds, best of the repeats after a warm-up run. modeled: "
                   "cost.model_time(cost.traffic_from_plan(plan)) with that configuration's cpu topology above (or the "
                   "stored one with --stored): all ranks on one host sharing its cores and loopback. empty round: "
                   "one round of 16-byte messages on every source-destination pair, modeled, and measured among the "
                   "refit's processes: how far the per-round costs measured with 4 processes carry over to this many")
    res.caption_justify = "left"
    console.print(res)
    console.print(f"{'every' if ok else 'NOT every'} configuration within 30% of the model in this run; "
                  f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
