"""``reshard simulate``: modeled refit times of whole models at cluster scale, beside published figures.

For each case the real layouts are built (Megatron-Core or FSDP2 training, vLLM inference), planned
twice, and the plans' bytes per link fed to the cost model (:mod:`reshard.modeling.pipeline`):

    ours, hierarchical   each NVLink domain takes what it lacks over the network once
                         (from a source, or relayed by another domain when the sources hold
                         too few copies), then forwards over NVLink (:mod:`reshard.planning.hierarchy`)
    ours, direct         one point-to-point phase, every destination from a source
    hybrid               NeMo RL's split: FFN and expert weights by reshard, the rest by packed broadcast
    gather-broadcast     as its best implementations run it: per pipeline stage gathers, NCCL
                         broadcast at a node's aggregate NIC bandwidth, buckets overlapped; "naive":
                         everything through one training GPU, as the figures before this model
    lower bound          the slowest of: each domain's unique network ingress over all its NICs
                         (``lower_bound_job_s``: over the NICs of the GPUs the job uses), the
                         sources' egress, the bytes one source alone holds (allowed one NVLink hop
                         before a NIC), each GPU's need
    ours pipelined       the hierarchical plan in its pipelined order (NVLink forward of chunk c
                         beside the network transfer of chunk c+1); "ours" is the faster order
    ours / job bound     ours over ``lower_bound_job_s``: what a refit that only uses the job's
                         GPUs can reach. A job filling 56 of an NVL72 rack's 72 GPUs cannot come
                         within 72/56 = 1.29x of the every-NIC bound, whatever its plan

Engines: a vLLM spec ``tp32,dp8`` is one deployment with ``data_parallel_size=8`` (its MoE
layers spread over all 256 ranks); ``tp32,dp8,independent`` is 8 separate engines, each holding
the whole model, as most RL stacks (NeMo RL among them) run them. Rows follow the published
arrangement where the source states it, and say where our model of a row still differs from
the published setup. A layout whose weights alone exceed a GPU's memory is reported as not
fitting, without a time.

Destination precision: each row in its case's precision (the Kimi-K2 rows FP8, as published;
the others the engine's BF16), or every row in ``--precision bf16|fp8``. With FP8 (e4m3, one
scale per 128 x 128 block, :meth:`~reshard.planning.precision.DtypePolicy.fp8`'s keep-list),
reshard's rows and the lower bound model the FP8 plan's wire (blocks a source holds whole
cross quantized, the others in BF16, quantized on the destination); the baselines move BF16
whole and the engine quantizes on load (what vLLM does with BF16 weights for an FP8 model).
Quantizing's compute time is not modeled. A layout FP8 cannot take (a destination split
through a block) is reported in its row, like one that does not fit.

Inference ranks start on a fresh NVLink domain (``infer_start="domain"``): training and
inference pools on separate machines, as in the published setups. Pure: no process group.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..forked import Forked, forked
from ..frameworks.parallel import InferParallel, ModelLayouts, TrainParallel, model_layouts
from ..gc_pause import without_gc
from ..layout import Layout
from ..models import get_arch
from ..modeling.pipeline import RefitModel
from ..modeling.topology import Placement, Topology
from ..planning.precision import DtypePolicy, PrecisionPlan, precision_layout
from ..tensors import LayoutError

GiB = 1 << 30
NEMO = "NeMo RL refit on H100"
M2N = "NCCL M2N resharding on GB200"


@dataclass(frozen=True)
class Case:
    """One row: a model, both parallel configurations, a machine, and what was published."""

    key: str
    model: str
    train: str
    infer: str
    topology: str
    published: str  # the figure as reported, for the table
    published_s: tuple[float, ...] = ()  # seconds to compare with (one figure or a range)
    source: str = ""
    differs: str = ""  # where this row's model differs from the published setup
    precision: str = "bf16"  # destination precision unless --precision says otherwise: bf16 (the engine's) or fp8


PRECISIONS = ("bf16", "fp8")
KIMI = "Kimi-K2 checkpoint engine"
KIMI_PUBLISHED = "1.3 s (point-to-point RDMA design)"
MOE_2048_PUBLISHED = "modeled, not published (the 4.3 s 2.4 T refit is a smaller arrangement)"
MOE_2048_SOURCE = "issue 22: the 2.4 T MoE into 2,048 inference GPUs"
MOE_2048_DIFFERS = (
    "no published setup: modeled only. Two expert-parallel deployments of 1024 GPUs each "
    "(tp8,dp128,ep,deployments2), each holding the whole model with one expert per GPU: one deployment of 2048 "
    "would give vLLM an EP size of 2048 over 1024 experts, and its expert map then leaves half the GPUs without "
    "a routed expert. Training stays on 1024 GPUs (tp1,ep64,pp16, as moe2.4t-h100), so the refit sends every "
    "expert to two GPUs. NVIDIA's 4.3 s (refit only) is for a different, smaller arrangement, not this one")


CASES = (
    Case("dsv3-gb200", "deepseek-v3", "tp1,cp1,ep16,dp2,pp4", "tp8,dp16", "gb200-nvl72",
         "NCCL M2N: hierarchical 1447 ms, direct 3838 ms", (1.447,), M2N,
         "engine arrangement not stated in our source: modeled as one deployment (dp16)"),
    Case("dsv3-gb200-engines", "deepseek-v3", "tp1,cp1,ep16,dp2,pp4", "tp8,dp16,independent", "gb200-nvl72",
         "NCCL M2N: hierarchical 1447 ms, direct 3838 ms", (1.447,), M2N,
         "engine arrangement not stated in our source: modeled as 16 independent engines"),
    Case("qwen235-gb200", "qwen3-235b-a22b", "tp2,cp2,ep16,pp4", "tp8,dp8", "gb200-nvl72",
         "NCCL M2N: hierarchical 989 ms, direct 2175 ms", (0.989,), M2N,
         "engine arrangement not stated in our source: modeled as one deployment (dp8)"),
    Case("qwen235-gb200-engines", "qwen3-235b-a22b", "tp2,cp2,ep16,pp4", "tp8,dp8,independent", "gb200-nvl72",
         "NCCL M2N: hierarchical 989 ms, direct 2175 ms", (0.989,), M2N,
         "engine arrangement not stated in our source: modeled as 8 independent engines"),
    Case("dsv3-h100", "deepseek-v3", "pp16,ep16", "tp32,dp8,independent", "dgx-h100",
         "NeMo RL: 2.39-2.83 s", (2.39, 2.83), NEMO),
    Case("dsv3-h100-1dep", "deepseek-v3", "pp16,ep16", "tp32,dp8", "dgx-h100",
         "NeMo RL: 2.39-2.83 s", (2.39, 2.83), NEMO,
         "not the published arrangement: one deployment (dp8) instead of 8 engines"),
    Case("qwen30-h100", "qwen3-30b-a3b", "ep8,pp2", "tp8,dp2,independent", "dgx-h100",
         "NeMo RL: 0.74-1.00 s", (0.74, 1.00), NEMO),
    Case("qwen30-h100-1dep", "qwen3-30b-a3b", "ep8,pp2", "tp8,dp2", "dgx-h100",
         "NeMo RL: 0.74-1.00 s", (0.74, 1.00), NEMO,
         "not the published arrangement: one deployment (dp2) instead of 2 engines"),
    Case("kimi-h100", "kimi-k2", "fsdp:dp256", "tp8,dp16,ep", "dgx-h100", KIMI_PUBLISHED, (1.3,), KIMI,
         "FSDP shard count and engine arrangement not stated in our source: FSDP2 over 256 GPUs (fsdp:dp256); "
         "one expert-parallel deployment (tp8,dp16,ep), since 16 independent TP8 engines do not fit and "
         "splitting the experts over 128 ranks by TP (16 rows) cuts FP8 blocks", precision="fp8"),
    Case("kimi-h100-engines", "kimi-k2", "fsdp:dp256", "tp8,dp16,independent", "dgx-h100", KIMI_PUBLISHED,
         (1.3,), KIMI, "FSDP shard count not stated in our source: fsdp:dp256; 16 independent TP8 engines",
         precision="fp8"),
    Case("moe2.4t-h100", "moe-2.4t", "tp1,ep64,pp16", "tp8,dp128,ep", "dgx-h100",
         "4.3 s (refit only, 2.4 T BF16 MoE)", (4.3,), "reported 2.4 T-parameter MoE refit",
         "engine arrangement not stated in our source: one deployment (128 TP8 engines cannot hold 4.8 TB)"),
    Case("moe2.4t-2048-h100", "moe-2.4t", "tp1,ep64,pp16", "tp8,dp128,ep,deployments2", "dgx-h100",
         MOE_2048_PUBLISHED, (), MOE_2048_SOURCE, MOE_2048_DIFFERS),
    Case("moe2.4t-2048-gb200", "moe-2.4t", "tp1,ep64,pp16", "tp8,dp128,ep,deployments2", "gb200-nvl72",
         MOE_2048_PUBLISHED, (), MOE_2048_SOURCE, MOE_2048_DIFFERS),
)
CLAIM = (2.7, 5.7)  # published speedup of reshard over gather-and-broadcast
METHODS = ("hierarchical", "direct", "hybrid", "gather_broadcast", "gather_broadcast_naive")


def rank_weight_bytes(layout: Layout) -> dict[int, int]:
    """Bytes of weights each rank holds (its pieces; padding not counted).

    >>> from reshard.frameworks.parallel import model_layouts
    >>> lay = model_layouts("qwen3-8b", "tp2", "tp4")
    >>> held = rank_weight_bytes(lay.destination)     # TP 4: a quarter of the model each, in GB
    >>> sorted(held) == lay.destination_ranks, round(max(held.values()) / 1e9, 2), round(lay.arch.nbytes / 4e9, 2)
    (True, 4.1, 4.1)
    """
    # (ranks and sizes arrays, bytes per element) -> [a table, its itemsizes, how many tensors]; tables
    # alike share their arrays, and every table stays alive while this runs: ids are unique
    alike: dict[tuple, list] = {}
    for name, t in layout.tables.items():
        if len(t):
            size = layout.buffer_itemsize(name)  # one dtype for all its pieces, known without a look at each
            found = None
            if size is None:
                found = layout.buffer_dtypes(name)
                size = found.uniform.itemsize if found.uniform is not None else None
            key = (id(t.ranks), id(t.sizes), size) if size is not None else (name,)
            hit = alike.get(key)
            if hit is None:
                alike[key] = [t, size if size is not None else found.itemsizes, 1]
            else:
                hit[2] += 1
    total = np.zeros(max(layout.ranks, default=-1) + 1, np.int64)
    for t, itemsizes, n in alike.values():
        np.add.at(total, t.ranks, np.prod(t.sizes, axis=1) * itemsizes * n)
    return {r: int(total[r]) for r in layout.ranks}


def fit(lay: ModelLayouts, topology: Topology, policy: DtypePolicy | None = None, *,
        held: Layout | None = None) -> str | None:
    """Why the weights alone do not fit a GPU of ``topology`` (None: they fit, or memory is unknown);
    ``policy``: the inference side holds its tensors in those precisions (FP8 weights and scales);
    ``held``: that layout already made (:func:`precision_layout`)."""
    if topology.gpu_memory_bytes is None:
        return None
    dst = held if held is not None else (lay.destination if policy is None else precision_layout(lay.destination, policy))
    for side, layout in (("training", lay.source), ("inference", dst)):
        held = rank_weight_bytes(layout)
        rank = max(held, key=held.get)
        if held[rank] > topology.gpu_memory_bytes:
            return (f"does not fit: {side} rank {rank} holds {held[rank] / 1e9:.0f} GB of weights, "
                    f"a {topology.name} GPU has {topology.gpu_memory_bytes / 1e9:.0f} GB")
    return None


def start_baselines(source: Layout, destination: Layout, topology: Topology, build: dict, *,
                    rounds_cap: int | None, bucket_bytes: int | None) -> Forked:
    """Fork a child that models two of :func:`model_figures`' baselines, the hybrid and the naive
    gather-and-broadcast, on a model of the same refit without its hierarchical plan (they need none;
    ``build``: the other keywords of :meth:`RefitModel.build`): pass it to ``model_figures(baselines=...)``.
    They are about half of what is left to model once the direct plan is made."""
    return forked(_baseline_estimates, source, destination, topology, build, rounds_cap, bucket_bytes)


def _baseline_estimates(source: Layout, destination: Layout, topology: Topology, build: dict,
                        rounds_cap: int | None, bucket_bytes: int | None) -> dict:
    model = RefitModel.build(source, destination, topology, plan_hierarchical=False, **build)
    model.hybrid(bucket_bytes, rounds_cap=rounds_cap)
    model.gather_broadcast(bucket_bytes, variant="naive")
    return model.baseline_estimates()


@without_gc
def model_figures(m: RefitModel, *, rounds_cap: int | None = 2 * GiB, bucket_bytes: int | None = GiB,
                  pipelined: bool = False, baselines: Forked | None = None) -> dict:
    """Every modeled figure of one refit: seconds per method, the bound and its binding term, bytes.

    ``rounds_cap``: the staging cap per GPU that sets reshard's rounds (default 2 GiB: two 1 GiB
    rounds in flight); ``bucket_bytes``: the
    broadcast buckets of gather-and-broadcast and of the hybrid's broadcast part; ``pipelined``: also
    model the hierarchical plan's pipelined order (``modeled_s["pipelined"]``; "ours" is then the
    faster order); ``baselines``: a forked child (:mod:`reshard.forked`) already modeling some of the
    baselines on another model of this refit, its result :meth:`RefitModel.baseline_estimates`, taken
    once reshard's own figures are done; the rest are modeled here.
    """
    modeled: dict[str, float | None] = dict.fromkeys(METHODS)
    bottleneck = "-"
    if m.hierarchical is not None:
        _, est = m.estimate(m.hierarchical, rounds_cap=rounds_cap, method="reshard hierarchical")
        modeled["hierarchical"] = est.seconds
        if pipelined:
            _, est_p = m.estimate(m.pipelined(), rounds_cap=rounds_cap, method="reshard pipelined")
            modeled["pipelined"] = est_p.seconds
            if est_p.seconds < est.seconds:  # the order reshard runs: whichever models faster (same copies)
                est = est_p
        bottleneck = est.bottleneck.describe() if est.bottleneck else "-"
    _, est_d = m.estimate(m.direct, rounds_cap=rounds_cap, method="reshard direct")
    modeled["direct"] = est_d.seconds
    if m.hierarchical is None:
        bottleneck = est_d.bottleneck.describe() if est_d.bottleneck else "-"
    bound = m.lower_bound()
    b = bound.binding
    job = m.lower_bound(ingress="job").seconds  # ingress over the job's NICs only
    if baselines is not None:
        m.adopt_estimates(baselines.result(here_if_dead=True))
    modeled["hybrid"] = m.hybrid(bucket_bytes, rounds_cap=rounds_cap).seconds
    modeled["gather_broadcast"] = m.gather_broadcast(bucket_bytes, variant="fair").seconds
    modeled["gather_broadcast_naive"] = m.gather_broadcast(bucket_bytes, variant="naive").seconds
    ours = min(x for x in (modeled["hierarchical"], modeled.get("pipelined")) if x) if m.hierarchical else modeled["direct"]
    ratio_job = ours / job if job else None
    binding = None
    if ratio_job is not None and ratio_job > 1.25:  # name the term that binds and why
        binding = (f"misses 1.25x of the job's bound ({ratio_job:.2f}x): our time is set by {bottleneck}, the "
                   f"bound by {f'{b.name} ({b.where})' if b else '-'}")
    return {
        "modeled_s": modeled,
        "lower_bound_s": bound.seconds,
        "lower_bound_term": f"{b.name} ({b.where})" if b else "-",
        "lower_bound_job_s": job,
        "ours_over_bound": ours / bound.seconds if bound.seconds else None,
        "ours_over_job_bound": ratio_job,
        "ours_s": ours,
        "binding_note": binding,
        "speedup": {k: modeled[k] / ours for k in ("hybrid", "gather_broadcast", "gather_broadcast_naive")},
        "bottleneck": bottleneck,
        "wire_bytes": m.direct.wire_bytes,
        "cross_domain_bytes": sum(m.hierarchical.cross_domain_bytes.values()) if m.hierarchical else None,
    }


def precision_figures(m: RefitModel) -> dict:
    """The FP8 plan's figures of a model built with a policy (empty without): wire bytes by precision
    (fp8 values, their scales, raw blocks in the source's precision, other tensors) and by dtype, and
    how many blocks are quantized at a source and at the destination."""
    pp = m.precision
    if pp is None:
        return {}
    paths = pp.tensor_paths().values()
    out = {"wire_bytes_by_precision": pp.wire_bytes_by_path(), "wire_bytes_by_dtype": pp.wire_bytes_by_dtype(),
           "fp8_tensors": len(pp.fp8), "blocks_at_source": sum(p["source"] for p in paths),
           "blocks_at_destination": sum(p["destination"] for p in paths)}
    if pp.assembly is not None:  # the local phase before the network: modeled on its own (NVLink, inside domains)
        out.update(blocks_assembled=sum(p["assembled"] for p in paths), assembly_bytes=pp.assembly_bytes,
                   assembly_s=m.estimate(pp.assembly)[1].seconds)
    return out


@dataclass
class Result:
    case: Case
    figures: dict | None  # model_figures(...); None when the setup does not fit
    does_not_fit: str | None
    plan_s: float  # wall time to build layouts and plans here
    notes: list[str] = field(default_factory=list)
    precision: str = "bf16"

    def seconds(self, method: str) -> float | None:
        return self.figures["modeled_s"][method] if self.figures else None

    @property
    def ours_s(self) -> float | None:
        return self.figures.get("ours_s") if self.figures else None

    @property
    def lower_bound_s(self) -> float | None:
        return self.figures["lower_bound_s"] if self.figures else None

    @property
    def ratio_to_bound(self) -> float:
        return self.figures["ours_over_bound"] if self.figures else float("nan")

    def speedup(self, baseline: str = "gather_broadcast") -> float:
        return self.figures["speedup"][baseline] if self.figures else float("nan")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return precision


def fp8_problem(lay: ModelLayouts) -> tuple[Layout | None, str | None]:
    """(the inference layout in FP8, None) or (None, why it cannot hold FP8 blocks: a split through a
    block, naming the tensor)."""
    try:
        return precision_layout(lay.destination, DtypePolicy.named("fp8")), None
    except LayoutError as e:
        return None, f"FP8 does not fit this layout: {e}"


@without_gc
def simulate_case(case: Case, *, max_bucket_bytes: int = 2 * GiB, gather_bucket_bytes: int | None = GiB,
                  topology: Topology | None = None, precision: str | None = None, second_core: bool = False) -> Result:
    """Build, plan and model one case (tens of seconds for the biggest) in ``precision`` (default: the
    case's own); ``second_core``: two baselines in a forked child meanwhile (:func:`start_baselines`)."""
    t0 = time.perf_counter()
    prec = check_precision(precision or case.precision)
    topo = topology or Topology.preset(case.topology)
    lay = model_layouts(case.model, case.train, case.infer)
    policy = None
    if prec == "fp8":
        held, problem = fp8_problem(lay)
        if problem is not None:
            return Result(case, None, problem, time.perf_counter() - t0, precision=prec)
        policy = DtypePolicy.named("fp8")
    reason = fit(lay, topo, held=held if policy is not None else None)
    if reason is not None:
        return Result(case, None, reason, time.perf_counter() - t0, precision=prec)
    placement = Placement.contiguous(topo, lay.train_world, lay.infer_world, infer_start="domain")
    pp = None  # FP8: blocks no training rank holds whole are assembled in their training domain first
    if policy is not None:
        pp = PrecisionPlan(lay.source, lay.destination, policy, held=held, assemble=dict(enumerate(
            placement.domain_of[:lay.train_world].tolist())))
    build = dict(placement=placement, policy=policy, precision=pp)
    if topo.gpus_per_domain == 1:
        raise ValueError(f"case {case.key}: topology {topo.name} has no NVLink domains of several GPUs")
    baselines = None
    if second_core:
        if pp is None:  # the direct plan, made once here: the baselines' child reads it instead of planning it again
            build["direct"] = RefitModel.build(lay.source, lay.destination, topo, plan_hierarchical=False,
                                               **build).direct
        baselines = start_baselines(lay.source, lay.destination, topo, build, rounds_cap=max_bucket_bytes,
                                    bucket_bytes=gather_bucket_bytes)
    with baselines or nullcontext():
        m = RefitModel.build(lay.source, lay.destination, topo, **build)
        plan_s = time.perf_counter() - t0
        figures = model_figures(m, rounds_cap=max_bucket_bytes, bucket_bytes=gather_bucket_bytes, pipelined=True,
                                baselines=baselines)
    figures.update(precision_figures(m))
    return Result(case, figures, None, plan_s, precision=prec)


ROW_MEMORY_BYTES = 6 * GiB  # about the most one row holds at once (moe2.4t-2048: 5.2 GB peak RSS measured)


def default_jobs(num_cases: int) -> int:
    """Rows simulated at once by default: one per core, as many as memory holds (a row can take
    :data:`ROW_MEMORY_BYTES`), at most one per case."""
    cores = _cores()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = ROW_MEMORY_BYTES
    return max(1, min(cores, memory // ROW_MEMORY_BYTES, num_cases))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def size_hint(case: Case) -> int:
    """A rough size of a row's planning work, to start the biggest rows first: tensors (layers x
    experts) x GPUs on both sides, twice for FP8 (a precision plan beside the BF16 one).

    >>> big, small = (next(c for c in CASES if c.key == k) for k in ("moe2.4t-h100", "qwen30-h100"))
    >>> size_hint(big) > size_hint(small)
    True
    """
    arch = get_arch(case.model)
    gpus = TrainParallel.parse(case.train).world + InferParallel.parse(case.infer).world
    return arch.layers * max(arch.experts, 1) * gpus * (2 if case.precision == "fp8" else 1)


def simulate_cases(cases, *, jobs: int = 1, on_result: Callable[[Result], None] | None = None,
                   **options) -> list[Result]:
    """:func:`simulate_case` of every case (``options`` as it takes them), in up to ``jobs``
    processes at once, the biggest rows first (:func:`size_hint`); results in the order of ``cases``.
    The figures do not depend on ``jobs``: each row is planned and modeled alone, as in one process.
    ``on_result``: called here with each row as soon as it is done (in the order they finish), so a
    caller can show the small rows while the big ones are still planned.

    A worker that dies (out of memory, killed) raises ``BrokenProcessPool`` here, naming no row's
    figures as done. The workers are spawned and import the calling script: call this from under
    ``if __name__ == "__main__":`` there (``reshard simulate`` does).
    """
    cases = list(cases)
    report = on_result or (lambda result: None)
    if jobs <= 1 or len(cases) <= 1:
        results = []
        spare = len(cases) == 1 and _cores() > 1  # one row: two of its baselines on another core
        for c in cases:
            results.append(simulate_case(c, second_core=spare, **options))
            report(results[-1])
        return results
    order = sorted(range(len(cases)), key=lambda i: -size_hint(cases[i]))
    # spawn, not fork: the parent has imported torch, whose thread pools a forked child must not inherit
    with ProcessPoolExecutor(min(jobs, len(cases)), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {i: pool.submit(simulate_case, cases[i], **options) for i in order}
        for done in as_completed(futures.values()):
            report(done.result())
        return [futures[i].result() for i in range(len(cases))]


def progress_line(r: Result, done: int, total: int, elapsed_s: float) -> str:
    """One line on a row just finished, for ``reshard simulate`` to print while the others run.

    >>> r = Result(CASES[0], None, "does not fit: ...", 1.5)
    >>> progress_line(r, 1, 13, 2.04)
    'dsv3-gb200 done (1/13, 2.0 s): does not fit: ...'
    """
    head = f"{r.case.key} done ({done}/{total}, {elapsed_s:.1f} s)"
    if r.figures is None:
        return f"{head}: {r.does_not_fit}"
    f = r.figures
    return (f"{head}: ours {f['ours_s']:.3f} s modeled ({f['ours_over_job_bound']:.2f}x the job's bound; "
            f"gather-and-broadcast {r.speedup():.1f}x as long)")


def _s(v: float | None, fmt: str = ".3f") -> str:
    return "-" if v is None else f"{v:{fmt}}"


def render(results: list[Result], console, title: str = "modeled refit time") -> None:
    from rich.table import Table

    t = Table(title=title)
    cols = ("case", "inference engines", "ours hier. s", "ours pipelined s", "ours direct s", "hybrid s", "gather-bcast s",
            "naive g-b s", "lower bound s", "ours / job-NIC bound", "ours / every-NIC bound", "speedup vs g-b / hybrid / naive", "published")
    for col in cols:
        t.add_column(col, justify="left" if col in ("case", "inference engines", "published") else "right")
    for r in results:
        c = r.case
        engines = "independent" if "independent" in c.infer else "one deployment"
        name = (f"{c.key}: {c.model} {c.train} -> {c.infer.replace(',independent', '')} {r.precision.upper()} "
                f"on {c.topology}")
        if r.figures is None:
            t.add_row(name, engines, "[red]does not fit", *[""] * 9, c.published)
            continue
        t.add_row(name, engines, _s(r.seconds("hierarchical")), _s(r.figures["modeled_s"].get("pipelined")),
                  _s(r.seconds("direct")), _s(r.seconds("hybrid")),
                  _s(r.seconds("gather_broadcast")), _s(r.seconds("gather_broadcast_naive"), ".2f"),
                  _s(r.lower_bound_s), f"{r.figures['ours_over_job_bound']:.2f}x", f"{r.ratio_to_bound:.2f}x",
                  f"{r.speedup():.1f}x / {r.speedup('hybrid'):.1f}x / {r.speedup('gather_broadcast_naive'):.0f}x",
                  c.published)
    console.print(t)
    for r in results:
        c = r.case
        lines = [f"differs from the published setup: {c.differs}"] if c.differs else []
        if r.figures is None:
            lines.append(r.does_not_fit)
        else:
            f = r.figures
            lines.append(f"bound set by {f['lower_bound_term']} (over the job's NICs only: "
                         f"{f['lower_bound_job_s']:.3f} s); our bottleneck: {f['bottleneck']}; "
                         f"{f['cross_domain_bytes'] / 1e9:,.0f} GB cross domains; planned in {r.plan_s:.1f} s")
            if f.get("binding_note"):
                lines.append(f["binding_note"])
            if "wire_bytes_by_precision" in f:
                lines.append(fp8_line(f))
        console.print(f"[bold]{c.key}[/]: " + "; ".join(lines), highlight=False)


def fp8_line(f: dict) -> str:
    """One line on an FP8 plan's wire (modeled): bytes by precision and where blocks are quantized."""
    w = f["wire_bytes_by_precision"]
    return (f"FP8 wire {f['wire_bytes'] / 1e9:,.1f} GB: fp8 {w['fp8'] / 1e9:,.1f}, scales {w['scales'] / 1e9:,.2f}, "
            f"raw bf16 {w['raw'] / 1e9:,.1f}, other {w['other'] / 1e9:,.1f} GB; blocks quantized at the source "
            f"{f['blocks_at_source']:,}, at the destination {f['blocks_at_destination']:,}; baselines move BF16 "
            f"and the engine quantizes on load (assumed); quantize compute not modeled")


def to_json(r: Result) -> dict:
    """A result as plain JSON (what ``reshard simulate --json`` writes per case)."""
    c = r.case
    out = {"case": c.key, "model": c.model, "train": c.train, "infer": c.infer, "topology": c.topology,
           "precision": r.precision,
           "published": c.published, "published_s": list(c.published_s), "differs": c.differs or None,
           "fits": r.figures is not None, "does_not_fit": r.does_not_fit}
    out.update(r.figures or {"modeled_s": dict.fromkeys(METHODS)})
    return out


def plot(results: list[Result], path: str | Path) -> Path:
    """Grouped bars per case that fits (ours in the faster order, the hybrid, gather-and-broadcast fair
    and naive, the lower bound), with the published figures as markers, on a log scale."""
    from ..modeling.plots import pyplot, save_figure

    plt = pyplot()

    results = [r for r in results if r.figures is not None]
    labels = [r.case.key for r in results]
    series = [("ours (the faster order)", [r.ours_s for r in results], "#2b7bba"),
              ("hybrid (NeMo RL)", [r.seconds("hybrid") for r in results], "#8fbde0"),
              ("gather-and-broadcast", [r.seconds("gather_broadcast") for r in results], "#d9534f"),
              ("gather-and-broadcast, naive", [r.seconds("gather_broadcast_naive") for r in results], "#f2b8b6"),
              ("lower bound", [r.lower_bound_s for r in results], "#555555")]
    x = np.arange(len(results))
    width = 0.16
    fig, ax = plt.subplots(figsize=(max(8, 1.8 * len(results)) + 2, 5))
    for i, (name, vals, color) in enumerate(series):
        ax.bar(x + (i - 2) * width, vals, width, label=name, color=color)
    for i, r in enumerate(results):
        for k, v in enumerate(r.case.published_s):
            ax.scatter([x[i] - 2 * width], [v], marker="*", s=140, color="#f0ad4e", edgecolor="black", zorder=5,
                       label="published" if i == 0 and k == 0 else None)
    ax.set_yscale("log")
    ax.set_xticks(x, labels, rotation=20, ha="right")
    ax.set_ylabel("seconds per refit (modeled)")
    ax.set_title("refit time: reshard vs gather-and-broadcast vs the lower bound")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path, dpi=120)


__all__ = ["CASES", "Case", "METHODS", "PRECISIONS", "Result", "check_precision", "default_jobs", "fit", "fp8_line",
           "fp8_problem", "model_figures", "plot", "precision_figures", "progress_line", "rank_weight_bytes", "render",
           "simulate_case", "simulate_cases", "size_hint", "to_json"]
