"""``reshard plan``'s report: built from plain data (:func:`build_plan_report`, :func:`build_model_report`),
then rendered (:func:`render_plan_report`, :func:`render_model_report`, :func:`render_plots`) or turned into
one JSON object (:func:`plan_record`).

The builders plan and model but print nothing and write no file; the renderers print to a rich console
and compute nothing. The command (:mod:`reshard.apps.cli`) reads the options, calls one, then the other,
and writes the plots. Two reports, not one, because modeling a refit on a topology comes after its
plan's tables are printed (a model that fails to build still leaves the tables on screen).

>>> report = build_plan_report("qwen3-8b", "tp2,pp2", "tp4")
>>> report.title, report.record["tensors"], report.summary["train_world"]
('qwen3-8b: train tp2,pp2 -> infer vllm tp4', 399, 4)
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..execution.methods import make_plan
from ..forked import forked, in_this_process
from ..frameworks.parallel import ModelLayouts, model_layouts
from ..gc_pause import without_gc
from ..options import RefitOptions
from ..planning.methods import RESHARD
from ..planning.plan import Plan
from ..planning.precision import DtypePolicy, PrecisionPlan, precision_layout
from .report import render, render_precision, summarize

if TYPE_CHECKING:  # the modeling side (and matplotlib) loads only when a topology is asked for
    from ..modeling.estimate import Estimate
    from ..modeling.pipeline import RefitModel
    from ..modeling.topology import Placement, Topology


@dataclass
class PlanReport:
    """What ``reshard plan`` found before any topology: the layouts, the plans, their summary
    (:func:`~reshard.apps.report.summarize`), how long planning took, and the JSON record."""

    model: str
    train: str  # the training spec as given
    infer: str  # the inference spec, ",independent" added for independent engines
    precision: str  # of the destination: "bf16" (the inference layout's dtype) or "fp8"
    refit: ModelLayouts
    plan: Plan
    precision_plan: PrecisionPlan | None  # the FP8 plan, with --precision fp8
    policy: DtypePolicy | None
    summary: dict
    plan_s: float
    fp8_s: float | None  # seconds the FP8 plan took
    record: dict  # the --json object's keys so far (see plan_record)

    @property
    def fingerprint(self) -> str:
        return (self.precision_plan or self.plan).fingerprint()

    @property
    def title(self) -> str:
        return (f"{self.model}: train {self.train} -> infer {self.refit.infer.describe()}"
                + (", the BF16 plan (FP8 below)" if self.precision_plan is not None else ""))

    @property
    def plot_stem(self) -> str:
        """File name stem of the plots: model, train and infer specs, ``-fp8`` for an FP8 destination."""
        stem = f"{self.model}-{self.train}-{self.infer}".replace(",", "_").replace(":", "_")
        return stem + "-fp8" if self.precision_plan is not None else stem


@dataclass
class ModelReport:
    """The refit modeled on a topology: training ranks from GPU 0, inference ranks from the next NVLink
    domain. ``does_not_fit``: why the weights alone exceed a GPU (nothing else is modeled then);
    ``figures``: :func:`~reshard.apps.simulate.model_figures` (with ``--topology``); ``plot_estimate``: the
    modeled time of the refit reshard runs, which the plots show (with ``--plot``)."""

    topology: Topology
    placement: Placement | None
    does_not_fit: str | None
    refit_model: RefitModel | None  # what the plots are drawn from
    figures: dict | None
    plot_estimate: Estimate | None
    fp8: bool
    record: dict  # the --json object's modeled keys


@without_gc
def build_plan_report(model: str, train: str, infer: str, *, independent_engines: bool = False,
                      options: RefitOptions | None = None, precision: str = "bf16",
                      max_bucket_bytes: int | None = None, baseline: bool = True,
                      assemble_domain: int | None = None, second_core: bool = False) -> PlanReport:
    """Lay out ``model`` both ways, plan the refit (and, under a dtype policy, the FP8 refit) with
    ``options`` (a :class:`~reshard.options.RefitOptions`: its staging cap and dtype policy; without
    one, ``max_bucket_bytes`` and ``precision="fp8"`` or ``"bf16"``), and summarize it; ``baseline``:
    count gather-and-broadcast's bytes; ``assemble_domain``: under a block policy, training ranks ``r`` of
    one NVLink domain (``r // assemble_domain``) assemble the blocks none of them holds whole (FSDP)
    before quantizing (:mod:`reshard.planning.fp8_assembly`); ``second_core``: summarize in a forked child
    (:mod:`reshard.forked`) while this process computes the fingerprint and the wire bytes. A configuration that
    cannot be laid out or planned raises ``ValueError`` (``LayoutError`` and ``OptionsError`` included)."""
    if independent_engines and "independent" not in infer:
        infer += ",independent"
    if options is None:
        options = RefitOptions(method=RESHARD, max_bucket_bytes=max_bucket_bytes,
                               precision=None if precision == "bf16" else precision)
    max_bucket_bytes = options.max_bucket_bytes
    precision = options.precision or "bf16"
    policy = options.policy
    refit = model_layouts(model, train, infer)
    if policy is not None:  # a split through a block: one line naming the tensor, before any planning
        precision_layout(refit.destination, policy)
    started = time.perf_counter()
    direct = make_plan(options.replace(method=RESHARD, precision=None), refit.source, refit.destination)
    plan_s = time.perf_counter() - started
    fp8_plan = fp8_s = None
    if policy is not None:
        started = time.perf_counter()
        if assemble_domain:
            fp8_plan = PrecisionPlan(refit.source, refit.destination, policy, max_bucket_bytes=max_bucket_bytes,
                                     assemble={r: r // assemble_domain for r in refit.source.ranks})
        else:
            fp8_plan = make_plan(options.replace(method=RESHARD), refit.source, refit.destination)
        fp8_s = time.perf_counter() - started
    with (forked if second_core else in_this_process)(summarize, refit, direct, baseline=baseline,
                                                      precision=fp8_plan) as summary:
        if second_core:  # this core meanwhile: what the record and the model need besides the summary
            (fp8_plan or direct).fingerprint()
            direct.pair_bytes
        summary = summary.result(here_if_dead=True)
    report = PlanReport(model, train, infer, precision, refit, direct, fp8_plan, policy, summary, plan_s, fp8_s, {})
    report.record = _plan_keys(report)
    return report


def _plan_keys(report: PlanReport) -> dict:
    """The ``--json`` object's keys that need no topology, in the order the object shows them."""
    wire = report.precision_plan.wire if report.precision_plan is not None else report.plan
    summary = report.summary
    return {"model": report.model, "train": report.refit.train.describe(), "infer": report.refit.infer.describe(),
            "engines": "independent" if report.refit.infer.independent else "one deployment",
            "precision": report.precision, "tensors": summary["tensors"], "wire_bytes": wire.wire_bytes,
            "max_send_bytes": max(wire.send_bytes.values(), default=0),
            "max_recv_bytes": max(wire.recv_bytes.values(), default=0),
            "gather_broadcast_bytes": summary.get("gather_broadcast"), "fingerprint": report.fingerprint,
            **summary["precision"], "bf16_wire_bytes": report.plan.wire_bytes}


@without_gc
def build_model_report(report: PlanReport, topology: Topology, *, figures: bool, plots: bool,
                       second_core: bool = False) -> ModelReport:
    """Model ``report``'s refit on ``topology``: whether its weights fit, and (``figures``) every modeled
    figure, with reshard's rounds under the plan's staging cap (2 GiB without one: rounds of 1 GiB) and 1 GiB broadcast
    buckets; ``plots``: the estimate the plots show; ``second_core``: model two baselines in a forked child
    (:func:`~reshard.apps.simulate.start_baselines`) while this process models the rest (the same figures,
    sooner on two cores)."""
    from ..modeling.pipeline import RefitModel
    from ..modeling.topology import Placement
    from .simulate import METHODS, GiB, fit, model_figures, start_baselines

    fp8 = report.precision_plan is not None
    refit, direct = report.refit, report.plan
    place = Placement.contiguous(topology, refit.train_world, refit.infer_world, infer_start="domain")
    rounds_cap = direct.max_bucket_bytes or 2 * GiB
    build = dict(placement=place, direct=direct, precision=report.precision_plan,
                 max_bucket_bytes=direct.max_bucket_bytes)
    baselines = None
    if figures and second_core:  # two baselines plan refits of their own: on the other core, from here on
        baselines = start_baselines(refit.source, refit.destination, topology, build, rounds_cap=rounds_cap,
                                    bucket_bytes=GiB)
    with baselines or nullcontext():  # leaving it without the result stops the child
        reason = fit(refit, topology, report.policy)
        record = {"topology": topology.name, "fits": reason is None, "does_not_fit": reason}
        if reason is not None:  # the weights alone exceed a GPU: no time to model
            record["modeled_s"] = dict.fromkeys(METHODS)
            return ModelReport(topology, None, reason, None, None, None, fp8, record)
        refit_model = RefitModel.build(refit.source, refit.destination, topology, **build)
        modeled = model_figures(refit_model, rounds_cap=rounds_cap, baselines=baselines) if figures else None
    if modeled is not None:
        record.update(modeled)
    plot_estimate = refit_model.estimate(refit_model.reshard)[1] if plots else None
    return ModelReport(topology, place, None, refit_model, modeled, plot_estimate, fp8, record)


def plan_record(report: PlanReport, modeled: ModelReport | None = None) -> dict:
    """The ``--json`` object: the plan's keys, then the modeled ones (which may replace ``wire_bytes``)."""
    return {**report.record, **(modeled.record if modeled is not None else {})}


# ---------------------------------------------------------------------------------------------- rendering
def render_plan_report(report: PlanReport, console) -> None:
    """The plan's tables (bytes by category, then the FP8 wire) and how long it took."""
    render(report.summary, console, report.title)
    if report.precision_plan is not None:
        render_precision(report.summary, console)
    console.print(f"layouts built in {report.refit.build_s:.2f} s, planned in {report.plan_s:.2f} s"
                  + (f" (FP8 plan {report.fp8_s:.2f} s)" if report.precision_plan is not None else "")
                  + f"; fingerprint {report.fingerprint}")


def render_does_not_fit(modeled: ModelReport, console) -> None:
    """Why nothing was modeled: the weights alone exceed a GPU."""
    console.print(f"[red]{modeled.does_not_fit}[/]: not modeled", highlight=False)


_METHOD_LABELS = {"hierarchical": "reshard, hierarchical", "direct": "reshard, direct",
                  "hybrid": "hybrid (FFN + experts by reshard, rest broadcast)",
                  "gather_broadcast": "gather-and-broadcast (best implementation)",
                  "gather_broadcast_naive": "gather-and-broadcast, naive (one root)"}


def render_model_report(modeled: ModelReport, console) -> None:
    """The modeled times of ``reshard plan --topology``: each method against ours, the bounds."""
    from rich.table import Table

    figures = modeled.figures
    table = Table(title=f"modeled on {modeled.topology.name} ({modeled.placement.describe()})"
                  + (", FP8 destination" if modeled.fp8 else ""))
    for column in ("method", "modeled s", "x ours"):
        table.add_column(column, justify="left" if column == "method" else "right")
    ours = figures["modeled_s"]["hierarchical"] or figures["modeled_s"]["direct"]
    for method, label in _METHOD_LABELS.items():
        seconds = figures["modeled_s"][method]
        table.add_row(label, "-" if seconds is None else f"{seconds:.3f}",
                      "-" if seconds is None else f"{seconds / ours:.2f}")
    table.add_row("lower bound", f"{figures['lower_bound_s']:.3f}", f"{figures['lower_bound_s'] / ours:.2f}")
    table.add_row("lower bound, the job's NICs only", f"{figures['lower_bound_job_s']:.3f}",
                  f"{figures['lower_bound_job_s'] / ours:.2f}")
    console.print(table)
    console.print(f"lower bound set by {figures['lower_bound_term']}; ours / bound {figures['ours_over_bound']:.2f}; "
                  f"bottleneck {figures['bottleneck']}", highlight=False)
    if modeled.fp8:
        console.print("FP8 (modeled): reshard and the bounds move the FP8 plan's wire; the hybrid and "
                      "gather-and-broadcast move BF16 and the engine quantizes on load (assumed, as vLLM does "
                      "with BF16 weights for an FP8 model); quantize compute time not modeled", highlight=False)


def render_plots(modeled: ModelReport, paths, console) -> None:
    """What the plots modeled, and where they were written."""
    estimate = modeled.plot_estimate
    bottleneck = estimate.bottleneck
    console.print(f"plots modeled on {modeled.topology.name} ({modeled.placement.describe()}): "
                  f"{estimate.seconds:.3f} s" + (f"; bottleneck {bottleneck.describe()}" if bottleneck else ""),
                  highlight=False)
    for path in paths:
        console.print(f"wrote {path}", highlight=False)
