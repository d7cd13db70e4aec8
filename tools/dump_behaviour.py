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
output with the timing lines left out. Then, in ``--quick`` too (a few seconds, plus vLLM's import):

    "session ..."          refit sessions in this one process (a world-size-1 gloo group; rank 0
                           holds both sides): the method chosen, the plan's type, phases and
                           fingerprint, the executor's options, each of two refits' byte, round and
                           message figures (no times) and the destination's bytes; the errors of
                           bad connect options
    "fault scenario ..."   the fault suites' random scenarios, drawn, never run: their fields and
                           description, the layouts' ranks and tensors and the plan between them
                           (``reshard.apps.fault_suite``; "fault scenario vllm": those of
                           ``benchmarks/bench_faults_vllm.py``)
    "vllm init ..."        the vLLM backend's init infos: fields, engine ranks, the workers' init
                           infos, the errors of bad values (imports vLLM, once)

About 4 minutes on a quiet 2-core machine (220 s measured; 975 s once with other jobs running and
older code; ``--quick``: the small cases only, about ten seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import io
import json
import os
import pathlib
import random
import socket
import sys
import tempfile
import time
from datetime import timedelta

import torch

import reshard as rs
from reshard.apps.cli import main as cli_main
from reshard.apps.simulate import CASES, simulate_case, to_json
from reshard.frameworks.parallel import model_layouts
from reshard.modeling.topology import Placement, Topology
from reshard.models import DEMO_MODEL, get_arch, tiny_arch
from reshard.planning.hierarchy import hierarchical_plan
from reshard.refit import RefitSession, Side

try:  # reshard.modeling split by idea (issue 18)
    from reshard.modeling.baseline_time import gather_broadcast_time_of
    from reshard.modeling.reshard_time import model_time
    from reshard.modeling.traffic import traffic_from_plan
except ImportError:  # before the split: one cost module (the dump of the code before the refactor)
    from reshard.modeling.cost import gather_broadcast_time_of, model_time, traffic_from_plan

try:
    from reshard.execution.process_group import free_port
except ImportError:  # moved: any free loopback port will do for a one-process group
    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

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


# ---------------------------------------------------------------------------- refit sessions
# One process, a world-size-1 gloo group: rank 0 holds the source side and the destination side.
ATTENTION = "model.layers.0.self_attn.q_proj.weight"  # the hybrid's default rule: by gather-and-broadcast
FFN = "model.layers.0.mlp.up_proj.weight"  # the hybrid's default rule: by reshard
NORM = "model.norm.weight"


def whole_on_rank0(spec, dtype=None):
    """``spec`` held whole by rank 0 (in ``dtype``, default its own)."""
    return rs.Layout.from_placements(spec, [0], (1,), [rs.Replicate()], dtype=dtype)


def fixed_value(spec) -> torch.Tensor:
    """A fixed, exactly representable value of ``spec`` (in its dtype)."""
    numel = 1
    for size in spec.shape:
        numel *= size
    salt = sum(map(ord, spec.name)) % 31
    return ((torch.arange(numel, dtype=torch.float32) % 61 - 30 + salt) / 8).reshape(spec.shape).to(spec.dtype)


def separate_layouts(source_dtype, destination_dtype):
    """An attention weight, an FFN weight and a norm: one buffer each, on both sides."""
    specs = [rs.TensorSpec(ATTENTION, (16, 8), source_dtype), rs.TensorSpec(FFN, (24, 8), source_dtype),
             rs.TensorSpec(NORM, (8,), source_dtype)]
    source = rs.Layout.merge([whole_on_rank0(spec) for spec in specs])
    destination = rs.Layout.merge([whole_on_rank0(spec, destination_dtype) for spec in specs])
    return specs, source, destination


def fused_layouts():
    """q, k and v (bf16) in three source buffers, stacked into one destination buffer ``qkv``."""
    rows = {"q": 8, "k": 4, "v": 4}
    specs = [rs.TensorSpec(f"model.layers.0.self_attn.{name}_proj.weight", (n, 6), torch.bfloat16)
             for name, n in rows.items()]
    source = rs.Layout.merge([whole_on_rank0(spec) for spec in specs])
    pieces, first = [], 0
    for spec in specs:
        pieces.append(rs.Piece(spec.name, (0, 0), spec.shape, "qkv", (first, 0), 0))
        first += spec.shape[0]
    destination = rs.Layout.from_pieces(specs, pieces, {0: {"qkv": ((first, 6), torch.bfloat16)}})
    return specs, source, destination


def fp8_layouts():
    """One bf16 FFN weight of whole 128 x 128 blocks, into a block-FP8 engine."""
    spec = rs.TensorSpec("model.layers.0.mlp.down_proj.weight", (128, 256), torch.bfloat16)
    return [spec], whole_on_rank0(spec), whole_on_rank0(spec)


SESSION_CASES = {  # name: (layouts, the destination's buffers: "layout" or "fp8")
    "fp32 -> bf16": (lambda: separate_layouts(torch.float32, torch.bfloat16), "layout"),
    "bf16 fused qkv": (fused_layouts, "layout"),
    "fp8 engine": (fp8_layouts, "fp8"),
}
SESSION_RUNS = {  # case: [(label, connect options)]
    "fp32 -> bf16": [("auto", {}), ("reshard", {"method": "reshard"}),
                     ("reshard 64 B buckets", {"method": "reshard", "max_bucket_bytes": 64}),
                     ("hierarchical one domain", {"method": "hierarchical", "domains": {0: 0}}),
                     ("hybrid", {"method": "hybrid"}),
                     ("hybrid rule norm", {"method": "hybrid", "hybrid_rule": [r"norm"]}),
                     ("gather-broadcast", {"method": "gather-broadcast"}),
                     ("auto checksum", {"checksum": True})],
    "bf16 fused qkv": [("auto", {}), ("hybrid", {"method": "hybrid"}),
                       ("gather-broadcast", {"method": "gather-broadcast"})],
    "fp8 engine": [("auto fp8", {"precision": "fp8"}),
                   ("reshard fp8 4 KiB buckets", {"method": "reshard", "precision": "fp8", "max_bucket_bytes": 4096})],
}


def tensor_digest(tensors: dict) -> str:
    """Digest of named tensors' bytes, dtypes and shapes."""
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous()
        hasher.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        hasher.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:16]


def refit_stats_record(stats) -> dict:
    """The figures of one refit that do not depend on time."""
    figures = ("sent_bytes", "recv_bytes", "local_bytes", "peak_staging_bytes", "rounds", "messages")
    return {"sent_bytes": stats.sent_bytes, "recv_bytes": stats.recv_bytes,
            "peak_staging_bytes": stats.peak_staging_bytes, "in_place_bytes": stats.in_place_bytes,
            "reprocessed_bytes": stats.reprocessed_bytes, "version": repr(stats.version),
            "rounds": stats.run.rounds, "messages": stats.run.messages, "local_bytes": stats.run.local_bytes,
            "phases": [[phase.name] + [getattr(phase, f) for f in figures] for phase in stats.run.phases]}


def session_sides(case: str):
    """Fresh (source, destination) sides of a session case, both on rank 0."""
    make_layouts, buffers = SESSION_CASES[case]
    specs, source, destination = make_layouts()
    values = {spec.name: fixed_value(spec) for spec in specs}
    held = rs.precision_layout(destination, "fp8") if buffers == "fp8" else destination
    return (Side.from_layout(source, 0, source.materialize(0, values)),
            Side.from_layout(destination, 0, held.empty_buffers(0)))


def session_record(case: str, options: dict) -> dict:
    """Connect a session of ``case`` with ``options``, refit twice, record what it chose and did."""
    source, destination = session_sides(case)
    session = RefitSession.connect(source=source, destination=destination, store_addr=f"127.0.0.1:{free_port()}",
                                   rank=0, world_size=1, backend="gloo", **options)
    try:
        rec = {"method": session.method, "plan": type(session.plan).__name__,
               "phases": list(session.plan.phase_names), "fingerprint": session.plan.fingerprint(),
               "executor options": json.loads(json.dumps(session.executor.options, default=repr)),
               "state": session.state}
        for version in (1, 2):
            stats = session.refit(version)
            rec[f"refit {version}"] = refit_stats_record(stats)
            rec[f"refit {version} destination"] = tensor_digest(dict(destination.tensors))
            for t in source.tensors.values():
                t.mul_(2)
        rec["after"] = {"state": session.state, "version": repr(session.version)}
    finally:
        session.close()
    return rec


BAD_CONNECT_OPTIONS = {
    "unknown method": {"method": "bogus"},
    "hybrid_rule with method reshard": {"method": "reshard", "hybrid_rule": [r"mlp"]},
    "precision with gather-broadcast": {"method": "gather-broadcast", "precision": "fp8"},
    "precision with hybrid": {"method": "hybrid", "precision": "fp8"},
    "unknown precision": {"precision": "fp4"},
    "max_bucket_bytes=0": {"max_bucket_bytes": 0},
    "negative rank": {"rank": -1},
    "rank outside world_size": {"rank": 2, "world_size": 2},
    "store_addr without rank": {"rank": None},
    "zero timeout": {"timeout": timedelta(0)},
}


def connect_error(options: dict) -> list[str]:
    """``[error type, message]`` of connecting with bad ``options`` (they fail before any connection:
    no store listens at port 1)."""
    kwargs = {"store_addr": "127.0.0.1:1", "rank": 0, "world_size": 1, **options}
    try:
        RefitSession.connect(**kwargs).close()
    except Exception as e:  # noqa: BLE001 - the error is what is recorded
        return [type(e).__name__, str(e)]
    return ["no error", ""]


def session_records() -> dict:
    out = {}
    for case, runs in SESSION_RUNS.items():
        for label, options in runs:
            out[f"session {case} {label}"] = session_record(case, options)
    out["session connect errors"] = {name: connect_error(options) for name, options in BAD_CONNECT_OPTIONS.items()}
    return out


# ---------------------------------------------------------------------------- vLLM init infos
TRAINER_INFOS = {  # name: ReshardTrainerInitInfo fields
    "one engine": dict(rank=0, master_address="10.0.0.1", master_port=29600, num_trainer_ranks=2, world_size=4),
    "two engines hybrid": dict(rank=1, master_address="10.0.0.2", master_port=29601, num_trainer_ranks=2,
                               world_size=7, engine_world_sizes=[2, 3], method="hybrid",
                               hybrid_patterns=[r"mlp\.", r"experts"], checksum=True, max_bucket_bytes=1 << 20,
                               timeout_s=12.5, comm_backend="gloo", pause_mode="wait", engine_grace_s=0),
    "gather-broadcast no pause": dict(rank=0, master_address="localhost", master_port=1234, world_size=3,
                                      method="gather-broadcast", pause_mode=None, max_bucket_bytes=None),
}
BAD_TRAINER_INFOS = {
    "timeout_s=0": {"timeout_s": 0},
    "timeout_s=inf": {"timeout_s": float("inf")},
    "engine_grace_s<0": {"engine_grace_s": -1},
    "unknown method": {"method": "bogus"},
    "hybrid_patterns with reshard": {"method": "reshard", "hybrid_patterns": ["mlp"]},
    "bad hybrid pattern": {"method": "hybrid", "hybrid_patterns": ["("]},
    "rank outside the trainer": {"rank": 2},
    "no inference rank": {"world_size": 2},
    "engine sizes do not add up": {"engine_world_sizes": [1, 2]},
    "empty engine": {"engine_world_sizes": [2, 0], "world_size": 4},
    "unknown pause mode": {"pause_mode": "sometimes"},
}
BAD_WORKER_INFOS = {
    "engine_index outside": {"engine_index": 2},
    "negative engine_index": {"engine_index": -1},
}


def init_info_fields(info) -> dict:
    """An init info's fields as JSON (its dataclass fields, and its class's backend name)."""
    out = json.loads(json.dumps(dataclasses.asdict(info), default=repr))
    out["backend"] = getattr(type(info), "backend", None)
    return out


def value_error(make) -> list[str]:
    """``[error type, message]`` of ``make()`` (``["no error", ""]`` when it builds)."""
    try:
        make()
    except Exception as e:  # noqa: BLE001 - the error is what is recorded
        return [type(e).__name__, str(e)]
    return ["no error", ""]


REFIT_FIELDS = {"method": "method", "max_bucket_bytes": "max_bucket_bytes", "checksum": "checksum",
                "timeout_s": "timeout_s", "hybrid_patterns": "hybrid_rule"}  # the init info's old flat fields


def trainer_info(trainer_cls, fields: dict):
    """The init info of ``fields``, in the form the code takes: since issue 18 the refit's options go in
    one ``options`` field (RefitOptions JSON), before it they were flat fields."""
    if "options" in {f.name for f in dataclasses.fields(trainer_cls)}:
        refit = {REFIT_FIELDS[k]: v for k, v in fields.items() if k in REFIT_FIELDS}
        fields = {**{k: v for k, v in fields.items() if k not in REFIT_FIELDS}, "options": refit}
    return trainer_cls(**fields)


def trainer_info_record(trainer_cls, worker_cls, fields: dict) -> dict:
    info = trainer_info(trainer_cls, fields)
    rec = {"fields": init_info_fields(info), "engine_sizes": info.engine_sizes, "rank_offsets": info.rank_offsets,
           "engine_ranks": [info.engine_ranks(i) for i in range(len(info.engine_sizes))]}
    worker = info.worker_init_info()
    rec["worker_init_info"] = worker
    rec["worker infos"] = [init_info_fields(worker_cls(**worker, engine_index=i))
                           for i in range(len(info.engine_sizes))]
    return rec


def vllm_init_records() -> dict:
    """The vLLM backend's init infos (imports vLLM, once: 10-20 s)."""
    try:
        from reshard.integrations.vllm import (BroadcastTrainerInitInfo, ReshardTrainerInitInfo,
                                               ReshardWeightTransferInitInfo)
    except ImportError as e:
        return {"vllm init": f"not recorded: {type(e).__name__}: {e}"}
    out = {f"vllm init trainer {name}": trainer_info_record(ReshardTrainerInitInfo, ReshardWeightTransferInitInfo,
                                                            fields)
           for name, fields in TRAINER_INFOS.items()}
    base = TRAINER_INFOS["one engine"]
    out["vllm init trainer errors"] = {name: value_error(lambda bad=bad: trainer_info(ReshardTrainerInitInfo, {**base, **bad}))
                                       for name, bad in BAD_TRAINER_INFOS.items()}
    worker = trainer_info(ReshardTrainerInitInfo, base).worker_init_info()
    out["vllm init worker errors"] = {
        name: value_error(lambda bad=bad: ReshardWeightTransferInitInfo(**{**worker, **bad}))
        for name, bad in BAD_WORKER_INFOS.items()}
    broadcast = BroadcastTrainerInitInfo(rank=0, master_address="10.0.0.3", master_port=29700,
                                         engine_world_sizes=[2, 1], wire_dtype="bfloat16")
    out["vllm init broadcast"] = {"fields": init_info_fields(broadcast),
                                  "worker_init_info": broadcast.worker_init_info(),
                                  "worker infos": [init_info_fields(ReshardWeightTransferInitInfo(
                                      **broadcast.worker_init_info(), engine_index=i)) for i in range(2)]}
    return out


# ---------------------------------------------------------------------------- fault-suite scenarios
def layouts_summary(source, destination) -> dict:
    """What a scenario's layouts are: ranks, tensors, and the plan between them."""
    plan = rs.plan(source, destination)
    return {"source ranks": list(source.ranks), "destination ranks": list(destination.ranks),
            "tensors": [[spec.name, list(spec.shape), str(spec.dtype)] for spec in source.tensors],
            "fingerprint": plan.fingerprint(), "wire_bytes": plan.wire_bytes, "local_bytes": plan.local_bytes,
            "source": digest(sorted(map(tuple, source.all_pieces()))),
            "destination": digest(sorted(map(tuple, destination.all_pieces())))}


def fault_scenario_records() -> dict:
    """``reshard.apps.fault_suite``'s random scenarios (drawn, never run): each seed's first four, as the
    suite draws them from one generator, and index 7 from a fresh generator."""
    from reshard.apps.fault_suite import random_scenario, scenario_layouts

    out = {}
    for precision in (False, True):
        draws = [(seed, index, rng) for seed in (0, 1, 42) for rng in [random.Random(seed)] for index in range(4)]
        draws += [(seed, 7, random.Random(seed)) for seed in (3, 2024)]
        for seed, index, rng in draws:
            scenario = random_scenario(index, rng, precision=precision)
            fields = json.loads(json.dumps(dataclasses.asdict(scenario)))
            out[f"fault scenario seed={seed} #{index}{' fp8' if precision else ''}"] = {
                "describe": scenario.describe(), "fields": fields, "world": scenario.world,
                "layouts": layouts_summary(*scenario_layouts(scenario))}
    return out


def load_bench_faults_vllm():
    """``benchmarks/bench_faults_vllm.py`` as a module, without its edit of ``sys.path`` staying behind
    (None when the file is missing)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_faults_vllm.py"
    if not path.exists():
        return None
    name = "_dump_bench_faults_vllm"
    saved_path = list(sys.path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved_path
        del sys.modules[name]
    return module


def vllm_fault_scenario_records() -> dict:
    """The vLLM fault suite's random scenarios (two engine workers, three rounds; drawn, never run)."""
    bench = load_bench_faults_vllm()
    if bench is None:
        return {"fault scenario vllm": "not recorded: no benchmarks/bench_faults_vllm.py"}
    send_rounds = {0: [0, 2], 1: [1]}
    out = {}
    for seed in (0, 1, 42):
        rng = random.Random(seed)
        for index in range(6):
            engine_kill = index == 5
            kinds = ("corrupt", "raise") if index == 4 else bench.KINDS
            scenario = bench.random_scenario(index, rng, 2, 3, send_rounds, kinds=kinds, engine_kill=engine_kill)
            out[f"fault scenario vllm seed={seed} #{index}"] = {
                "describe": scenario.describe(), "fault": scenario.fault, "fields": dataclasses.asdict(scenario)}
    return out


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

    # refit sessions, drawn fault scenarios, and (last: it imports vLLM) the vLLM backend's init infos
    for section in (session_records, fault_scenario_records, vllm_fault_scenario_records, vllm_init_records):
        out.update(section())
        log(section.__name__)

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
