"""Destination precision per tensor, and the plan of a refit straight into FP8 engines.

A :class:`DtypePolicy` maps every destination tensor to its precision: :class:`Keep` (the dtype the
destination layout gives it), :class:`Cast` (``Cast(torch.bfloat16)``: the sender casts) or
:class:`FP8Block` (float8_e4m3fn with one float32 scale per block, 128 x 128 by default; the rule
is :mod:`reshard.quant`'s). The default, :meth:`DtypePolicy.fp8`, quantizes the 2-D linear weights
an FP8 checkpoint (DeepSeek-V3, Kimi-K2) stores in FP8 and keeps the rest::

    model.layers.0.self_attn.q_proj.weight           FP8Block   (attention projections, MLA's too)
    model.layers.0.mlp.experts.7.down_proj.weight    FP8Block   (dense MLP, experts, shared experts)
    model.layers.0.mlp.gate.weight                   Keep       (router)
    model.layers.0.input_layernorm.weight            Keep       (norms, biases)
    model.embed_tokens.weight, lm_head.weight        Keep

On the destination an FP8 tensor ``w`` is two logical tensors, each with its own layout
(:func:`precision_layout`): ``w`` in float8_e4m3fn, in the same buffers (now FP8), and
``w_scale_inv`` (float32, ``ceil(rows / bn) x ceil(cols / bk)``) in buffers named
``<buffer>_scale_inv``, block row ``i`` of a piece at buffer row ``r`` going to scale row ``r / bn``:
vLLM's block-FP8 ``weight`` / ``weight_scale_inv`` (fused QKV, gate-up and FusedMoE's w13 / w2
included). A destination piece that does not hold whole blocks (a TP split through a block,
a fused partner starting inside one) is a :class:`~reshard.tensors.LayoutError` naming the tensor,
as vLLM refuses such splits.

Each block is quantized once, where it is whole (:class:`PrecisionPlan`): a block that some source
rank holds whole (inside one of its pieces) is quantized there and crosses as FP8 plus its scale;
a block that no source rank holds whole (an uneven FSDP split, a TP split finer than a block)
crosses in the source's precision into a staging buffer of the destination, which quantizes it
there. Per tensor and rank, 256 x 128 source rows split 2 ways by FSDP into 150 + 106 rows (block
128 x 128), TP 2 destination by columns::

    source rank  rows      whole blocks   block row 0 [0:128)   block row 1 [128:256)
    0            0:150     row 0          quantized on rank 0   -
    1            150:256   none           -                     crosses raw, quantized
                                                                on each destination rank

The wire carries three logical tensors per FP8 tensor ``w``: ``w`` (float8_e4m3fn, from source
staging ``w@fp8/k``), ``w_scale_inv`` (from ``w_scale_inv@fp8/k``) and ``w@raw`` (the source's dtype,
into destination staging ``w@raw/k``), one ordinary :class:`~reshard.planning.plan.Plan` for all of
them and for the other tensors; :mod:`reshard.execution.precision` runs it.

>>> import torch, reshard as rs
>>> spec = rs.TensorSpec("mlp.down_proj.weight", (256, 256), torch.bfloat16)
>>> src = rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(0)], split="balanced")
>>> dst = rs.Layout.from_placements(spec, [2, 3], (2,), [rs.Shard(1)])
>>> p = PrecisionPlan(src, dst)
>>> p.block_paths(spec.name).tolist()       # 1: quantized at the source, 2: at the destination
[[1, 1], [1, 1]]
>>> p.wire_bytes_by_dtype()                 # 256 * 256 fp8 bytes + 4 scales
{'float32': 16, 'float8_e4m3fn': 65536}
>>> src = rs.Layout.from_placements(spec, [0, 1, 2], (3,), [rs.Shard(0)])   # 86 + 86 + 84 rows
>>> PrecisionPlan(src, dst).block_paths(spec.name).tolist()
[[2, 2], [2, 2]]

Pure: no process group, no device.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Union

import numpy as np
import torch

from ..gc_pause import without_gc
from ..layout import Layout, PieceTable, Repeated
from ..quant import DEFAULT_BLOCK, FP8_DTYPE, SCALE_DTYPE, SCALE_SUFFIX, check_block, grid_shape, scale_name
from ..tensors import LayoutError, TensorSpec, box_str, dtype_name
from .hierarchy import hierarchical_plan
from .plan import Plan, check_pair
from .schedule import Copy

PRECISION_PLAN_FORMAT = 1
FP8_STAGING = "@fp8/"  # source staging: <tensor>@fp8/<k>, <tensor>_scale_inv@fp8/<k>
RAW_SUFFIX = "@raw"  # the wire tensor of blocks crossing in the source's precision; staging <tensor>@raw/<k>

SOURCE, DESTINATION = 1, 2  # block_paths codes: where a block is quantized


# ---------------------------------------------------------------------------- precisions
@dataclass(frozen=True)
class Keep:
    """The dtype the destination layout gives the tensor (what the engine allocated)."""

    def __str__(self) -> str:
        return "keep"


@dataclass(frozen=True)
class Cast:
    """Destination buffers in ``dtype`` (``Cast(torch.bfloat16)``); the sender casts, as in any refit."""

    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"Cast takes a torch.dtype, got {self.dtype!r}")

    def __str__(self) -> str:
        return f"cast:{dtype_name(self.dtype)}"


@dataclass(frozen=True)
class FP8Block:
    """float8_e4m3fn with one float32 scale per ``block`` (rows, columns); ``ue8m0``: every scale
    rounded up to a power of two (see :mod:`reshard.quant`)."""

    block: tuple[int, int] = DEFAULT_BLOCK
    ue8m0: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", check_block(self.block, "FP8Block block"))
        if not isinstance(self.ue8m0, bool):
            raise ValueError(f"FP8Block ue8m0 must be True or False, got {self.ue8m0!r}")

    def __str__(self) -> str:
        return f"fp8:{self.block[0]}x{self.block[1]}" + (":ue8m0" if self.ue8m0 else "")


Precision = Union[Keep, Cast, FP8Block]
KEEP = Keep()

#: the 2-D linear weights FP8 checkpoints store in FP8 (Hugging Face and Megatron names): attention
#: projections (MLA's ``q_a_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj`` too), dense and expert
#: MLPs. Routers (``mlp.gate.weight``), norms, biases, embeddings and heads match none.
FP8_PATTERNS: tuple[str, ...] = (
    r"_proj(_with_mqa)?\.weight$",
    r"(^|\.)linear_(qkv|proj|fc1|fc2)\.weight$",
)


def _is_precision(p) -> bool:
    return isinstance(p, (Keep, Cast, FP8Block))


@dataclass(frozen=True)
class DtypePolicy:
    """Each destination tensor's precision: the first of ``rules`` (``(regular expression, precision)``,
    ``re.search`` on the name) that matches, else ``default``. ``predicate(spec)``, if given, is asked
    first; it returns a precision or None (then the rules decide).

    >>> pol = DtypePolicy.fp8()
    >>> [str(pol(TensorSpec(n, (256, 256), torch.bfloat16))) for n in
    ...  ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate.weight", "lm_head.weight")]
    ['fp8:128x128', 'keep', 'keep']
    >>> str(DtypePolicy.fp8(keep=[r"layers\\.0\\."])(TensorSpec("model.layers.0.mlp.up_proj.weight", (8, 8), torch.float32)))
    'keep'
    >>> str(DtypePolicy(default=Cast(torch.bfloat16))(TensorSpec("w", (4,), torch.float32)))
    'cast:bfloat16'
    """

    rules: tuple[tuple[str, Precision], ...] = ()
    default: Precision = KEEP
    predicate: Callable[[TensorSpec], Precision | None] | None = None
    _compiled: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.rules, (str, bytes)) or not isinstance(self.rules, Iterable):
            raise ValueError(f"DtypePolicy rules must be (pattern, precision) pairs, got {self.rules!r}")
        rules = tuple(tuple(r) if isinstance(r, (tuple, list)) else r for r in self.rules)
        compiled = []
        for r in rules:
            if not (isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str) and _is_precision(r[1])):
                raise ValueError(f"DtypePolicy rule {r!r}: expected (regular expression, Keep() / Cast(dtype) / "
                                 f"FP8Block())")
            try:
                compiled.append((re.compile(r[0]), r[1]))
            except re.error as e:
                raise ValueError(f"DtypePolicy pattern {r[0]!r} is not a regular expression: {e}") from None
        if not _is_precision(self.default):
            raise ValueError(f"DtypePolicy default must be Keep(), Cast(dtype) or FP8Block(), got {self.default!r}")
        if self.predicate is not None and not callable(self.predicate):
            raise ValueError(f"DtypePolicy predicate must be callable, got {self.predicate!r}")
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "_compiled", tuple(compiled))

    def __call__(self, spec: TensorSpec) -> Precision:
        if self.predicate is not None:
            p = self.predicate(spec)
            if p is not None:
                if not _is_precision(p):
                    raise ValueError(f"tensor {spec.name!r}: the DtypePolicy predicate returned {p!r}, not a "
                                     f"precision (Keep(), Cast(dtype), FP8Block()) or None")
                return p
        for pattern, p in self._compiled:
            if pattern.search(spec.name):
                return p
        return self.default

    @classmethod
    def fp8(cls, block=DEFAULT_BLOCK, ue8m0: bool = False, keep: Iterable[str] = ()) -> "DtypePolicy":
        """FP8 for the linear weights (:data:`FP8_PATTERNS`), the rest kept; names matching ``keep``
        (regular expressions) are kept too."""
        if isinstance(keep, str):
            keep = [keep]
        fp8 = FP8Block(block, ue8m0)
        return cls(tuple((k, KEEP) for k in keep) + tuple((p, fp8) for p in FP8_PATTERNS))

    @classmethod
    def named(cls, precision: str) -> "DtypePolicy":
        """The policies of ``--precision``: ``fp8`` (:meth:`fp8`), ``bf16`` / ``fp16`` / ``fp32`` (every
        floating tensor cast; integer tensors kept), ``keep``.

        >>> str(DtypePolicy.named("bf16")(TensorSpec("w", (2,), torch.float32)))
        'cast:bfloat16'
        """
        if precision == "fp8":
            return cls.fp8()
        if precision == "keep":
            return cls()
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        if precision not in dtypes:
            raise ValueError(f"unknown precision {precision!r}; choose one of fp8, bf16, fp16, fp32, keep")
        cast = Cast(dtypes[precision])
        return cls(predicate=lambda spec: cast if spec.dtype.is_floating_point else KEEP)

    @property
    def key(self) -> str:
        """What identifies the policy across processes (plan fingerprints): its rules and default, and its
        predicate's qualified name (a predicate's code cannot be compared)."""
        rules = "|".join(f"{p}={prec}" for p, prec in self.rules)
        pred = ""
        if self.predicate is not None:
            p = self.predicate
            pred = f";predicate:{getattr(p, '__module__', '?')}.{getattr(p, '__qualname__', type(p).__qualname__)}"
        return f"rules:{rules};default:{self.default}{pred}"


def as_policy(policy) -> DtypePolicy:
    """``policy`` as a :class:`DtypePolicy`: a policy, a name (``"fp8"``, ``"bf16"``, ...), or None (the
    default :meth:`DtypePolicy.fp8`)."""
    if policy is None:
        return DtypePolicy.fp8()
    if isinstance(policy, DtypePolicy):
        return policy
    if isinstance(policy, str):
        return DtypePolicy.named(policy)
    raise ValueError(f"dtype policy {policy!r}: expected a DtypePolicy or one of 'fp8', 'bf16', 'fp16', 'fp32', 'keep'")


# ---------------------------------------------------------------------------- block geometry
def _grid_boxes(offsets: np.ndarray, sizes: np.ndarray, shape, block) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) block-grid boxes of the whole blocks inside element boxes (empty: hi == lo)."""
    b = np.array(block, np.int64)
    n = np.array(shape, np.int64)
    lo = -(-offsets // b)
    end = offsets + sizes
    hi = np.where(end >= n, -(-n // b), end // b)
    hi = np.maximum(hi, lo)
    empty = (sizes <= 0).any(axis=1)
    hi[empty] = lo[empty]
    return lo, hi


def _element_boxes(glo: np.ndarray, ghi: np.ndarray, shape, block) -> tuple[np.ndarray, np.ndarray]:
    """Element (offsets, sizes) of block-grid boxes (partial edge blocks clipped to ``shape``)."""
    b = np.array(block, np.int64)
    lo = glo * b
    return lo, np.minimum(ghi * b, np.array(shape, np.int64)) - lo


def _regions(grid: tuple[int, int], lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint rectangles tiling ``grid``: (lo [m, 2], hi [m, 2], covered [m]) where ``covered`` says
    whether the rectangle lies in the union of the boxes ``lo``/``hi`` (by coordinate compression)."""
    keep = (hi > lo).all(axis=1)
    lo, hi = lo[keep], hi[keep]
    cuts = [np.unique(np.concatenate([[0, grid[d]], lo[:, d], hi[:, d]])) for d in (0, 1)]
    nr, nc = len(cuts[0]) - 1, len(cuts[1]) - 1
    diff = np.zeros((nr + 1, nc + 1), np.int64)
    r0, r1 = np.searchsorted(cuts[0], lo[:, 0]), np.searchsorted(cuts[0], hi[:, 0])
    c0, c1 = np.searchsorted(cuts[1], lo[:, 1]), np.searchsorted(cuts[1], hi[:, 1])
    np.add.at(diff, (r0, c0), 1)
    np.add.at(diff, (r0, c1), -1)
    np.add.at(diff, (r1, c0), -1)
    np.add.at(diff, (r1, c1), 1)
    cov = diff.cumsum(0).cumsum(1)[:nr, :nc] > 0
    out: list[tuple[int, int, int, int, bool]] = []
    band_start, band_runs = 0, None
    for i in range(nr + 1):
        runs = None
        if i < nr:
            row = cov[i]
            edges = np.flatnonzero(row[1:] != row[:-1]) + 1
            starts = np.concatenate([[0], edges])
            ends = np.concatenate([edges, [nc]])
            runs = tuple(zip(starts.tolist(), ends.tolist(), row[starts].tolist()))
        if runs != band_runs:
            if band_runs is not None:
                for a, z, v in band_runs:
                    out.append((int(cuts[0][band_start]), int(cuts[1][a]), int(cuts[0][i]), int(cuts[1][z]), bool(v)))
            band_start, band_runs = i, runs
    arr = np.array([o[:4] for o in out], np.int64).reshape(len(out), 4)
    return arr[:, :2], arr[:, 2:], np.array([o[4] for o in out], bool)


def _intersect(dlo: np.ndarray, dhi: np.ndarray, rlo: np.ndarray, rhi: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Non-empty intersections of boxes ``d`` with rectangles ``r``: (d index, r index, lo, hi)."""
    lo = np.maximum(dlo[:, None, :], rlo[None, :, :])
    hi = np.minimum(dhi[:, None, :], rhi[None, :, :])
    di, ri = np.nonzero((hi > lo).all(axis=2))
    return di, ri, lo[di, ri], hi[di, ri]


def check_whole_blocks(name: str, table: PieceTable, shape, block) -> None:
    """Raise :class:`LayoutError` naming ``name`` unless every piece of ``table`` holds whole blocks at a
    block boundary of its buffer (what block-FP8 destinations need; vLLM refuses other TP splits)."""
    if not len(table):
        return
    b = np.array(block, np.int64)
    n = np.array(shape, np.int64)
    end = table.offsets + table.sizes
    bo = table.buffer_offsets[:, -2:]
    bad_start = table.offsets % b != 0
    bad_end = (end % b != 0) & (end != n)
    bad_buf = bo % b != 0
    live = (table.sizes > 0).all(axis=1)[:, None]
    bad = (bad_start | bad_end | bad_buf) & live
    if not bad.any():
        return
    i, d = (int(x) for x in np.argwhere(bad)[0])
    what = ("row", "column")[d]
    box = box_str(table.offsets[i], table.sizes[i])
    if bad_start[i, d]:
        where = f"its split at {what} {int(table.offsets[i, d])}"
    elif bad_end[i, d]:
        where = f"its split at {what} {int(end[i, d])}"
    else:
        where = f"its place at {what} {int(bo[i, d])} of buffer {table.buffers[i]!r}"
    raise LayoutError(
        f"tensor {name!r}: destination rank {int(table.ranks[i])} holds box {box}, and {where} cuts through "
        f"{block[0]}x{block[1]} blocks; block FP8 needs every destination piece to hold whole blocks at block "
        f"boundaries of its buffer (vLLM's block-FP8 layers refuse such tensor-parallel splits too)")


def _scale_table(table: PieceTable, block) -> PieceTable:
    """The ``_scale_inv`` pieces of an FP8 tensor's (whole-block) destination pieces."""
    b = np.array(block, np.int64)
    glo = table.offsets // b
    ghi = -(-(table.offsets + table.sizes) // b)
    bo = table.buffer_offsets.copy()
    bo[:, -2:] //= b
    one = table.one_buffer()
    names = Repeated(scale_name(one), len(table)) if one is not None else tuple(scale_name(x) for x in table.buffers)
    return PieceTable(table.ranks, glo, ghi - glo, names, bo)


# ---------------------------------------------------------------------------- destination layout
def _buffer_precisions(destination: Layout, precs: Mapping[str, Precision]) -> dict[str, Precision]:
    """Each destination buffer name's precision, or LayoutError naming two tensors that disagree."""
    by_buffer: dict[str, tuple[Precision, str]] = {}
    for name, t in destination.tables.items():
        if not len(t):
            continue
        p = precs[name]
        one = t.one_buffer()
        for b in ((one,) if one is not None else dict.fromkeys(t.buffers)):
            seen = by_buffer.get(b)
            if seen is None:
                by_buffer[b] = (p, name)
            elif seen[0] != p:
                _same_rank_conflict(destination, b, seen[1], name, seen[0], p)
    return {b: p for b, (p, _) in by_buffer.items()}


def _same_rank_conflict(destination: Layout, b: str, n1: str, n2: str, p1, p2) -> None:
    """Raise for tensors of two precisions in buffer ``b`` of one rank (buffers of one name on other
    ranks may differ: then the name is ambiguous, also an error)."""
    def ranks(n):
        t = destination.tables[n]
        return {int(r) for r, x in zip(t.ranks.tolist(), t.buffers) if x == b}

    common = sorted(ranks(n1) & ranks(n2))
    where = f"rank {common[0]}" if common else "ranks of one buffer name"
    raise LayoutError(f"{where} buffer {b!r}: holds tensor {n1!r} ({p1}) and tensor {n2!r} ({p2}); one buffer "
                      f"has one precision: give the tensors of a fused buffer the same precision")


@without_gc
def precision_layout(destination: Layout, policy: DtypePolicy | str | None = None) -> Layout:
    """The destination as the engine holds it under ``policy`` (default :meth:`DtypePolicy.fp8`): kept
    tensors as they are, cast tensors' buffers in their dtype, FP8 tensors in float8_e4m3fn buffers
    plus their ``<name>_scale_inv`` tensors in ``<buffer>_scale_inv`` buffers (see module doc).

    >>> import reshard as rs
    >>> spec = rs.TensorSpec("w", (256, 384), torch.bfloat16)
    >>> eng = precision_layout(rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(0)]),
    ...                        DtypePolicy([("w", FP8Block())]))
    >>> eng.buffers(1)
    {'w': ((128, 384), torch.float8_e4m3fn), 'w_scale_inv': ((1, 3), torch.float32)}
    >>> [(p.tensor, p.offsets, p.sizes) for p in eng.pieces(1)]
    [('w', (128, 0), (128, 384)), ('w_scale_inv', (1, 0), (1, 3))]
    >>> precision_layout(rs.Layout.from_placements(spec, [0, 1, 2], (3,), [rs.Shard(0)]),
    ...                  DtypePolicy([("w", FP8Block())]))
    Traceback (most recent call last):
    ...
    reshard.tensors.LayoutError: tensor 'w': destination rank 0 holds box [0:86, 0:384], and its split at row 86 cuts through 128x128 blocks; block FP8 needs every destination piece to hold whole blocks at block boundaries of its buffer (vLLM's block-FP8 layers refuse such tensor-parallel splits too)
    """
    if not isinstance(destination, Layout):
        raise LayoutError(f"precision_layout: the destination must be a Layout, got {type(destination).__name__}")
    policy = as_policy(policy)
    precs = {name: policy(spec) for name, spec in destination.specs.items()}
    for name, p in precs.items():
        spec = destination.specs[name]
        if isinstance(p, FP8Block):
            if len(spec.shape) != 2 or not spec.dtype.is_floating_point:
                raise LayoutError(f"tensor {name!r}: block FP8 takes 2-D floating tensors, this one is "
                                  f"{dtype_name(spec.dtype)} of shape {spec.shape} (keep or cast it instead)")
            if scale_name(name) in destination.specs:
                raise LayoutError(f"tensor {name!r}: its scale tensor {scale_name(name)!r} is a destination tensor "
                                  f"already")
        elif isinstance(p, Cast) and (p.dtype.is_floating_point != spec.dtype.is_floating_point):
            raise LayoutError(f"tensor {name!r}: cannot cast {dtype_name(spec.dtype)} to {dtype_name(p.dtype)}")
    by_buffer = _buffer_precisions(destination, precs)
    specs, tables = {}, {}
    scale_cache: dict[tuple, PieceTable] = {}
    for name, spec in destination.specs.items():
        p, t = precs[name], destination.tables[name]
        if not isinstance(p, FP8Block):
            specs[name], tables[name] = spec, t
            continue
        check_whole_blocks(name, t, spec.shape, p.block)
        specs[name], tables[name] = TensorSpec(name, spec.shape, FP8_DTYPE), t
        key = (id(t.offsets), id(t.sizes), id(t.buffer_offsets), t.one_buffer(), p.block)
        st = scale_cache.get(key)
        if st is None or st.buffers != tuple(scale_name(x) for x in t.buffers):
            st = scale_cache[key] = _scale_table(t, p.block)
        sname = scale_name(name)
        specs[sname] = TensorSpec(sname, grid_shape(spec.shape, p.block), SCALE_DTYPE)
        tables[sname] = st
    buffers: dict[int, dict] = {}
    converted: dict[tuple, dict] = {}  # ranks with equal buffers share the result
    for r in destination.ranks:
        named = destination.buffers(r)
        key = tuple(named.items())
        hit = converted.get(key)
        if hit is None:
            hit = {}
            for b, (shape, dt) in named.items():
                p = by_buffer.get(b, KEEP)
                if isinstance(p, Cast):
                    hit[b] = (shape, p.dtype)
                elif isinstance(p, FP8Block):
                    if len(shape) < 2:
                        raise LayoutError(f"rank {r} buffer {b!r}: block FP8 needs buffers of 2 or more dims, "
                                          f"this one has shape {shape}")
                    hit[b] = (shape, FP8_DTYPE)
                    hit[scale_name(b)] = (tuple(shape[:-2]) + grid_shape(shape[-2:], p.block), SCALE_DTYPE)
                else:
                    hit[b] = (shape, dt)
            clash = [b for b in hit if b.endswith(SCALE_SUFFIX) and b in named and hit[b] != named[b]]
            if clash:
                raise LayoutError(f"rank {r} buffer {clash[0]!r}: the name of an FP8 buffer's scales is taken by "
                                  f"another buffer")
            converted[key] = hit
        buffers[r] = hit
    return Layout(specs, tables, buffers, validate=None)


def layout_precisions(destination: Layout, policy: DtypePolicy | str | None = None) -> dict[str, Precision]:
    """``{tensor: precision}`` of every destination tensor under ``policy``."""
    policy = as_policy(policy)
    return {name: policy(spec) for name, spec in destination.specs.items()}


# ---------------------------------------------------------------------------- the plan
class _Geometry(NamedTuple):
    """One FP8 tensor's block paths (shared by tensors of one geometry). Rows index tables."""

    grid: tuple[int, int]
    whole_rows: np.ndarray  # source piece rows that hold >= 1 whole block
    whole_lo: np.ndarray  # their whole-block grid boxes [k, 2]
    whole_hi: np.ndarray
    rect_lo: np.ndarray  # disjoint rectangles tiling the grid
    rect_hi: np.ndarray
    rect_covered: np.ndarray  # True: quantized at a source
    fp8_rows: np.ndarray  # destination piece of each FP8-path box
    fp8_lo: np.ndarray  # grid boxes [k, 2]
    fp8_hi: np.ndarray
    raw_rows: np.ndarray  # destination piece of each raw-path box
    raw_lo: np.ndarray
    raw_hi: np.ndarray


def _geometry(shape, block, st: PieceTable, dt: PieceTable) -> _Geometry:
    grid = grid_shape(shape, block)
    slo, shi = _grid_boxes(st.offsets, st.sizes, shape, block)
    whole = np.flatnonzero((shi > slo).all(axis=1))
    rlo, rhi, cov = _regions(grid, slo[whole], shi[whole])
    b = np.array(block, np.int64)
    dlo = dt.offsets // b
    dhi = -(-(dt.offsets + dt.sizes) // b)
    live = np.flatnonzero((dt.sizes > 0).all(axis=1))
    di, ri, lo, hi = _intersect(dlo[live], dhi[live], rlo, rhi)
    di = live[di]
    f, r = cov[ri], ~cov[ri]
    return _Geometry(grid, whole, slo[whole], shi[whole], rlo, rhi, cov, di[f], lo[f], hi[f], di[r], lo[r], hi[r])


def _staging_names(prefix: str, ranks: np.ndarray) -> tuple | Repeated:
    """``prefix + k`` for the k-th piece of each rank (``Repeated`` when every rank has one)."""
    if len(np.unique(ranks)) == len(ranks):
        return Repeated(f"{prefix}0", len(ranks))
    seen: dict[int, int] = defaultdict(int)
    out = []
    for r in ranks.tolist():
        out.append(f"{prefix}{seen[r]}")
        seen[r] += 1
    return tuple(out)


@dataclass
class Fp8Tensor:
    """One FP8 tensor of a :class:`PrecisionPlan`: its format, its source dtype and block paths."""

    name: str
    precision: FP8Block
    source_dtype: torch.dtype  # the dtype raw blocks cross in, and the reference quantizer reads
    geometry: _Geometry
    # where each destination raw box is quantized into: engine buffer and offsets, scale buffer and offsets
    raw_names: tuple | Repeated = ()
    raw_ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    whole_names: tuple | Repeated = ()  # source staging names (fp8; scales: scale_name(...) of the tensor)
    whole_ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def block(self) -> tuple[int, int]:
        return self.precision.block


class QuantTask(NamedTuple):
    """Quantize one box of whole blocks: read ``sizes`` elements at ``src_offsets`` of ``src_buffer``,
    write FP8 values at ``q_offsets`` of ``q_buffer`` and scales at ``s_offsets`` of ``s_buffer``."""

    tensor: str
    src_buffer: str
    src_offsets: tuple[int, ...]
    sizes: tuple[int, int]
    q_buffer: str
    q_offsets: tuple[int, ...]
    s_buffer: str
    s_offsets: tuple[int, ...]
    block: tuple[int, int]
    ue8m0: bool

    @property
    def blocks(self) -> int:
        return int(np.prod(grid_shape(self.sizes, self.block)))


class PrecisionPlan:
    """The refit of ``destination`` from ``source`` with each tensor in its ``policy`` precision (a
    :class:`~reshard.planning.plan.PhasedPlan`; see module doc).

    ``destination`` is the layout as the engine would hold it at the source's precision (a
    ``vllm_layout``); :attr:`destination` is the layout under the policy
    (:func:`precision_layout`): the buffers a run writes. :attr:`wire` is the plan that moves
    the bytes (hierarchical over ``domains`` when given); :meth:`source_tasks` / :meth:`destination_tasks`
    say what each rank quantizes before and after it.
    """

    @without_gc
    def __init__(self, source: Layout, destination: Layout, policy: DtypePolicy | str | None = None, *,
                 max_bucket_bytes: int | None = None, domains: Mapping[int, int] | None = None) -> None:
        check_pair(source, destination)
        self.policy = as_policy(policy)
        self.source = source
        self.max_bucket_bytes = max_bucket_bytes
        self.domains = None if domains is None else dict(domains)
        self.destination = precision_layout(destination, self.policy)
        self.precisions = layout_precisions(destination, self.policy)
        self.fp8: dict[str, Fp8Tensor] = {}
        src_specs, src_tables = {}, {}
        dst_specs, dst_tables = {}, {}
        src_staging: dict[int, dict] = defaultdict(dict)
        dst_staging: dict[int, dict] = defaultdict(dict)
        geometries: dict[tuple, _Geometry] = {}
        for name, spec in destination.specs.items():
            prec = self.precisions[name]
            if name not in source.specs:  # a destination tensor no rank holds (check_pair allows it)
                continue
            st = source.tables[name]
            if not isinstance(prec, FP8Block):
                src_specs[name], src_tables[name] = source.specs[name], st
                dst_specs[name], dst_tables[name] = self.destination.specs[name], self.destination.tables[name]
                continue
            dt = self.destination.tables[name]
            if not len(dt):
                continue
            sdt = source.uniform_dtype(name)
            if sdt is None:
                raise LayoutError(f"tensor {name!r}: source ranks hold it in buffers of several dtypes "
                                  f"({sorted({dtype_name(d) for d in source.piece_dtypes(name)})}); block FP8 "
                                  f"quantizes from one source precision")
            key = (spec.shape, prec.block, st.geometry_key(), dt.geometry_key())
            g = geometries.get(key)
            if g is None:
                g = geometries[key] = _geometry(spec.shape, prec.block, st, dt)
            info = Fp8Tensor(name, prec, sdt, g)
            self.fp8[name] = info
            sname = scale_name(name)
            # the wire: fp8 values and scales from source staging, raw blocks into destination staging
            if len(g.fp8_rows):
                ranks = st.ranks[g.whole_rows]
                info.whole_ranks = ranks
                info.whole_names = _staging_names(name + FP8_STAGING, ranks)
                elo, esz = _element_boxes(g.whole_lo, g.whole_hi, spec.shape, prec.block)
                src_specs[name] = TensorSpec(name, spec.shape, FP8_DTYPE)
                src_tables[name] = PieceTable(ranks, elo, esz, info.whole_names, np.zeros_like(elo))
                src_specs[sname] = TensorSpec(sname, g.grid, SCALE_DTYPE)
                snames = _staging_names(sname + FP8_STAGING, ranks)  # the k-th scale staging of a rank: its k-th values
                src_tables[sname] = PieceTable(ranks, g.whole_lo, g.whole_hi - g.whole_lo, snames,
                                               np.zeros_like(g.whole_lo))
                for r, qn, sn, sz, gsz in zip(ranks.tolist(), info.whole_names, snames, esz.tolist(),
                                              (g.whole_hi - g.whole_lo).tolist()):
                    src_staging[r][qn] = (tuple(sz), FP8_DTYPE)
                    src_staging[r][sn] = (tuple(gsz), SCALE_DTYPE)
                rows = g.fp8_rows
                elo, esz = _element_boxes(g.fp8_lo, g.fp8_hi, spec.shape, prec.block)
                bo = dt.buffer_offsets[rows].copy()
                bo[:, -2:] += elo - dt.offsets[rows]
                bufs = (Repeated(dt.one_buffer(), len(rows)) if dt.one_buffer() is not None
                        else tuple(dt.buffers[i] for i in rows.tolist()))
                dst_specs[name] = self.destination.specs[name]
                dst_tables[name] = PieceTable(dt.ranks[rows], elo, esz, bufs, bo)
                sdt_table = self.destination.tables[sname]
                sbo = sdt_table.buffer_offsets[rows].copy()
                sbo[:, -2:] += g.fp8_lo - sdt_table.offsets[rows]
                sbufs = (Repeated(sdt_table.one_buffer(), len(rows)) if sdt_table.one_buffer() is not None
                         else tuple(sdt_table.buffers[i] for i in rows.tolist()))
                dst_specs[sname] = self.destination.specs[sname]
                dst_tables[sname] = PieceTable(dt.ranks[rows], g.fp8_lo, g.fp8_hi - g.fp8_lo, sbufs, sbo)
            if len(g.raw_rows):
                rname = name + RAW_SUFFIX
                ranks = dt.ranks[g.raw_rows]
                info.raw_ranks = ranks
                info.raw_names = _staging_names(rname + "/", ranks)
                elo, esz = _element_boxes(g.raw_lo, g.raw_hi, spec.shape, prec.block)
                src_specs[rname] = TensorSpec(rname, spec.shape, sdt)
                src_tables[rname] = st
                dst_specs[rname] = TensorSpec(rname, spec.shape, sdt)
                dst_tables[rname] = PieceTable(ranks, elo, esz, info.raw_names, np.zeros_like(elo))
                for r, n, sz in zip(ranks.tolist(), info.raw_names, esz.tolist()):
                    dst_staging[r][n] = (tuple(sz), sdt)
        self.source_staging = dict(src_staging)
        self.destination_staging = dict(dst_staging)
        wire_src = Layout(src_specs, src_tables, _with(source, src_staging), validate=None)
        wire_dst = Layout(dst_specs, dst_tables, _with(self.destination, dst_staging), validate=None)
        self.wire = (hierarchical_plan(wire_src, wire_dst, self.domains, max_bucket_bytes=max_bucket_bytes)
                     if self.domains else Plan(wire_src, wire_dst, max_bucket_bytes=max_bucket_bytes))
        self._fingerprint: str | None = None

    # ------------------------------------------------------------------ PhasedPlan
    @property
    def phases(self) -> list[Plan]:
        return self.wire.phases

    @property
    def phase_names(self) -> list[str]:
        return self.wire.phase_names

    @property
    def wire_bytes(self) -> int:
        """Bytes sent between ranks: FP8 values, scales, raw blocks and the other tensors."""
        return self.wire.wire_bytes

    def fingerprint(self) -> str:
        """Equal on ranks with the same layouts, policy (:attr:`DtypePolicy.key`) and options."""
        if self._fingerprint is None:
            h = hashlib.sha256(f"precision-plan-{PRECISION_PLAN_FORMAT}\0{self.policy.key}\0".encode())
            h.update(self.wire.fingerprint().encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    # ------------------------------------------------------------------ figures
    def _tensor_wire_bytes(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for phase in self.wire.phases:
            for n, b in phase.tensor_wire_bytes().items():
                out[n] += b
        return dict(out)

    def wire_bytes_by_dtype(self) -> dict[str, int]:
        """Bytes between ranks by the dtype they cross in, ``{'float8_e4m3fn': ..., 'float32': ...}``."""
        out: dict[str, int] = defaultdict(int)
        for phase in self.wire.phases:
            dst = phase.destination
            for n, b in phase.tensor_wire_bytes().items():
                if b:
                    out[dtype_name(_uniform(dst, n))] += b
        return dict(sorted(out.items()))

    def wire_bytes_by_path(self) -> dict[str, int]:
        """Bytes between ranks by what they are: ``fp8`` (values quantized at a source), ``scales`` (theirs),
        ``raw`` (blocks crossing in the source's precision) and ``other`` (kept or cast tensors)."""
        out = {"fp8": 0, "scales": 0, "raw": 0, "other": 0}
        for n, b in self._tensor_wire_bytes().items():
            if n.endswith(RAW_SUFFIX):
                out["raw"] += b
            elif n in self.fp8:
                out["fp8"] += b
            elif n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in self.fp8:
                out["scales"] += b
            else:
                out["other"] += b
        return out

    def block_paths(self, name: str) -> np.ndarray:
        """Where each block of FP8 tensor ``name`` is quantized: :data:`SOURCE` (1) on a source rank that
        holds it whole, :data:`DESTINATION` (2) on the destination ranks that hold it; int8 [grid]."""
        g = self._info(name).geometry
        out = np.zeros(g.grid, np.int8)
        for lo, hi, c in zip(g.rect_lo.tolist(), g.rect_hi.tolist(), g.rect_covered.tolist()):
            out[lo[0]:hi[0], lo[1]:hi[1]] = SOURCE if c else DESTINATION
        return out

    def tensor_paths(self) -> dict[str, dict[str, int]]:
        """Per FP8 tensor: ``blocks`` (its grid), ``source`` / ``destination`` (blocks quantized on a source
        rank / on destination ranks), ``raw_bytes`` (raw blocks' bytes, once per destination that takes them)."""
        out = {}
        for name, info in self.fp8.items():
            paths = self.block_paths(name)
            g = info.geometry
            sizes = _element_boxes(g.raw_lo, g.raw_hi, self.destination.specs[name].shape, info.block)[1]
            raw = int(sizes.prod(axis=1).sum())
            out[name] = {"blocks": int(paths.size), "source": int((paths == SOURCE).sum()),
                         "destination": int((paths == DESTINATION).sum()),
                         "raw_bytes": raw * info.source_dtype.itemsize}
        return out

    def staging_bytes(self) -> dict[str, dict[int, int]]:
        """Staging each rank allocates for the quantization: ``source`` (FP8 values and scales of its
        whole blocks) and ``destination`` (raw blocks, in the source's precision)."""
        def total(staging):
            return {r: sum(int(np.prod(s)) * d.itemsize for s, d in named.values()) for r, named in staging.items()}
        return {"source": total(self.source_staging), "destination": total(self.destination_staging)}

    def summary(self) -> dict:
        paths = self.tensor_paths()
        return {"policy": self.policy.key, "fp8_tensors": len(self.fp8),
                "blocks_at_source": sum(p["source"] for p in paths.values()),
                "blocks_at_destination": sum(p["destination"] for p in paths.values()),
                "wire_bytes": self.wire_bytes, "wire_bytes_by_dtype": self.wire_bytes_by_dtype(),
                "wire_bytes_by_path": self.wire_bytes_by_path(), "wire": self.wire.summary()}

    def __repr__(self) -> str:
        return f"PrecisionPlan({len(self.fp8)} FP8 tensors, wire_bytes={self.wire_bytes}, policy {self.policy.key!r})"

    # ------------------------------------------------------------------ quantization per rank
    def _info(self, name: str) -> Fp8Tensor:
        try:
            return self.fp8[name]
        except KeyError:
            raise LayoutError(f"tensor {name!r} is not an FP8 tensor of this plan") from None

    def source_tasks(self, rank: int, sends: Iterable[Copy]) -> list[QuantTask]:
        """What ``rank`` quantizes before the transfer: for each of its source staging buffers that the
        copies ``sends`` (its first phase's sends and local copies) read, the smallest box of whole blocks
        that covers what they read, values and scales alike (so each block is quantized once here)."""
        boxes: dict[str, list] = {}
        for c in sends:
            base, sep, k = c.src_buffer.rpartition(FP8_STAGING)
            if not sep:
                continue
            if base in self.fp8:
                name, scale = base, False
            elif base.endswith(SCALE_SUFFIX) and base[: -len(SCALE_SUFFIX)] in self.fp8:
                name, scale = base[: -len(SCALE_SUFFIX)], True
            else:
                continue
            b = self.fp8[name].block
            lo = [o * (b[d] if scale else 1) for d, o in enumerate(c.src_offsets)]
            hi = [(o + s) * (b[d] if scale else 1) for d, (o, s) in enumerate(zip(c.src_offsets, c.sizes))]
            key = name + FP8_STAGING + k
            cur = boxes.get(key)
            boxes[key] = [lo, hi] if cur is None else [[min(a, x) for a, x in zip(cur[0], lo)],
                                                     [max(a, x) for a, x in zip(cur[1], hi)]]
        out = []
        for key, (lo, hi) in boxes.items():
            name, _, k = key.rpartition(FP8_STAGING)
            info = self.fp8[name]
            b = info.block
            src_buf, origin, extent = self._staging_origin(rank, info, key)
            lo = [x - x % bd for x, bd in zip(lo, b)]
            hi = [min(-(-x // bd) * bd, e) for x, bd, e in zip(hi, b, extent)]
            sizes = (hi[0] - lo[0], hi[1] - lo[1])
            src_off = tuple(origin[:-2]) + tuple(o + x for o, x in zip(origin[-2:], lo))
            out.append(QuantTask(name, src_buf, src_off, sizes, key, tuple(lo),
                                 scale_name(name) + FP8_STAGING + k, (lo[0] // b[0], lo[1] // b[1]), b,
                                 info.precision.ue8m0))
        return out

    def _staging_origin(self, rank: int, info: Fp8Tensor, key: str) -> tuple[str, tuple[int, ...], tuple[int, int]]:
        """(source buffer, buffer offsets of the staging box's first element, staging shape) of staging ``key``."""
        rows = np.flatnonzero(info.whole_ranks == rank)
        names = [info.whole_names[i] for i in rows.tolist()]
        i = int(rows[names.index(key)])
        g = info.geometry
        st = self.source.tables[info.name]
        piece = int(g.whole_rows[i])
        lo, size = _element_boxes(g.whole_lo[i:i + 1], g.whole_hi[i:i + 1], self.source.specs[info.name].shape,
                                  info.block)
        origin = st.buffer_offsets[piece].copy()
        origin[-2:] += lo[0] - st.offsets[piece]
        return st.buffers[piece], tuple(origin.tolist()), tuple(size[0].tolist())

    def destination_tasks(self, rank: int) -> list[QuantTask]:
        """What ``rank`` quantizes after the transfer: each raw staging buffer it received, into its FP8
        buffer and scale buffer."""
        out = []
        for name, info in self.fp8.items():
            rows = np.flatnonzero(info.raw_ranks == rank)
            if not len(rows):
                continue
            g = info.geometry
            dt = self.destination.tables[name]
            st = self.destination.tables[scale_name(name)]
            pieces = g.raw_rows[rows]
            elo, esz = _element_boxes(g.raw_lo[rows], g.raw_hi[rows], self.destination.specs[name].shape, info.block)
            for j, i, p, lo, sz, glo in zip(rows.tolist(), range(len(rows)), pieces.tolist(), elo.tolist(),
                                            esz.tolist(), g.raw_lo[rows].tolist()):
                qo = dt.buffer_offsets[p].copy()
                qo[-2:] += np.array(lo) - dt.offsets[p]
                so = st.buffer_offsets[p].copy()
                so[-2:] += np.array(glo) - st.offsets[p]
                out.append(QuantTask(name, info.raw_names[j], (0, 0), tuple(sz), dt.buffers[p], tuple(qo.tolist()),
                                     st.buffers[p], tuple(so.tolist()), info.block, info.precision.ue8m0))
        return out


def _uniform(layout: Layout, name: str) -> torch.dtype:
    dt = layout.uniform_dtype(name)
    return dt if dt is not None else layout.specs[name].dtype


def _with(layout: Layout, staging: Mapping[int, Mapping]) -> dict[int, dict]:
    """``layout``'s buffers plus ``staging`` (``{rank: {name: (shape, dtype)}}``)."""
    out = {r: layout.buffers(r) for r in layout.ranks}
    for r, named in staging.items():
        out[r] = {**out.get(r, {}), **named}
    return out


def precision_plan(source: Layout, destination: Layout, policy: DtypePolicy | str | None = None, *,
                   max_bucket_bytes: int | None = None, domains: Mapping[int, int] | None = None) -> PrecisionPlan:
    """Plan the refit of ``destination`` from ``source`` in ``policy``'s precisions (see :class:`PrecisionPlan`)."""
    return PrecisionPlan(source, destination, policy, max_bucket_bytes=max_bucket_bytes, domains=domains)


__all__ = ["Cast", "DESTINATION", "DtypePolicy", "FP8Block", "FP8_PATTERNS", "Fp8Tensor", "KEEP", "Keep",
           "Precision", "PrecisionPlan", "QuantTask", "RAW_SUFFIX", "SOURCE", "as_policy", "check_whole_blocks",
           "layout_precisions", "precision_layout", "precision_plan"]
