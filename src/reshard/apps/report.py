"""``reshard plan``: build a whole model's training and inference layouts by name, plan, summarize.

Parallel configurations are written the way papers and launch scripts say them::

    --train tp1,ep16,pp4,dp2      Megatron: world = tp x cp x pp x dp, or, with ep > 1,
                                  etp x ep x pp x dp (dp = replicas of the expert grid;
                                  dense data parallel is then world / (tp x cp x pp))
    --train fsdp:dp64             FSDP2 (add tp8 for FSDP over TP, hsdp2 for HSDP replicas)
    --infer tp8,dp16              vLLM: dp engines of tp ranks; add ep for expert parallel

Training ranks are ``0..M-1`` and inference ranks ``M..M+N-1``. Pure: no process group.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

from ..execution.gather_broadcast import gather_broadcast_bytes
from ..layout import Layout
from ..models import Arch, category, get_arch
from ..models.arch import CATEGORIES
from ..planning.plan import Plan, plan
from ..tensors import LayoutError

_TRAIN_KEYS = {"tp", "pp", "ep", "etp", "cp", "dp", "hsdp"}
_INFER_KEYS = {"tp", "dp", "ep"}


def parse_parallel(text: str, allowed: set[str], what: str) -> tuple[str | None, dict[str, int]]:
    """``"fsdp:tp2,dp4"`` -> ``("fsdp", {"tp": 2, "dp": 4})``; a bare ``ep`` means ``ep=1`` flag-style."""
    framework = None
    if ":" in text:
        framework, text = text.split(":", 1)
    out: dict[str, int] = {}
    for item in filter(None, (t.strip().lower() for t in text.split(","))):
        m = re.fullmatch(r"([a-z]+)(\d*)", item)
        if not m or m.group(1) not in allowed:
            raise LayoutError(f"{what}: cannot read {item!r}; use comma-separated sizes like tp8,dp16 "
                              f"(known: {', '.join(sorted(allowed))})")
        key, num = m.group(1), m.group(2)
        if num and int(num) < 1:
            raise LayoutError(f"{what}: {key} must be >= 1, got {num}")
        out[key] = int(num) if num else 0
    return framework, out


@dataclass
class ModelRefit:
    """A named model's refit between two parallel configurations."""

    arch: Arch
    source: Layout
    destination: Layout
    train_world: int
    infer_world: int
    build_s: float


def build_refit(model: str | Arch, train: str, infer: str, *, source_dtype: torch.dtype | None = None,
                colocate: bool = False) -> ModelRefit:
    """Layouts for ``model`` with training config ``train`` and inference config ``infer``.

    ``source_dtype``: the training side's parameter dtype (fp32 master weights, say; the inference
    side keeps the model's). ``colocate``: inference ranks are ``0..N-1``, sharing GPUs with the
    training ranks ``0..M-1`` (else they are ``M..M+N-1``).
    """
    from ..frameworks.fsdp import fsdp_layout
    from ..frameworks.megatron import megatron_layout, suggest_pp_layers
    from ..frameworks.vllm import vllm_layout

    arch = get_arch(model) if isinstance(model, str) else model
    t0 = time.perf_counter()
    tfw, t = parse_parallel(train, _TRAIN_KEYS, "--train")
    ifw, i = parse_parallel(infer, _INFER_KEYS, "--infer")
    if (tfw or "megatron") == "megatron":
        tp, cp, pp, ep, dp = (t.get(k) or 1 for k in ("tp", "cp", "pp", "ep", "dp"))
        etp = t.get("etp") or (1 if ep > 1 else tp)
        world = etp * ep * pp * dp if ep > 1 else tp * cp * pp * dp
        if world % (tp * cp * pp):
            raise LayoutError(f"--train {train}: {world} ranks do not split into tp{tp} x cp{cp} x pp{pp} groups")
        dense_dp = world // (tp * cp * pp)
        # MTP layers sit on the last stage outside the pipeline split of the decoder layers
        pp_layers = None if arch.layers % pp == 0 else suggest_pp_layers(arch.layers, pp)
        source = megatron_layout(arch, range(world), tp=tp, pp=pp, ep=ep, etp=etp, dp=dense_dp, cp=cp,
                                 pp_layers=pp_layers, dtype=source_dtype)
    elif tfw == "fsdp":
        tp, dp, hsdp = t.get("tp") or 1, t.get("dp") or 1, t.get("hsdp") or 1
        world = tp * dp * hsdp
        source = fsdp_layout(arch, range(world), dp_shard=dp, dp_replicate=hsdp, tp=tp, dtype=source_dtype)
    else:
        raise LayoutError(f"--train: unknown framework {tfw!r}; use megatron: or fsdp:")
    if (ifw or "vllm") != "vllm":
        raise LayoutError(f"--infer: unknown framework {ifw!r}; use vllm:")
    itp, idp = i.get("tp") or 1, i.get("dp") or 1
    first = 0 if colocate else world
    destination = vllm_layout(arch, range(first, first + itp * idp), itp, idp, expert_parallel="ep" in i)
    return ModelRefit(arch, source, destination, world, itp * idp, time.perf_counter() - t0)


def summarize(refit: ModelRefit, p: Plan, *, baseline: bool = True) -> dict:
    """Figures of a plan: bytes by category, per-rank extremes, balance, baseline bytes."""
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
        "model": refit.arch, "tensors": len(p.tensors), "pieces": p.num_pieces, "geometries": len(p._groups),
        "pairs": len(p.pair_bytes), "wire_bytes": p.wire_bytes, "local_bytes": p.local_bytes,
        "by_category": by_cat, "model_bytes_by_category": total_cat,
        "max_send": max(send, default=0), "mean_send": sum(send) / max(len(send), 1),
        "max_recv": max(recv, default=0), "mean_recv": sum(recv) / max(len(recv), 1),
        "train_world": refit.train_world, "infer_world": refit.infer_world,
    }
    if baseline:
        gb = gather_broadcast_bytes(p)
        out["gather_broadcast"] = gb
    return out


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


def plan_model(model: str, train: str, infer: str, max_bucket_bytes: int | None = None):
    refit = build_refit(model, train, infer)
    t0 = time.perf_counter()
    p = plan(refit.source, refit.destination, max_bucket_bytes=max_bucket_bytes)
    return refit, p, time.perf_counter() - t0


__all__ = ["ModelRefit", "build_refit", "parse_parallel", "plan_model", "render", "summarize"]
