"""Dump what the planner, the hierarchy, the cost model and the apps decide, for a fixed set of cases.

A refactor that moves code around must leave this dump identical. Run it before and after::

    python tools/dump_behaviour.py --out before.json
    ... move things ...
    python tools/dump_behaviour.py --out after.json --compare before.json

``tools/behaviour-reference.json`` is the dump of the current code; ``make test`` compares the
quick cases against it (``tests/test_behaviour_reference.py``). A change that means to alter
plans or figures regenerates it (``--out tools/behaviour-reference.json``) and says so.

Per case it records the plan fingerprint, the plan's figures, and a digest of every rank plan's
copies (sends, receives, local and fan-out copies with their rounds; a sample of ranks for the
cluster-scale cases); per `reshard simulate` row, every figure of the result; per CLI command, its
output with the timing lines left out. About five minutes on a 2-core machine (``--quick``: the
small cases only, about half a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import sys
import tempfile
import time

import torch

import reshard as rs
from reshard.apps.cli import main as cli_main
from reshard.apps.simulate import CASES, simulate_case, to_json
from reshard.frameworks.parallel import model_layouts
from reshard.modeling.cost import gather_broadcast_time_of, model_time, traffic_from_plan
from reshard.modeling.topology import Placement, Topology
from reshard.models import DEMO_MODEL, get_arch, tiny_arch
from reshard.planning.hierarchy import hierarchical_plan

MiB = 1 << 20


def digest(obj) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]


def rank_digest(plan, rank: int) -> str:
    part = plan.for_rank(rank)
    msgs = lambda ms: [(m.peer, m.round, [tuple(c) for c in m.copies]) for m in ms]  # noqa: E731
    return digest((msgs(part.sends), msgs(part.recvs), [tuple(c) for c in part.local],
                   [tuple(c) for c in part.fanout]))


def canonical_record(src, dst, ranks=None) -> dict:
    """Digests that do not depend on the order of the tensors in the layouts: every rank's copies of
    the plan without a staging cap (one message per pair, no copy split), sorted."""
    p = rs.plan(src, dst)
    ranks = sorted(set(src.ranks) | set(dst.ranks)) if ranks is None else ranks
    out = {"wire_bytes": p.wire_bytes, "pair_bytes": digest(sorted(p.pair_bytes.items()))}
    for r in ranks:
        part = p.for_rank(r)
        flat = lambda ms: sorted((m.peer, tuple(c)) for m in ms for c in m.copies)  # noqa: E731
        out[str(r)] = digest((flat(part.sends), flat(part.recvs), sorted(map(tuple, part.local)),
                              sorted(map(tuple, part.fanout))))
    return out


def plan_record(p, ranks=None) -> dict:
    """Fingerprint, figures and per-rank digests of one plan (``ranks``: which; default all)."""
    all_ranks = sorted(set(p.source.ranks) | set(p.destination.ranks))
    ranks = all_ranks if ranks is None else ranks
    return {
        "fingerprint": p.fingerprint(), "wire_bytes": p.wire_bytes, "local_bytes": p.local_bytes,
        "pair_bytes": digest(sorted(p.pair_bytes.items())), "quotas": digest(sorted(p.quotas.items())),
        "tensor_wire_bytes": digest(sorted(p.tensor_wire_bytes().items())),
        "send_balance": repr(p.send_balance), "pieces": p.num_pieces, "tensors": len(p.tensors),
        "ranks": {str(r): rank_digest(p, r) for r in ranks},
    }


def phases_record(h, ranks=None) -> dict:
    out = {name: plan_record(p, ranks) for name, p in zip(h.phase_names, h.phases)}
    out["cross_domain_bytes"] = digest(sorted(h.cross_domain_bytes.items()))
    out["fingerprint"] = h.fingerprint()
    return out


def sample(ranks: list[int], n: int = 24) -> list[int]:
    step = max(1, len(ranks) // n)
    return sorted(set(ranks[::step]) | {ranks[-1]})


def demo_domains(src_ranks, dst_ranks, size: int) -> dict[int, int]:
    """Pretend NVLink domains as `reshard demo --domain-size` makes them."""
    size = size or len(dst_ranks)
    if set(dst_ranks) & set(src_ranks):
        return {r: r // size for r in sorted(set(dst_ranks) | set(src_ranks))}
    out = {r: r // size for r in src_ranks}
    first = -(-len(src_ranks) // size)
    out.update({r: first + i // size for i, r in enumerate(dst_ranks)})
    return out


def demo_model_cases(quick: bool):
    """(name, source, destination, max_bucket_bytes) of the built-in demo model (demo and bench)."""
    base = get_arch(DEMO_MODEL)
    cases = [("demo 4->tp2xdp2", base, 4, 2, 2, {}), ("demo colocated", base, 4, 2, 2, {"colocate": True}),
             ("demo fp32 source", base.with_overrides(layers=3), 3, 2, 1, {"source_dtype": torch.float32})]
    for m, tp, dp in ((2, 2, 1), (4, 4, 1), (4, 2, 2), (2, 4, 1), (4, 2, 1)):  # bench_refit's configurations
        cases.append((f"bench {m}->{tp * dp} tp{tp}xdp{dp}", base.with_overrides(layers=14), m, tp, dp, {}))
    if not quick:
        for m, tp, dp in ((64, 8, 8), (128, 8, 16)):  # bench_refit's planner section
            cases.append((f"planner {m}->{tp * dp}", base, m, tp, dp, {}))
    for name, arch, m, tp, dp, kw in cases:
        lay = model_layouts(arch, f"fsdp:dp{m}", f"dtensor:tp{tp},dp{dp}", **kw)
        yield name, lay.source, lay.destination, 64 * MiB


def named_model_cases():
    """`reshard demo --model` configurations: tiny presets with real framework layouts."""
    for model, train, infer in (("qwen3-30b-a3b", "tp1,ep2", "tp2"), ("deepseek-v3", "tp1,ep2", "tp2"),
                                ("qwen3-8b", "fsdp:dp2,tp2", "tp2,dp2"), ("llama-3-8b", "tp2,pp2", "tp4"),
                                ("kimi-k2", "tp2,ep2,pp2", "tp2,dp2,ep")):
        lay = model_layouts(tiny_arch(model), train, infer)
        yield f"tiny {model} {train} -> {infer}", lay.source, lay.destination, 64 * MiB


def cli_output(argv: list[str]) -> list[str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli_main(argv)
    lines = [ln.rstrip() for ln in buf.getvalue().splitlines()
             if " built in " not in ln and "planned in" not in ln and not ln.startswith("wrote ")]
    return [f"exit {code}"] + lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--compare", default=None, help="a previous dump: print what differs, exit 1 if anything")
    ap.add_argument("--quick", action="store_true", help="small cases only")
    args = ap.parse_args(argv)
    os.environ["COLUMNS"] = "80"  # the CLI's tables, as wide on every machine
    out: dict = {}
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    for name, src, dst, cap in list(demo_model_cases(args.quick)) + list(named_model_cases()):
        p = rs.plan(src, dst, max_bucket_bytes=cap)
        ranks = sorted(set(src.ranks) | set(dst.ranks))
        big = len(ranks) > 64
        rec = {"plan": plan_record(p, sample(ranks) if big else None),
               "canonical": canonical_record(src, dst, sample(ranks) if big else None),
               "gather_broadcast_bytes": rs.gather_broadcast_bytes(p)}
        topo = Topology.preset("cpu")
        colocated = bool(set(src.ranks) & set(dst.ranks))
        place = Placement.contiguous(topo, len(src.ranks), len(dst.ranks), colocated=colocated)
        if not big:
            rec["cpu_model_s"] = repr(model_time(traffic_from_plan(p, place, topo), topo).seconds)
        rec["cpu_gather_broadcast_s"] = repr(gather_broadcast_time_of(p, place, topo).seconds)
        for size in (0, 2):
            h = hierarchical_plan(src, dst, demo_domains(list(src.ranks), list(dst.ranks), size),
                                  max_bucket_bytes=cap)
            rec[f"hierarchical domain_size={size}"] = phases_record(h, sample(ranks) if big else None)
        out[name] = rec
        log(name)

    # the library tour's hierarchical example (README)
    w, b = rs.TensorSpec("w", (10, 6), torch.float32), rs.TensorSpec("b", (6,), torch.float32)
    src = rs.Layout.merge([
        rs.Layout.from_placements(w, [0, 1, 2, 3], (2, 2), [rs.Shard(0), rs.Replicate()], split="chunk"),
        rs.Layout.from_placements(b, [0, 1, 2, 3], (4,), [rs.Shard(0)])])
    dst = rs.Layout.merge([
        rs.Layout.from_placements(w, [4, 5, 6], (3,), [rs.Shard(1)], dtype=torch.bfloat16),
        rs.Layout.from_placements(b, [4, 5, 6], (3,), [rs.Replicate()])])
    out["readme tour"] = {"plan": plan_record(rs.plan(src, dst, max_bucket_bytes=1 << 20)),
                          "hierarchical": phases_record(hierarchical_plan(
                              src, dst, {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1}, max_bucket_bytes=1 << 20))}

    commands = [["plan", "--model", "qwen3-30b-a3b", "--train", "ep8,pp2", "--infer", "tp8,dp2"],
                ["plan", "--model", "qwen3-8b", "--train", "fsdp:dp8,tp2", "--infer", "tp4,dp2",
                 "--max-bucket-mb", "64"]]
    if not args.quick:
        commands.append(["plan", "--model", "deepseek-v3", "--train", "tp1,ep16,pp4,dp2", "--infer", "tp8,dp16"])
    with tempfile.TemporaryDirectory() as tmp:
        commands.append(["plan", "--model", "qwen3-30b-a3b", "--train", "ep8,pp2", "--infer", "tp8,dp2",
                         "--plot", tmp])
        commands.append(["plan", "--model", "qwen3-8b", "--train", "tp2,pp2", "--infer", "tp4", "--plot", tmp,
                         "--topology", "cpu", "--max-bucket-mb", "16"])
        for argv_ in commands:
            out["cli " + " ".join(argv_[:8])] = cli_output(argv_)
            log(" ".join(argv_[:8]))

    if not args.quick:
        for model, train, infer in (("deepseek-v3", "tp1,ep16,pp4,dp2", "tp8,dp16"),
                                    ("kimi-k2", "tp1,ep32,pp4,dp2", "tp8,dp16")):
            lay = model_layouts(model, train, infer)
            p = rs.plan(lay.source, lay.destination)
            ranks = sorted(set(lay.source.ranks) | set(lay.destination.ranks))
            out[f"scale {model}"] = {"plan": plan_record(p, sample(ranks, 12))}
            log(f"scale {model}")
        for case in CASES:
            r = simulate_case(case)
            out[f"simulate {case.key}"] = to_json(r)
            log(f"simulate {case.key}")

    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    log(f"wrote {args.out}")
    if args.compare:
        with open(args.compare) as f:
            ref = json.load(f)
        if args.quick:  # the quick cases only
            ref = {k: v for k, v in ref.items() if k in out}
        diffs = list(compare(ref, json.loads(json.dumps(out)), ""))
        for d in diffs[:60]:
            print(d)
        print(f"{len(diffs)} difference(s) against {args.compare}" if diffs else f"identical to {args.compare}")
        return 1 if diffs else 0
    return 0


def compare(a, b, path: str):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                yield f"{path}/{k}: only in {'the reference' if k in a else 'this run'}"
            else:
                yield from compare(a[k], b[k], f"{path}/{k}")
    elif a != b:
        yield f"{path}: {a!r} != {b!r}"


if __name__ == "__main__":
    sys.exit(main())
