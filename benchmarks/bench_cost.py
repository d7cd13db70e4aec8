"""Calibrate the cost model's "cpu" topology on this machine, then check it against real gloo refits.

Run from the repository root (``make bench-cost`` does)::

    python benchmarks/bench_cost.py [--configs 4-4:4x1,8-4:2x2] [--repeat 3] [--layers 4]

Section 1 (one process): pack/unpack bandwidth and per-copy overhead of
``reshard.local.pack``/``unpack`` on tensor-parallel-shaped boxes.

Section 2 (4 processes, gloo over TCP loopback, the executor's own
``batch_isend_irecv`` path): one-way latency of a tiny message, the extra time
per message in a batch, one pair's bandwidth, and the host's total bandwidth with
two pairs sending at once.

These fill ``Topology.preset("cpu")`` (printed, ready to paste into
``CPU_MEASURED`` in ``src/reshard/topology.py``). Section 3 spawns real refits of
a small Qwen3-shaped model (FSDP-style ``Shard(0)`` sources -> tensor-parallel
destinations, as ``make bench`` does) with ``reshard.ReshardExecutor``, verifies
every destination byte, and puts the measured time (slowest rank's
``RunStats.seconds``, best of ``--repeat`` after one warm-up run) beside the
model's prediction from ``cost.traffic_from_plan`` + ``cost.model_time``.
Target (issue 4): within 30 %.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import reshard as rs
from reshard import verify
from reshard.cost import model_time, traffic_from_pairs, traffic_from_plan
from reshard.demo_model import QWEN3_0_6B, demo_layouts
from reshard.local import pack, unpack
from reshard.schedule import Copy, Message
from reshard.topology import CPU_MEASURED, Placement, cpu_topology

from bench_refit import parse_configs  # noqa: E402  (benchmarks/ is on the path when run as a script)

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
def _column_copies(rows: int, cols: int, parts: int, dtype: torch.dtype) -> list[Copy]:
    """A [rows, cols] weight split into ``parts`` column blocks: strided boxes, as tensor parallelism cuts."""
    w = cols // parts
    return [Copy("w", (0, i * w), (rows, w), "w", (0, i * w), "w", (0, i * w), dtype) for i in range(parts)]


def measure_copies(repeat: int = 5) -> dict:
    """Bytes/s of pack + unpack on 2 KiB-row boxes, and the fixed cost per copied box."""
    torch.set_num_threads(1)
    dt = torch.bfloat16
    big = {"w": torch.randn(4096, 2048).to(dt)}  # 16 MiB
    dst = {"w": torch.empty_like(big["w"])}
    msg = Message(1, 0, _column_copies(4096, 2048, 2, dt))
    payload = pack(msg, big)
    t_pack = best(lambda: pack(msg, big, out=payload), repeat)
    t_unpack = best(lambda: unpack(msg, payload, dst), repeat)
    nbytes = msg.payload_bytes
    bw = 2 * nbytes / (t_pack + t_unpack)
    # many one-element boxes: the per-copy cost (pack + unpack, per box, minus the bytes' share)
    small = {"w": torch.randn(64, 64).to(dt)}
    sdst = {"w": torch.empty_like(small["w"])}
    copies = [Copy("w", (i // 64, i % 64), (1, 1), "w", (i // 64, i % 64), "w", (i // 64, i % 64), dt)
              for i in range(2048)]
    smsg = Message(1, 0, copies)
    spay = pack(smsg, small)
    t_small = best(lambda: pack(smsg, small, out=spay), repeat) + best(lambda: unpack(smsg, spay, sdst), repeat)
    per_copy = t_small / (2 * len(copies))
    return {"copy_bytes_per_s": bw, "copy_overhead_s": per_copy}


# ------------------------------------------------------------------ section 2: gloo loopback
def _exchange(rank: int, peer: int, tensors: list[torch.Tensor], send: bool) -> None:
    op = dist.isend if send else dist.irecv
    for w in dist.batch_isend_irecv([dist.P2POp(op, t, peer) for t in tensors]):
        w.wait()


def _loopback_worker(rank: int, world: int, out_path: str, nbytes: int, repeat: int) -> None:
    peer = rank ^ 1  # pairs (0, 1) and (2, 3)
    sender = rank % 2 == 0
    res = {}
    tiny = [torch.zeros(1, dtype=torch.uint8)]

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
        out = torch.tensor([statistics.median(times) if times else 0.0])
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return float(out)

    pingpong(20)
    res["latency_s"] = pingpong(200)

    def batch(k: int) -> float:
        bufs = [torch.zeros(16, dtype=torch.uint8) for _ in range(k)]
        times = []
        for _ in range(repeat + 2):
            dist.barrier()
            t = time.perf_counter()
            if rank < 2:
                _exchange(rank, peer, bufs, sender)
            times.append(time.perf_counter() - t)
        return min(times)

    t1, t64 = batch(1), batch(64)
    res["message_overhead_s"] = max(t64 - t1, 0.0) / 63

    # all 4 processes, each sending 16 bytes to and receiving 16 bytes from each of the 3 others
    others = [r for r in range(world) if r != rank]
    small = [torch.zeros(16, dtype=torch.uint8) for _ in range(2 * len(others))]
    rounds = []
    for _ in range(30):
        dist.barrier()
        t = time.perf_counter()
        ops = [dist.P2POp(dist.isend, small[i], p) for i, p in enumerate(others)]
        ops += [dist.P2POp(dist.irecv, small[len(others) + i], p) for i, p in enumerate(others)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        dt = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        rounds.append(float(dt))
    res["all_pairs_round_s"] = statistics.median(rounds)
    res["processes"] = world

    big = torch.zeros(nbytes, dtype=torch.uint8)

    def stream(active: set[int]) -> float:
        times = []
        for _ in range(repeat):
            dist.barrier()
            t = time.perf_counter()
            if rank in active:
                _exchange(rank, peer, [big], sender)
            dt = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times.append(float(dt))
        return min(times)

    stream({0, 1})  # warm the connection
    res["pair_bytes_per_s"] = nbytes / stream({0, 1})
    res["host_bytes_per_s"] = 2 * nbytes / stream({0, 1, 2, 3})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)


def measure_loopback(nbytes: int, repeat: int) -> dict:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        rs.spawn(_loopback_worker, 4, path, nbytes, repeat, backend="gloo")
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


# ------------------------------------------------------------------ section 3: real refits
def _message_costs(rank: int, sources: list[int], dests: list[int], rounds: int = 30) -> dict:
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
    peers = dests if rank in sources else sources if rank in dests else []
    bufs = [torch.zeros(16, dtype=torch.uint8) for _ in peers]
    op = dist.isend if rank in sources else dist.irecv
    per_round = []
    for _ in range(rounds):
        dist.barrier()
        t = time.perf_counter()
        if peers:
            for w in dist.batch_isend_irecv([dist.P2POp(op, x, p) for x, p in zip(bufs, peers)]):
                w.wait()
        dt = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        per_round.append(float(dt))
    return {"latency_s": float(one_way), "empty_round_s": statistics.median(per_round)}


def _refit_worker(rank: int, world: int, out_path: str, model, m: int, tp: int, dp: int, bucket: int | None,
                  repeat: int) -> None:
    lay = demo_layouts(model, m, tp, dp)
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
            json.dump({"seconds": secs, "mismatches": sum(seen), **costs}, f)


def wakeup_cost(round_s: float, latency_s: float, overhead_s: float, p: int, cores: int) -> float:
    """Per-rank, per-round scheduling cost that makes the cost model reproduce a measured round in which
    each of ``p`` processes sends 16 bytes to and receives 16 bytes from every other: that round
    models as ``latency + (p * 2 (p - 1) * overhead + p * wakeup) / cores`` on the shared host."""
    return max((round_s - latency_s) * cores - p * 2 * (p - 1) * overhead_s, 0.0) / p


def empty_round_model(topo, m: int, n: int) -> float:
    """Modeled seconds of one round of 16-byte messages on every source -> destination pair."""
    place = Placement.contiguous(topo, m, n)
    pairs = {(s, m + d): 16 for s in range(m) for d in range(n)}
    return model_time(traffic_from_pairs([pairs], place, topo), topo).seconds


def run_refit(model, m: int, tp: int, dp: int, bucket: int | None, repeat: int) -> dict:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        rs.spawn(_refit_worker, m + tp * dp, path, model, m, tp, dp, bucket, repeat, backend="gloo")
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="M-N:TPxDP refits to run (default %(default)s)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the model (default %(default)s)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (default %(default)s)")
    ap.add_argument("--max-bucket-mb", type=float, default=8.0,
                    help="staging cap per rank in MiB (several rounds at these sizes; default %(default)s)")
    ap.add_argument("--stream-mb", type=float, default=64.0, help="message size for loopback bandwidth (MiB)")
    ap.add_argument("--stored", action="store_true",
                    help="skip sections 1-2 and model with the values stored in topology.py")
    args = ap.parse_args(argv)
    console = Console(width=max(Console().width, 200))
    cmd = " ".join(["python", "benchmarks/bench_cost.py"] + [shlex.quote(a) for a in (argv or sys.argv[1:])])
    console.print(f"$ {cmd}")
    console.print(f"machine: {os.cpu_count()} CPUs, {platform.machine()}, python {platform.python_version()}, "
                  f"torch {torch.__version__}, gloo over loopback")
    start = time.perf_counter()

    if args.stored:
        measured = dict(CPU_MEASURED)
    else:
        with console.status("measuring pack/unpack ..."):
            copies = measure_copies(args.repeat + 2)
        with console.status("measuring gloo loopback (4 processes) ..."):
            loop = measure_loopback(int(args.stream_mb * MiB), args.repeat)
        cores = os.cpu_count() or 1
        measured = dict(nic_bytes_per_s=loop["pair_bytes_per_s"], host_bytes_per_s=loop["host_bytes_per_s"],
                        net_latency_s=loop["latency_s"], launch_latency_s=0.0,
                        copy_bytes_per_s=copies["copy_bytes_per_s"],
                        message_overhead_s=loop["message_overhead_s"], copy_overhead_s=copies["copy_overhead_s"],
                        host_cores=cores,
                        host_wakeup_s=wakeup_cost(loop["all_pairs_round_s"], loop["latency_s"],
                                                  loop["message_overhead_s"], loop["processes"], cores))
    topo = cpu_topology(**measured)
    t = Table(title="cpu topology: measured on this machine" + (" (stored values)" if args.stored else ""))
    for c in ("quantity", "value", "how"):
        t.add_column(c, justify="right" if c == "value" else "left")
    rows = [
        ("pack+unpack bandwidth", f"{topo.copy_bytes_per_s / 1e9:.2f} GB/s", "local.pack/unpack, 2 KiB-row boxes, 1 thread"),
        ("per-copy overhead", f"{topo.copy_overhead_s * 1e6:.1f} us", "pack+unpack of 2048 one-element boxes"),
        ("one pair's bandwidth", f"{topo.nic_bytes_per_s / 1e9:.2f} GB/s", f"{args.stream_mb:g} MiB isend/irecv, 2 processes"),
        ("host bandwidth", f"{topo.host_bytes_per_s / 1e9:.2f} GB/s", "two pairs at once, bytes of both"),
        ("message latency", f"{topo.net_latency_s * 1e6:.1f} us", "half a ping-pong of 1 byte, median of 200"),
        ("per-message overhead", f"{topo.message_overhead_s * 1e6:.1f} us", "64 vs 1 messages in one batch"),
        ("per-rank round cost", f"{topo.host_wakeup_s * 1e6:.1f} us", "4 processes, each 16 B to every other "
                                                                        "(median of 30), less latency and overheads"),
        ("shared cores", str(topo.host_cores), "os.cpu_count()"),
    ]
    for r in rows:
        t.add_row(*r)
    console.print(t)
    console.print("CPU_MEASURED = dict(" + ", ".join(
        f"{k}={v!r}" if isinstance(v, int) else f"{k}={v:.4g}" for k, v in measured.items()) + ")")

    model = QWEN3_0_6B.with_overrides(layers=args.layers, vocab=args.vocab)
    bucket = int(args.max_bucket_mb * MiB) or None
    res = Table(title=f"modeled vs measured refit (ReshardExecutor over gloo): Qwen3-shaped, {args.layers} layers, "
                      f"vocab {args.vocab}, {model.nbytes / 1e6:.1f} MB bf16; staging cap {args.max_bucket_mb:g} MiB")
    for c in ("config", "procs", "wire MB", "rounds", "msgs", "modeled s", "measured s", "measured/modeled",
              "within 30%", "bottleneck", "empty round ms: modeled", "measured", "ping-pong ms"):
        res.add_column(c, justify="left" if c in ("config", "bottleneck") else "right")
    ok = True
    for m, tp, dp in parse_configs(args.configs):
        n = tp * dp
        label = f"{m}->{n} tp{tp}" + (f"xdp{dp}" if dp > 1 else "")
        lay = demo_layouts(model, m, tp, dp)
        plan = rs.plan(lay.source, lay.destination, max_bucket_bytes=bucket)
        with console.status(f"{label}: {m + n} processes ..."):
            got = run_refit(model, m, tp, dp, bucket, args.repeat)
        if got["mismatches"]:
            console.print(f"[bold red]{label}: {got['mismatches']} wrong destination elements")
            return 1
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
                    f"{empty_round_model(topo, m, n) * 1e3:.2f}", f"{got['empty_round_s'] * 1e3:.2f}",
                    f"{got['latency_s'] * 1e3:.2f}")
        console.print(f"  {label}: measured {', '.join(f'{s:.3f}' for s in got['seconds'])} s (verified); "
                      f"empty round {got['empty_round_s'] * 1e3:.2f} ms")
    res.caption = ("measured: slowest rank's RunStats.seconds, best of the repeats after a warm-up run. modeled: "
                   "cost.model_time(cost.traffic_from_plan(plan)) with the cpu topology above (all ranks on one host "
                   "sharing its cores and loopback). empty round: one round of 16-byte messages on every "
                   "source-destination pair, modeled and measured among the refit's own processes just before it "
                   "runs, with the one-way ping-pong latency there: how far the per-round costs carry over from 4 "
                   "processes to this many")
    res.caption_justify = "left"
    console.print(res)
    console.print(f"{'every' if ok else 'NOT every'} configuration within 30% of the model in this run; "
                  f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
