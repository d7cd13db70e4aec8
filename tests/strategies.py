"""Hypothesis strategies for random (source, destination) layout pairs, and test oracles.

A drawn :class:`Case` carries a *recipe* (plain frozen data: which tensors, which
meshes, placements, split rules, buffers and dtypes on each side) plus the two
layouts built from it and full logical tensors with distinct values. Building the
layouts again from the recipe gives an independent but equivalent construction
(used by the determinism tests).

What the recipes cover:

* tensors of 1..4 dims, 0..12 per dim (total size capped so examples stay small),
  sizes that do not divide;
* meshes of 1..3 dims and up to 8 ranks, ranks in random order;
* ``Shard``, ``Replicate``, ``StridedShard(split_factor 1..3)``, several mesh dims
  on one tensor dim, cross-dim (source and destination shard different dims);
* the three split rules; ``"even"`` only where it divides (see :func:`even_divides`);
* replicas, M != N, colocated ranks (source and destination rank sets overlap);
* several tensors per side (``Layout.merge``);
* two source layouts of one tensor merged (partially overlapping source boxes);
* two destination layouts of one tensor on one side, possibly identical (a
  destination rank holding the same box in two buffers);
* fused row buffers (q, k, v pieces stacked in one buffer per rank, with padding
  rows no piece covers);
* expert buffers with more dims than the tensor: ``[local_experts, r, c]``
  holding 2-D experts at ``buffer_offsets (e, ...)``, experts split over
  expert-parallel groups;
* buffer dtypes that differ from the tensor's (float32 -> bfloat16/float16, int
  widths).

Every value of a full tensor is exactly representable in float32, bfloat16 and
float16 (or in int16/32/64), so any chain of casts preserves it and results can
be compared bitwise.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from hypothesis import strategies as st

import reshard as rs
from reshard.tensors import Piece, box_slices, buffer_view

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64, torch.int16)
SPLITS = ("chunk", "balanced", "even")
MAX_RANKS = 8  # per mesh
RANK_POOL = 8  # ranks of one side are drawn from base .. base + RANK_POOL - 1


# ---------------------------------------------------------------------------- recipes
@dataclass(frozen=True)
class View:
    """One ``Layout.from_placements`` of a tensor (or of each tensor of a group)."""

    ranks: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple
    split: str
    buffer: str
    dtype: torch.dtype


@dataclass(frozen=True)
class PlainTensor:
    """One tensor, each view in its own buffer; ``src`` has >= 1 view, ``dst`` may have none."""

    spec: rs.TensorSpec
    src: tuple[View, ...]
    dst: tuple[View, ...]


@dataclass(frozen=True)
class FusedView:
    """All tensors of a :class:`FusedRows` group laid out by ``view`` and stacked along
    dim 0 of one buffer per rank (q_r, k_r, v_r), followed by ``pad`` rows no piece covers."""

    view: View
    pad: int


@dataclass(frozen=True)
class FusedRows:
    specs: tuple[rs.TensorSpec, ...]
    src: tuple[FusedView, ...]
    dst: tuple[FusedView, ...]


@dataclass(frozen=True)
class ExpertView:
    """Experts split contiguously over ``groups`` (remainder to the first groups); each expert
    laid out by placements over its group's ranks; rank buffer ``[local_experts, *local_shape]``."""

    groups: tuple[tuple[int, ...], ...]
    mesh_shape: tuple[int, ...]
    placements: tuple
    split: str
    buffer: str
    dtype: torch.dtype


@dataclass(frozen=True)
class Experts:
    specs: tuple[rs.TensorSpec, ...]
    src: tuple[ExpertView, ...]
    dst: tuple[ExpertView, ...]


Item = PlainTensor | FusedRows | Experts


@dataclass(frozen=True)
class Recipe:
    items: tuple[Item, ...]

    @property
    def specs(self) -> list[rs.TensorSpec]:
        out = []
        for it in self.items:
            out.extend([it.spec] if isinstance(it, PlainTensor) else it.specs)
        return out


@dataclass(eq=False)
class Case:
    recipe: Recipe
    source: rs.Layout
    destination: rs.Layout
    full: dict[str, torch.Tensor]

    def __repr__(self) -> str:
        return f"Case(source={self.source!r}, destination={self.destination!r}, recipe={self.recipe!r})"


# ---------------------------------------------------------------------------- building
def view_layout(spec: rs.TensorSpec, v: View, buffer: str | None = None) -> rs.Layout:
    return rs.Layout.from_placements(spec, list(v.ranks), v.mesh_shape, list(v.placements), v.split,
                                     buffer=buffer or v.buffer, dtype=v.dtype)


def fused_rows_layout(specs: Sequence[rs.TensorSpec], fv: FusedView) -> rs.Layout:
    v = fv.view
    pieces: list[Piece] = []
    rows = {r: 0 for r in v.ranks}
    trailing: dict[int, tuple[int, ...]] = {}
    for spec in specs:
        lay = view_layout(spec, v, buffer="_tmp")
        for r in v.ranks:
            shape = lay.buffers(r)["_tmp"][0]
            assert trailing.setdefault(r, shape[1:]) == shape[1:], "fused tensors disagree on trailing dims"
            for p in lay.pieces(r):
                bo = (p.buffer_offsets[0] + rows[r],) + p.buffer_offsets[1:]
                pieces.append(p._replace(buffer=v.buffer, buffer_offsets=bo))
            rows[r] += shape[0]
    buffers = {r: {v.buffer: ((rows[r] + fv.pad,) + trailing[r], v.dtype)} for r in v.ranks}
    return rs.Layout.from_pieces(specs, pieces, buffers)


def expert_ranges(n_experts: int, n_groups: int) -> list[range]:
    """Contiguous experts per group, the remainder going to the first groups (vLLM's EP rule)."""
    q, rem = divmod(n_experts, n_groups)
    out, start = [], 0
    for g in range(n_groups):
        n = q + (1 if g < rem else 0)
        out.append(range(start, start + n))
        start += n
    return out


def experts_layout(specs: Sequence[rs.TensorSpec], ev: ExpertView) -> rs.Layout:
    pieces: list[Piece] = []
    buffers: dict[int, dict] = {}
    for granks, experts in zip(ev.groups, expert_ranges(len(specs), len(ev.groups))):
        for local, e in enumerate(experts):
            v = View(granks, ev.mesh_shape, ev.placements, ev.split, "_tmp", ev.dtype)
            lay = view_layout(specs[e], v)
            for r in granks:
                shape = lay.buffers(r)["_tmp"][0]
                buffers[r] = {ev.buffer: ((len(experts),) + shape, ev.dtype)}
                for p in lay.pieces(r):
                    pieces.append(p._replace(buffer=ev.buffer, buffer_offsets=(local,) + p.buffer_offsets))
    return rs.Layout.from_pieces(specs, pieces, buffers)


def side_layouts(item: Item, side: str) -> list[rs.Layout]:
    views = getattr(item, side)
    if isinstance(item, PlainTensor):
        return [view_layout(item.spec, v) for v in views]
    if isinstance(item, FusedRows):
        return [fused_rows_layout(item.specs, fv) for fv in views]
    return [experts_layout(item.specs, ev) for ev in views]


def build(recipe: Recipe) -> tuple[rs.Layout, rs.Layout]:
    """(source, destination) layouts of a recipe, built from scratch."""
    src = [lay for it in recipe.items for lay in side_layouts(it, "src")]
    dst = [lay for it in recipe.items for lay in side_layouts(it, "dst")]
    return rs.Layout.merge(src), rs.Layout.merge(dst)


def rebuild_from_tables(layout: rs.Layout) -> rs.Layout:
    """The same layout rebuilt through ``Layout.from_pieces`` from its pieces (same order)."""
    pieces = []
    for name, t in layout.tables.items():
        for i in range(len(t)):
            pieces.append(Piece(name, tuple(t.offsets[i].tolist()), tuple(t.sizes[i].tolist()), t.buffers[i],
                                tuple(t.buffer_offsets[i].tolist()), int(t.ranks[i])))
    buffers = {r: layout.buffers(r) for r in layout.ranks}
    return rs.Layout.from_pieces(list(layout.specs.values()), pieces, buffers)


# ---------------------------------------------------------------------------- values and oracles
def distinct_values(numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """``numel`` distinct (up to 3712 / 30000) positive values, exact in every dtype of their class."""
    idx = torch.arange(numel, dtype=torch.int64) + salt * 397
    if dtype.is_floating_point:
        # bfloat16 bit patterns from 2**-14 up to just under 2**15: exact in bf16, fp16 and fp32.
        bits = (0x3880 + idx % 3712).to(torch.int16)
        return bits.view(torch.bfloat16).to(dtype)
    return (idx % 30000).to(dtype)


def full_tensors(specs: Sequence[rs.TensorSpec]) -> dict[str, torch.Tensor]:
    return {s.name: distinct_values(s.numel, s.dtype, salt=i).reshape(s.shape) for i, s in enumerate(specs)}


SENTINEL = -1  # never a value of distinct_values


def fill(layout: rs.Layout, rank: int, full: dict[str, torch.Tensor], sentinel=SENTINEL) -> dict[str, torch.Tensor]:
    """``rank``'s buffers: sentinel everywhere, each piece's box of the full tensor (cast) at its place.

    Written independently of ``Layout.materialize`` so that it can serve as an oracle.
    """
    out = {b: torch.full(shape, sentinel, dtype=dt) for b, (shape, dt) in layout.buffers(rank).items()}
    for p in layout.pieces(rank):
        buf = out[p.buffer]
        lead = len(p.buffer_offsets) - len(p.sizes)
        index = tuple(p.buffer_offsets[:lead]) + tuple(
            slice(o, o + s) for o, s in zip(p.buffer_offsets[lead:], p.sizes))
        buf[index] = full[p.tensor][tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))].to(buf.dtype)
    return out


def coverage(layout: rs.Layout, rank: int) -> dict[str, torch.Tensor]:
    """Per buffer of ``rank``: int32 count of pieces covering each element."""
    out = {b: torch.zeros(shape, dtype=torch.int32) for b, (shape, _) in layout.buffers(rank).items()}
    for p in layout.pieces(rank):
        buffer_view(out[p.buffer], p.buffer_offsets, p.sizes).add_(1)
    return out


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def box_mask(shape: Sequence[int], pieces) -> np.ndarray:
    m = np.zeros(tuple(shape), bool)
    for p in pieces:
        m[box_slices(p.offsets, p.sizes)] = True
    return m


def min_wire_bytes(source: rs.Layout, destination: rs.Layout) -> tuple[int, int]:
    """(lower, upper) bound of the minimum wire bytes; equal when each destination rank keeps all its
    pieces of a tensor in one dtype. Per destination rank and tensor: elements of the union of its
    boxes not held by that rank in the source, times the destination itemsize."""
    lo = hi = 0
    for r in destination.ranks:
        dst_pieces = defaultdict(list)
        for p in destination.pieces(r):
            dst_pieces[p.tensor].append(p)
        src_pieces = defaultdict(list)
        for p in source.pieces(r):
            src_pieces[p.tensor].append(p)
        bufs = destination.buffers(r)
        for name, plist in dst_pieces.items():
            shape = destination.specs[name].shape
            n = int((box_mask(shape, plist) & ~box_mask(shape, src_pieces[name])).sum())
            sizes = {torch.empty((), dtype=bufs[p.buffer][1]).element_size() for p in plist}
            lo += n * min(sizes)
            hi += n * max(sizes)
    return lo, hi


def even_divides(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence) -> bool:
    """Whether ``split="even"`` is legal: every split, applied left to right, divides exactly."""
    local = list(shape)
    for k, p in zip(mesh_shape, placements):
        if isinstance(p, rs.Shard):
            if local[p.dim] % k:
                return False
            local[p.dim] //= k
        elif isinstance(p, rs.StridedShard):
            if local[p.dim] % (k * p.split_factor):
                return False
            local[p.dim] //= k
    return True


# ---------------------------------------------------------------------------- strategies
@st.composite
def shapes(draw, min_ndim: int = 1, max_ndim: int = 4, max_dim: int = 12, budget: int = 720) -> tuple[int, ...]:
    """Up to ``max_ndim`` dims of 0..``max_dim``, product capped near ``budget``, in random order."""
    ndim = draw(st.integers(min_ndim, max_ndim))
    dims = []
    for _ in range(ndim):
        d = draw(st.integers(0, max(1, min(max_dim, budget))))
        dims.append(d)
        budget //= max(d, 1)
    return tuple(draw(st.permutations(dims)))


@st.composite
def mesh_shapes(draw, max_ranks: int = MAX_RANKS, max_dims: int = 3) -> tuple[int, ...]:
    ndim = draw(st.integers(1, max_dims))
    out, budget = [], max_ranks
    for _ in range(ndim):
        m = draw(st.integers(1, max(1, budget)))
        out.append(m)
        budget //= m
    return tuple(out)


def placements_for(tensor_ndim: int, mesh_ndim: int, strided: bool = True):
    one = [st.just(rs.Replicate()), st.builds(rs.Shard, st.integers(0, tensor_ndim - 1))]
    if strided:
        one.append(st.builds(rs.StridedShard, st.integers(0, tensor_ndim - 1), st.integers(1, 3)))
    return st.tuples(*[st.one_of(one) for _ in range(mesh_ndim)])


@st.composite
def views(draw, shapes_: Sequence[tuple[int, ...]], base: int, buffer: str, dtype_class: str,
          max_ranks: int = MAX_RANKS, pool: int = RANK_POOL) -> View:
    """A placement view valid for every shape in ``shapes_`` (they share a number of dims)."""
    mesh = draw(mesh_shapes(max_ranks))
    ranks = tuple(draw(st.permutations(range(base, base + pool)))[: math.prod(mesh)])
    placements = draw(placements_for(len(shapes_[0]), len(mesh)))
    split = draw(st.sampled_from(SPLITS))
    if split == "even" and not all(even_divides(s, mesh, placements) for s in shapes_):
        split = "chunk"
    dtype = draw(st.sampled_from(FLOAT_DTYPES if dtype_class == "float" else INT_DTYPES))
    return View(ranks, mesh, placements, split, buffer, dtype)


def _spec_dtype(draw, cls: str) -> torch.dtype:
    return draw(st.sampled_from((torch.float32, torch.bfloat16) if cls == "float" else (torch.int32, torch.int64)))


@st.composite
def plain_tensors(draw, name: str, dst_base: int) -> PlainTensor:
    cls = draw(st.sampled_from(("float", "float", "float", "int")))
    spec = rs.TensorSpec(name, draw(shapes()), _spec_dtype(draw, cls))
    n_src = draw(st.integers(1, 2))  # two: partially overlapping source boxes
    src = tuple(draw(views([spec.shape], 0, f"{name}.s{i}", cls)) for i in range(n_src))
    n_dst = draw(st.sampled_from((0, 1, 1, 1, 2, 2)))
    dst = []
    for i in range(n_dst):
        if i == 1 and draw(st.booleans()):
            # same box twice on a rank: the first view again in another buffer (maybe another dtype)
            dtype = draw(st.sampled_from(FLOAT_DTYPES if cls == "float" else INT_DTYPES))
            dst.append(View(dst[0].ranks, dst[0].mesh_shape, dst[0].placements, dst[0].split, f"{name}.d1", dtype))
        else:
            dst.append(draw(views([spec.shape], dst_base, f"{name}.d{i}", cls)))
    return PlainTensor(spec, src, tuple(dst))


@st.composite
def fused_rows(draw, prefix: str, dst_base: int) -> FusedRows:
    """q, k, v (or gate, up) tensors with equal trailing dims, stacked row-wise per rank."""
    n = draw(st.integers(2, 3))
    trailing = draw(shapes(min_ndim=0, max_ndim=2, max_dim=6, budget=24))
    dtype = _spec_dtype(draw, "float")
    specs = tuple(rs.TensorSpec(f"{prefix}.{'qkv'[i]}", (draw(st.integers(0, 9)),) + trailing, dtype)
                  for i in range(n))
    shp = [s.shape for s in specs]

    def fused(base, buffer):
        return FusedView(draw(views(shp, base, buffer, "float")), draw(st.integers(0, 2)))

    src = (fused(0, f"{prefix}.s"),)
    dst = tuple(fused(dst_base, f"{prefix}.d{i}") for i in range(draw(st.integers(1, 2))))
    return FusedRows(specs, src, dst)


@st.composite
def expert_views(draw, specs: Sequence[rs.TensorSpec], base: int, buffer: str) -> ExpertView:
    n_groups = draw(st.integers(1, min(len(specs), 4)))
    mesh = draw(mesh_shapes(max_ranks=MAX_RANKS // n_groups, max_dims=2))
    size = math.prod(mesh)
    ranks = draw(st.permutations(range(base, base + RANK_POOL)))[: n_groups * size]
    groups = tuple(tuple(ranks[g * size:(g + 1) * size]) for g in range(n_groups))
    placements = draw(placements_for(2, len(mesh)))
    split = draw(st.sampled_from(SPLITS))
    if split == "even" and not all(even_divides(s.shape, mesh, placements) for s in specs):
        split = "chunk"
    return ExpertView(groups, mesh, placements, split, buffer, draw(st.sampled_from(FLOAT_DTYPES)))


@st.composite
def experts(draw, prefix: str, dst_base: int) -> Experts:
    """2-D experts of one shape in 3-D ``[local_experts, r, c]`` buffers, expert parallel."""
    n = draw(st.integers(1, 4))
    shape = (draw(st.integers(0, 7)), draw(st.integers(0, 7)))
    dtype = _spec_dtype(draw, "float")
    specs = tuple(rs.TensorSpec(f"{prefix}.{e}", shape, dtype) for e in range(n))
    src = (draw(expert_views(specs, 0, f"{prefix}.s")),)
    dst = tuple(draw(expert_views(specs, dst_base, f"{prefix}.d{i}")) for i in range(draw(st.integers(1, 2))))
    return Experts(specs, src, dst)


@st.composite
def recipes(draw, max_plain: int = 3, groups: bool = True) -> Recipe:
    # 0: source and destination draw ranks from one pool (colocated); 8: disjoint
    dst_base = draw(st.sampled_from((0, 2, 4, 8)))
    items: list[Item] = []
    if groups and draw(st.integers(0, 3)) == 0:
        items.append(draw(fused_rows("qkv", dst_base)))
    if groups and draw(st.integers(0, 3)) == 0:
        items.append(draw(experts("moe", dst_base)))
    n_plain = draw(st.integers(0 if items else 1, max_plain))
    items.extend(draw(plain_tensors(f"t{i}", dst_base)) for i in range(n_plain))
    if not any(it.dst for it in items):
        first = items[0]
        assert isinstance(first, PlainTensor)
        cls = "float" if first.spec.dtype.is_floating_point else "int"
        items[0] = PlainTensor(first.spec, first.src, (draw(views([first.spec.shape], dst_base, "t0.d0", cls)),))
    order = draw(st.permutations(range(len(items))))  # tensor order in the merged layouts
    return Recipe(tuple(items[i] for i in order))


@st.composite
def layout_pairs(draw, max_plain: int = 3, groups: bool = True) -> Case:
    """A random (source, destination) pair with full tensors (see module doc)."""
    recipe = draw(recipes(max_plain, groups))
    src, dst = build(recipe)
    return Case(recipe, src, dst, full_tensors(recipe.specs))


# ---------------------------------------------------------------------------- running a plan by hand
def all_ranks(plan: rs.Plan) -> list[int]:
    return sorted(set(plan.source.ranks) | set(plan.destination.ranks))


def write_counts(plan: rs.Plan) -> dict[int, dict[str, torch.Tensor]]:
    """Per destination rank and buffer: how many times each element is written by the plan's copies
    (local copies, received message copies, fan-out copies), from ``plan.for_rank`` of every rank."""
    dst = plan.destination
    counts = {r: {b: torch.zeros(shape, dtype=torch.int32) for b, (shape, _) in dst.buffers(r).items()}
              for r in dst.ranks}
    for r in all_ranks(plan):
        rp = plan.for_rank(r)
        copies = list(rp.local) + list(rp.fanout) + [c for m in rp.recvs for c in m.copies]
        for c in copies:
            buffer_view(counts[r][c.dst_buffer], c.dst_offsets, c.sizes).add_(1)
    return counts




def run_precision_or_refused(plan, src_buffers, out) -> bool:
    """``run_local_precision(plan, src_buffers, out)``; False where the plan's cap is too small for the
    refit (a drawn cap can be): then the error names ``max_bucket_bytes`` and no byte of ``out`` moved."""
    from reshard.execution.precision import run_local_precision

    before = {r: {b: t.clone() for b, t in bufs.items()} for r, bufs in out.items()}
    try:
        run_local_precision(plan, src_buffers, out)
    except ValueError as e:
        if "too small" not in str(e):
            raise
        assert "max_bucket_bytes" in str(e), e
        assert all(torch.equal(out[r][b].view(torch.uint8), t.view(torch.uint8))
                   for r, bufs in before.items() for b, t in bufs.items()), "a refused refit wrote bytes"
        return False
    return True
