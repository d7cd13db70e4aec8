"""``reshard plan``: a whole model's refit by name, planned and summarized.

The layouts come from :func:`reshard.frameworks.parallel.model_layouts` (training ranks
``0..M-1``, inference ranks ``M..M+N-1``); the summary counts bytes by part of the model, per
rank, and what gather-and-broadcast would move. Pure: no process group.
"""

from __future__ import annotations

import time

from ..frameworks.parallel import ModelLayouts, model_layouts
from ..models.arch import CATEGORIES, category
from ..planning.baseline import gather_broadcast_bytes
from ..planning.plan import Plan, plan
from ..tensors import dtype_name


def precision_summary(p: Plan, precision=None) -> dict:
    """Wire bytes by precision (``fp8`` values, their ``scales``, ``raw`` blocks crossing in the source's
    precision, ``other`` tensors), by dtype, and blocks quantized at a source / at the destination, of a
    :class:`~reshard.planning.precision.PrecisionPlan` (None: the plain plan ``p``, all ``other``)."""
    if precision is None:
        by_object: dict = {}  # dtype -> bytes, named once per dtype after
        uniform, specs = p.destination.uniform_dtype, p.destination.specs
        for name, b in p.tensor_wire_bytes().items():
            if b:
                d = uniform(name) or specs[name].dtype
                by_object[d] = by_object.get(d, 0) + b
        by_dtype = {dtype_name(d): b for d, b in by_object.items()}
        return {"wire_bytes_by_precision": {"fp8": 0, "scales": 0, "raw": 0, "other": p.wire_bytes},
                "wire_bytes_by_dtype": dict(sorted(by_dtype.items())), "fp8_tensors": 0,
                "blocks": {"at_source": 0, "assembled": 0, "at_destination": 0}, "assembly_bytes": 0}
    paths = precision.tensor_paths().values()
    return {"wire_bytes_by_precision": precision.wire_bytes_by_path(),
            "wire_bytes_by_dtype": precision.wire_bytes_by_dtype(), "fp8_tensors": len(precision.fp8),
            "blocks": {"at_source": sum(x["source"] for x in paths), "assembled": sum(x["assembled"] for x in paths),
                       "at_destination": sum(x["destination"] for x in paths)},
            "assembly_bytes": precision.assembly_bytes}


def summarize(refit: ModelLayouts, p: Plan, *, baseline: bool = True, precision=None) -> dict:
    """Figures of a plan: bytes by category, per-rank extremes, balance, baseline bytes; ``precision``
    (a :class:`~reshard.planning.precision.PrecisionPlan` of the same layouts): its wire figures too
    (``summary["precision"]``, :func:`precision_summary`; always there, for ``p`` without)."""
    by_cat = {c: 0 for c in CATEGORIES}
    total_cat = {c: 0 for c in CATEGORIES}
    wire = p.tensor_wire_bytes()
    for name in p.tensors:
        c = category(name)
        by_cat[c] += wire.get(name, 0)
        total_cat[c] += p.destination.specs[name].nbytes
    send = [p.send_bytes.get(r, 0) for r in p.source.ranks]
    recv = [p.recv_bytes.get(r, 0) for r in p.destination.ranks]
    out = {
        "model": refit.arch, "tensors": len(p.tensors), "pieces": p.num_pieces, "geometries": p.num_geometries,
        "pairs": len(p.pair_bytes), "wire_bytes": p.wire_bytes, "local_bytes": p.local_bytes,
        "by_category": by_cat, "model_bytes_by_category": total_cat,
        "max_send": max(send, default=0), "mean_send": sum(send) / max(len(send), 1),
        "max_recv": max(recv, default=0), "mean_recv": sum(recv) / max(len(recv), 1),
        "train_world": refit.train_world, "infer_world": refit.infer_world,
    }
    if baseline:
        out["gather_broadcast"] = gather_broadcast_bytes(p)
    out["precision"] = precision_summary(p, precision)
    if precision is not None:
        w = precision.wire
        out["fp8"] = {"wire_bytes": w.wire_bytes, "max_send": max(w.send_bytes.values(), default=0),
                      "max_recv": max(w.recv_bytes.values(), default=0)}
    return out


def render_precision(summary: dict, console) -> None:
    """The FP8 table of ``reshard plan --precision fp8``: wire bytes by precision beside the BF16 plan's."""
    from rich.table import Table

    gb = 1e9
    s, f = summary["precision"], summary["fp8"]
    w = s["wire_bytes_by_precision"]
    mx = "uint8" in s["wire_bytes_by_dtype"]  # MXFP8's E8M0 scales
    t = Table(title="FP8 destination (" + ("MXFP8: e4m3, one E8M0 scale per 1x32 block" if mx else
                                           "e4m3, one scale per 128x128 block") + "): wire by precision")
    for col in ("crosses as", "reshard wire GB"):
        t.add_column(col, justify="right" if col != "crosses as" else "left")
    for key, label in (("fp8", "fp8 values (blocks quantized at a source)"), ("scales", "their E8M0 scales" if mx else "their float32 scales"),
                       ("raw", "raw blocks in the source's precision (quantized at the destination)"),
                       ("other", "other tensors (kept: routers, norms, embeddings, head)")):
        t.add_row(label, f"{w[key] / gb:.3f}")
    t.add_row("[bold]total (FP8 plan)", f"[bold]{f['wire_bytes'] / gb:.3f}")
    t.add_row("BF16 plan, for comparison", f"{summary['wire_bytes'] / gb:.3f}")
    console.print(t)
    b = s["blocks"]
    console.print(
        f"{s['fp8_tensors']:,} FP8 tensors; blocks quantized at a source {b['at_source']:,}, assembled in a source "
        f"domain first {b['assembled']:,} ({s['assembly_bytes'] / gb:.3f} GB handed over inside domains), at the "
        f"destination {b['at_destination']:,}; FP8 wire {f['wire_bytes'] / max(summary['wire_bytes'], 1):.2f}x the BF16 "
        f"plan's; per source rank sends max {f['max_send'] / gb:.2f} GB, per inference rank receives max "
        f"{f['max_recv'] / gb:.2f} GB", highlight=False)


def render(summary: dict, console, title: str) -> None:
    from rich.table import Table

    gb = 1e9
    t = Table(title=title)
    for col in ("category", "model GB", "reshard wire GB"):
        t.add_column(col, justify="right" if col != "category" else "left")
    for c in CATEGORIES:
        t.add_row(c, f"{summary['model_bytes_by_category'][c] / gb:.2f}", f"{summary['by_category'][c] / gb:.2f}")
    t.add_row("[bold]total", f"{sum(summary['model_bytes_by_category'].values()) / gb:.2f}",
              f"[bold]{summary['wire_bytes'] / gb:.2f}")
    console.print(t)
    s = summary
    console.print(
        f"{s['tensors']:,} tensors, {s['pieces']:,} pieces, {s['geometries']:,} geometries, "
        f"{s['pairs']:,} communicating rank pairs (one message each per round); "
        f"{s['train_world']} training -> {s['infer_world']} inference ranks")
    console.print(
        f"per source rank sends max {s['max_send'] / gb:.2f} GB (balance max/mean "
        f"{s['max_send'] / s['mean_send'] if s['mean_send'] else 1:.3f}); per inference rank receives max "
        f"{s['max_recv'] / gb:.2f} GB (mean {s['mean_recv'] / gb:.2f}); local copies {s['local_bytes'] / gb:.2f} GB")
    if "gather_broadcast" in s:
        g = s["gather_broadcast"]
        total = g["gather"] + g["broadcast"]
        console.print(
            f"gather-and-broadcast moves {total / gb:.2f} GB ({g['gather'] / gb:.2f} gathered to one rank, "
            f"{g['broadcast'] / gb:.2f} broadcast); reshard moves {s['wire_bytes'] / gb:.2f} GB: "
            f"{total / max(s['wire_bytes'], 1):.2f}x fewer bytes")


def plan_model(model: str, train: str, infer: str, max_bucket_bytes: int | None = None
               ) -> tuple[ModelLayouts, Plan, float]:
    """Both layouts of ``model``, the plan between them, and the seconds planning took.

    >>> refit, p, _ = plan_model("qwen3-8b", "tp2,pp2", "tp4")
    >>> s = summarize(refit, p)
    >>> s["train_world"], s["infer_world"], s["wire_bytes"] == sum(s["by_category"].values())
    (4, 4, True)
    """
    refit = model_layouts(model, train, infer)
    t0 = time.perf_counter()
    p = plan(refit.source, refit.destination, max_bucket_bytes=max_bucket_bytes)
    return refit, p, time.perf_counter() - t0


__all__ = ["plan_model", "precision_summary", "render", "render_precision", "summarize"]
