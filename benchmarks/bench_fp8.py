"""BF16 -> BF16 vs BF16 -> FP8 (raw where no source holds a block) vs BF16 -> FP8 with blocks assembled.

Run from the repository root::

    python benchmarks/bench_fp8.py [--repeat 5] [--layers 28] [--configs 2-2:2x1,3-2:2x1,12-2:2x1] [--all-at-once]

One process group per configuration (CPU, gloo), the demo model (Qwen3-0.6B-shaped, ``--layers``
decoder layers), FSDP2 training over M ranks -> N inference ranks (torch tensor-parallel
replicas, ``tp x dp``). Per repeat, one run of each, in alternating order (the machine is noisy):

    bf16    ReshardExecutor of the plain plan: every tensor crosses in BF16
    fp8     PrecisionExecutor of ``precision_plan(..., "fp8")``: the linear weights as float8_e4m3fn
            with one float32 scale per 128 x 128 block (routers, norms, embeddings, head kept in
            BF16); each block is quantized on the source rank that holds it whole ("quantize at
            source") or, where no source does (an uneven FSDP split), crosses in BF16 and is
            quantized on the destination ("quantize at destination")
    fp8 asm the same FP8 refit with block assembly (``precision_plan(..., assemble=...)``): the
            training ranks form one domain (``--domain``: ranks per domain), and a block no rank
            holds whole but the domain's ranks hold together is first handed to one of them
            ("assemble blocks"), which quantizes it and sends FP8; only blocks that span domains
            still cross in BF16
    fp8 whole (``--all-at-once``) the raw FP8 plan run without tensor groups: one refit that stages every
            tensor's quantization at once, over the cap (what the groups cost in time)

"peak staging": the busiest rank's measured peak (``RunStats.peak_staging_bytes``: the staging a
tensor group allocated, plus its transfer's or assembly round's) against what the quantization
alone staged all at once before tensor groups (the plan's ``staging_bytes()``, source + destination
+ assembly), with the number of tensor groups; the cap is ``--bucket`` (``max_bucket_bytes``).

Times are the slowest rank's wall time of one ``run``, median over repeats; the assemble and
quantize columns are the slowest rank's time in those RunStats phases (median). Wire MiB excludes
the assembly phase's bytes (inside the domain: NVLink on a GPU machine, gloo over loopback here),
shown apart. Wire MiB are the plan's bytes
between ranks, by what they cross as. Every destination byte is verified after every run: BF16
against the test values, FP8 values and scales bit for bit against the reference quantizer
(:func:`reshard.quant.quantize_blocks`) applied to the full tensor. All figures measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import reshard as rs
from reshard import verify
from reshard.apps.bench_support import parse_configs, print_header, spawn_for_json
from reshard.execution.precision import ASSEMBLY_STEP, DESTINATION_STEP, SOURCE_STEP, PrecisionExecutor
from reshard.frameworks.parallel import model_layouts
from reshard.models import DEMO_MODEL, get_arch
from reshard.planning.precision import precision_plan
from reshard.quant import quantize_blocks, scale_name
from reshard.tensors import box_slices, box_str, buffer_view

MiB = 1 << 20
KINDS = ("bf16", "fp8", "fp8 asm")
WHOLE = "fp8 whole"  # --all-at-once: the raw FP8 plan in one child refit, no tensor groups
LABELS = {"fp8": "FP8, raw BF16 where no whole holder", "fp8 asm": "FP8, blocks assembled",
          WHOLE: "FP8, raw, all at once (no tensor groups)"}


def _fp8_reference(pp, lay, rank: int) -> dict[str, torch.Tensor]:
    """The reference quantizer's values and scales of every FP8 tensor ``rank`` holds (full tensors)."""
    ref: dict[str, torch.Tensor] = {}
    held = {p.tensor for p in pp.destination.pieces(rank)}
    for name, info in pp.fp8.items():
        if name not in held:
            continue
        spec = lay.source.specs[name]
        full = verify.values(name, spec.shape, (0,) * len(spec.shape), spec.shape, spec.dtype)
        ref[name], ref[scale_name(name)] = quantize_blocks(full, info.block, info.precision.ue8m0)
    return ref


def _check_fp8(pp, rank: int, buffers, ref) -> list[str]:
    """Mismatches of ``rank``'s FP8 engine buffers: FP8 tensors and scales against ``ref`` bit for bit,
    the kept tensors against the test values."""
    out = []
    for p in pp.destination.pieces(rank):
        got = buffer_view(buffers[p.buffer], p.buffer_offsets, p.sizes)
        if p.tensor in ref:
            want, what = ref[p.tensor][box_slices(p.offsets, p.sizes)].contiguous(), "the reference quantizer"
        else:
            spec = pp.destination.specs[p.tensor]
            want = verify.values(p.tensor, spec.shape, p.offsets, p.sizes, got.dtype, logical_dtype=spec.dtype)
            what = "the test values"
        if got.dtype != want.dtype or not torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8)):
            out.append(f"tensor {p.tensor!r} rank {rank}: box {box_str(p.offsets, p.sizes)} differs from {what}")
    return out


def _worker(rank: int, world: int, path: str, config: str, layers: int, repeat: int, domain: int,
            bucket: int, whole: bool) -> None:
    import json

    kinds = KINDS + ((WHOLE,) if whole else ())

    (train, infer), = parse_configs(config)
    lay = model_layouts(get_arch(DEMO_MODEL).with_overrides(layers=layers), train, infer)
    src = verify.fill_source(lay.source, rank) if rank in lay.source_ranks else {}
    size = domain or len(lay.source.ranks)
    plans = {"bf16": rs.plan(lay.source, lay.destination, max_bucket_bytes=bucket),
             "fp8": precision_plan(lay.source, lay.destination, "fp8", max_bucket_bytes=bucket),
             "fp8 asm": precision_plan(lay.source, lay.destination, "fp8", max_bucket_bytes=bucket,
                                       assemble={r: r // size for r in lay.source.ranks})}
    pp = plans["fp8"]
    executors = {"bf16": rs.ReshardExecutor(plans["bf16"]), "fp8": PrecisionExecutor(pp),
                 "fp8 asm": PrecisionExecutor(plans["fp8 asm"])}
    if whole:
        plans[WHOLE], executors[WHOLE] = pp, PrecisionExecutor(pp, groups=False)
    dst = {"bf16": lay.destination.empty_buffers(rank),
           **{k: plans[k].destination.empty_buffers(rank) for k in kinds[1:]}}
    ref = _fp8_reference(pp, lay, rank) if rank in lay.destination_ranks else {}
    times = {k: [] for k in kinds}
    steps = (ASSEMBLY_STEP, SOURCE_STEP, DESTINATION_STEP)
    quant = {kind: {step: [] for step in steps} for kind in kinds[1:]}
    bad: list[str] = []
    peak = {k: 0 for k in kinds}  # this rank's measured peak staging per path (run stats)
    for i in range(repeat + 1):
        for kind in (kinds if i % 2 else kinds[::-1]):  # alternating order: the machine is noisy
            for t in dst[kind].values():
                t.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            stats = executors[kind].run(src, dst[kind])
            elapsed = time.perf_counter() - t0
            peak[kind] = max(peak[kind], stats.peak_staging_bytes)
            if i:  # the first round warms up
                times[kind].append(elapsed)
                if kind != "bf16":
                    seconds = {p.name: p.seconds for p in stats.phases}
                    for step in steps:
                        quant[kind][step].append(seconds.get(step, 0.0))
            if rank in lay.destination_ranks:
                if kind == "bf16":
                    bad += verify.check_destination(lay.destination, rank, dst[kind])[:1]
                else:
                    bad += [f"{kind}: {b}" for b in _check_fp8(plans[kind], rank, dst[kind], ref)[:1]]
    figures = {}
    for kind in kinds[1:]:
        paths = plans[kind].tensor_paths().values()
        figures[kind] = {"by_path": plans[kind].wire_bytes_by_path(), "bytes": plans[kind].wire_bytes,
                         "assembly": plans[kind].assembly_bytes,
                         "blocks": [sum(p[k] for p in paths) for k in ("source", "assembled", "destination")],
                         "all_at_once": sum(side.get(rank, 0) for side in plans[kind].staging_bytes().values()),
                         "peak": peak[kind], "groups": len(executors[kind].children) or 1}
    everyone = [None] * world
    dist.all_gather_object(everyone, {"times": times, "quant": quant, "bad": bad,
                                      "bf16_bytes": plans["bf16"].wire_bytes, "bf16_peak": peak["bf16"],
                                      "fp8": figures})
    if rank == 0:
        with open(path, "w") as f:
            json.dump(everyone, f)


def _median_of_slowest(ranks, get, repeat: int) -> float:
    return statistics.median(max(get(r)[i] for r in ranks) for i in range(repeat))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=28,
                    help="decoder layers of the demo model (default %(default)s: all of Qwen3-0.6B, so the linear "
                         "weights FP8 applies to outweigh the BF16 embeddings and head)")
    ap.add_argument("--configs", default="2-2:2x1,3-2:2x1,12-2:2x1",
                    help="M-N:TPxDP, comma-separated: FSDP2 over M ranks -> N ranks as DP replicas of TP "
                         "(default %(default)s; 3 sources split the weights unevenly: some blocks have no "
                         "whole holder; 12 sources cut the 1024-row weights into 86-row pieces, under a block, "
                         "as FSDP over many GPUs does)")
    ap.add_argument("--bucket", type=int, default=32 * MiB,
                    help="max_bucket_bytes of every plan (default %(default)s): the cap on a rank's staging, "
                         "tensor groups and assembly rounds included")
    ap.add_argument("--domain", type=int, default=0,
                    help="training ranks per domain for the assembled path (default: all of them, one domain)")
    ap.add_argument("--all-at-once", action="store_true",
                    help="also run the raw FP8 plan without tensor groups (one refit staging every tensor's "
                         "quantization at once, over the cap): what the groups cost in time")
    args = ap.parse_args(argv)
    console = Console(width=max(Console().width, 180))
    print_header(console, "benchmarks/bench_fp8.py", argv)
    table = Table(title=f"BF16 -> BF16 vs BF16 -> FP8 (e4m3, 128x128 block scales) without and with block "
                        f"assembly, {args.layers}-layer {DEMO_MODEL}, gloo on this CPU, max_bucket_bytes "
                        f"{args.bucket / MiB:g} MiB (measured; median of {args.repeat})")
    cols = ("config", "destination", "wire MiB", "fp8 / scales / raw bf16 / other MiB", "assembly MiB",
            "peak staging MiB / all at once (groups)", "blocks src / asm / dst", "refit s", "assemble s", "quantize at source s", "quantize at destination s",
            "x bf16 time")
    for col in cols:
        table.add_column(col, justify="left" if col in ("config", "destination") else "right")
    ok = True
    for config in args.configs.split(","):
        (train, infer), = parse_configs(config)
        world = train.world + infer.world
        ranks = spawn_for_json(_worker, world, config, args.layers, args.repeat, args.domain, args.bucket,
                               args.all_at_once)
        kinds = KINDS + ((WHOLE,) if args.all_at_once else ())
        ok &= not any(r["bad"] for r in ranks)
        for r in ranks:
            for b in r["bad"]:
                console.print(f"[red]{b}", highlight=False)
        t = {k: _median_of_slowest(ranks, lambda r, k=k: r["times"][k], args.repeat) for k in kinds}
        r0 = ranks[0]
        table.add_row(config, "BF16", f"{r0['bf16_bytes'] / MiB:.1f}", f"- / - / - / {r0['bf16_bytes'] / MiB:.1f}",
                      "-", f"{max(r['bf16_peak'] for r in ranks) / MiB:.2f} / -", "-", f"{t['bf16']:.3f}", "-", "-", "-",
                      "1.00x")
        for kind in kinds[1:]:
            q = {s: _median_of_slowest(ranks, lambda r, s=s, kind=kind: r["quant"][kind][s], args.repeat)
                 for s in (ASSEMBLY_STEP, SOURCE_STEP, DESTINATION_STEP)}
            f = r0["fp8"][kind]
            w = f["by_path"]
            most, every = (max(r["fp8"][kind][k] for r in ranks) for k in ("peak", "all_at_once"))
            staged = f"{most / MiB:.2f} / {every / MiB:.2f} ({f['groups']})"
            table.add_row("", LABELS[kind], f"{f['bytes'] / MiB:.1f}",
                          " / ".join(f"{w[k] / MiB:.1f}" for k in ("fp8", "scales", "raw", "other")),
                          f"{f['assembly'] / MiB:.1f}", staged, " / ".join(f"{b:,}" for b in f["blocks"]),
                          f"{t[kind]:.3f}",
                          f"{q[ASSEMBLY_STEP]:.3f}" if f["assembly"] else "-", f"{q[SOURCE_STEP]:.3f}",
                          f"{q[DESTINATION_STEP]:.3f}", f"{t[kind] / t['bf16']:.2f}x", end_section=kind == kinds[-1])
    console.print(table)
    console.print("every destination byte verified after every run (FP8 against the reference quantizer)" if ok
                  else "[red]WRONG BYTES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
