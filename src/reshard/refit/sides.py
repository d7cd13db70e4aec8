"""What one rank holds on one side of a refit: its own pieces, and the live tensors they are in.

A :class:`Side` is one rank's part of a layout (the pieces this rank holds and its buffers'
shapes and dtypes) plus the tensors behind those buffers: a trainer's parameter shards, an
engine's live parameters. When a session connects, every rank contributes its parts and gets
everyone's back (:class:`~reshard.refit.session.RefitSession`), so no rank has to know how the
other side is sharded.

    constructor                         reads
    Side.from_layout(layout, rank, t)   an explicit layout and this rank's tensors ``{buffer: tensor}``
    Side.from_module(module, rank)      a module's parameters and persistent buffers: DTensors (FSDP2,
                                        FSDP2 over TP, Hugging Face ``tp_plan``) by their placements,
                                        plain tensors as whole replicas; transformers 5's fused experts
                                        split back into checkpoint names
    Side.from_megatron(model, arch)     a Megatron-Core model: its parallel state and local parameters
    (DeepSpeed ZeRO-3 models: reshard.integrations.deepspeed.zero3_side)
    (vLLM engines: reshard.integrations.vllm)

A destination side may stage some buffers and post-process them after the bytes arrived
(:meth:`Side.begin_write` / :meth:`Side.end_write`); the session reports how many bytes were
written in place and how many went through that path.

>>> import torch, reshard as rs
>>> w = torch.nn.Linear(4, 2, bias=False)
>>> side = Side.from_module(w, rank=3)
>>> [(p.tensor, p.rank, p.sizes) for p in side.layout.pieces(3)]
[('weight', 3, (2, 4))]
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np
import torch

from ..gc_pause import without_gc
from ..layout import Layout
from ..models.arch import Segment, named_tensors, parameter_segments
from ..placements import from_torch_placement, local_pieces
from ..tensors import LayoutError, Piece, TensorSpec


IN_PLACE, REPROCESSED = "in place", "reprocessed"  # WriteReport.paths: written live, or staged and post-processed


@dataclass
class WriteReport:
    """Bytes a destination side took in one refit: written straight into live storage, or staged and
    put into place by the engine's own post-load path."""

    in_place_bytes: int = 0
    reprocessed_bytes: int = 0
    staging_bytes: int = 0  # peak extra memory for staged buffers
    paths: dict[str, str] = field(default_factory=dict)  # buffer -> the way its bytes went ("in place", ...)


@dataclass
class Side:
    """One rank's part of one side of a refit (see module doc)."""

    rank: int
    layout: Layout  # this rank's pieces and buffers only
    tensors: Mapping[str, torch.Tensor] = field(repr=False)  # buffer name -> live tensor

    def __post_init__(self) -> None:
        others = [r for r in self.layout.ranks if r != self.rank]
        if others:
            raise LayoutError(f"rank {self.rank}: its side's layout also holds pieces of rank {others[0]}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_layout(cls, layout: Layout, rank: int, tensors: Mapping[str, torch.Tensor]) -> "Side":
        """Rank ``rank``'s part of ``layout``, over ``tensors`` (``{buffer name: tensor}``)."""
        return cls(rank, layout.subset([rank]), dict(tensors))

    @classmethod
    def from_module(cls, module: torch.nn.Module, rank: int, *, rank_of: Mapping[int, int] | None = None,
                    names: Iterable[str] | None = None) -> "Side":
        """This rank's part of ``module``'s parameters (and persistent buffers), by ``state_dict`` name.

        A DTensor parameter is laid out by its placements over its device mesh, whose ranks are
        those of the process group it was made in; ``rank_of`` maps them to ranks of the refit
        group (default: the same numbers; ``rank`` is this process's rank in the refit group).
        Plain tensors are whole replicas on every rank that holds them. ``names`` keeps only these
        logical tensors (checkpoint names).
        """
        if any(hasattr(p, "ds_tensor") for p in module.parameters()):
            raise LayoutError(f"rank {rank}: the {type(module).__name__} is a DeepSpeed ZeRO-3 model (its parameters "
                              f"are partitioned into ds_tensor): read it with "
                              f"reshard.integrations.deepspeed.zero3_side(model, rank), or pass ReshardSource(model)")
        pieces, specs, shapes, tensors = module_pieces(module, rank, rank_of=rank_of)
        if names is not None:
            keep = set(names)
            missing = sorted(keep - set(specs))
            if missing:
                raise LayoutError(f"rank {rank}: the module has no tensor {missing[0]!r}")
            specs = {n: s for n, s in specs.items() if n in keep}
            pieces = [p for p in pieces if p.tensor in keep]
            used = {p.buffer for p in pieces}
            shapes = {b: v for b, v in shapes.items() if b in used}
            tensors = {b: t for b, t in tensors.items() if b in used}
        layout = Layout.from_pieces(specs.values(), pieces, {rank: shapes})
        return cls(rank, layout, tensors)

    @classmethod
    def from_megatron(cls, model: torch.nn.Module, arch, rank: int | None = None, *,
                      rank_of: Mapping[int, int] | None = None, pp_layers=None,
                      transformer_impl: str = "transformer_engine", moe_grouped_gemm: bool = True) -> "Side":
        """This rank's part of a Megatron-Core model (a ``GPTModel`` of ``arch``, one pipeline stage):
        the parallel sizes read from ``megatron.core.parallel_state``, the layout from
        :func:`~reshard.frameworks.megatron.megatron_layout` (``transformer_impl`` and
        ``moe_grouped_gemm`` as the model was built), checked against the model's parameters (and
        routers' ``expert_bias`` buffers): a missing or differently shaped one is an error naming it
        and the rank. Megatron's ranks are the default group's; ``rank_of`` maps them to refit ranks."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from ..frameworks.megatron import megatron_layout, with_aliases

        world, me = dist.get_world_size(), dist.get_rank()
        ranks = [int(rank_of[r]) if rank_of is not None else r for r in range(world)]
        rank = ranks[me] if rank is None else rank
        if rank != ranks[me]:
            raise LayoutError(f"rank {rank}: Megatron rank {me} is refit rank {ranks[me]}")
        params = dict(model.named_parameters())
        params.update((n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias"))
        dtype = next(iter(params.values())).dtype
        layout = megatron_layout(
            arch, ranks, tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(), dp=ps.get_data_parallel_world_size(), pp_layers=pp_layers,
            dtype=dtype, transformer_impl=transformer_impl, moe_grouped_gemm=moe_grouped_gemm)
        tensors = with_aliases(layout, rank, params)
        for name, (shape, bdtype) in layout.buffers(rank).items():
            t = tensors.get(name)
            if t is None:
                raise LayoutError(f"rank {rank}: the Megatron model has no parameter {name!r}, which the layout holds")
            if tuple(t.shape) != shape:
                raise LayoutError(f"rank {rank}: Megatron parameter {name!r} is {tuple(t.shape)}, the layout says "
                                  f"{shape} (another model config or parallel setup?)")
        return cls(rank, layout.subset([rank]), {n: tensors[n].detach() for n in layout.buffers(rank)})

    def renumbered(self, rank: int) -> "Side":
        """The same tensors filed under another rank (a member renumbered by a membership change)."""
        pieces = [p._replace(rank=rank) for p in self.layout.pieces(self.rank)]
        layout = Layout.from_pieces(self.layout.specs.values(), pieces, {rank: self.layout.buffers(self.rank)})
        side = copy.copy(self)
        side.rank, side.layout = rank, layout
        return side

    def with_layout(self, layout: Layout) -> "Side":
        """The same tensors under another layout of this rank (a session under a dtype policy writes
        the FP8 weights and scales of :func:`~reshard.planning.precision.precision_layout`)."""
        side = copy.copy(self)
        side.layout = layout.subset([self.rank])
        side.__post_init__()
        return side

    # ------------------------------------------------------------------ one refit
    def read(self) -> dict[str, torch.Tensor]:
        """The buffers a source sends from."""
        return dict(self.tensors)

    def begin_write(self) -> dict[str, torch.Tensor]:
        """The buffers a destination receives into (live tensors, or staging that :meth:`end_write` puts
        in place)."""
        return dict(self.tensors)

    def end_write(self) -> WriteReport:
        """After every byte has arrived: put staged buffers in place; report what went where."""
        return WriteReport(in_place_bytes=self.layout_bytes(), paths=dict.fromkeys(self.tensors, IN_PLACE))

    def prepare_staged(self) -> None:
        """Under a staged receive, once every byte arrived and before the commit: do what :meth:`end_write`
        would do to the staged buffers that need not touch live state (none here; a vLLM worker
        post-processes copies of its layers), so that putting them in place later is quick."""

    def abort_write(self) -> None:
        """Drop what :meth:`begin_write` staged without putting it in place (live storage untouched)."""

    def layout_bytes(self, buffers: Iterable[str] | None = None) -> int:
        """Bytes of this rank's pieces (in buffer dtypes), in ``buffers`` or all."""
        keep = None if buffers is None else set(buffers)
        return sum(int(np.prod(p.sizes)) * self.layout.buffer_spec(self.rank, p.buffer)[1].itemsize
                   for p in self.layout.pieces(self.rank) if keep is None or p.buffer in keep)


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return (to_local() if callable(to_local) else t).detach()


@without_gc
def module_pieces(module: torch.nn.Module, rank: int, *, rank_of: Mapping[int, int] | None = None):
    """``(pieces, specs, buffer shapes, tensors)`` of ``rank``'s part of ``module`` (see
    :meth:`Side.from_module`)."""
    pieces: list[Piece] = []
    specs: dict[str, TensorSpec] = {}
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, t in named_tensors(module):
        local = _local_tensor(t)
        full = tuple(t.shape)
        boxes = _own_boxes(name, t, rank, rank_of)
        if boxes is None:  # the mesh has no place for this rank: it holds nothing of it
            continue
        tensors[name] = local
        shapes[name] = (tuple(local.shape), local.dtype)
        for spec, seg in parameter_segments(name, full, t.dtype):
            specs[spec.name] = spec
            pieces += _segment_pieces(spec, seg, boxes, name, rank)
    return pieces, specs, shapes, tensors


def _own_boxes(name: str, t: torch.Tensor, rank: int, rank_of: Mapping[int, int] | None):
    """This rank's boxes of parameter ``t`` in its full coordinates: ``[(offsets, sizes, buffer
    offsets)]``, or None if ``t``'s device mesh does not hold this rank."""
    full = tuple(t.shape)
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return [((0,) * len(full), full, (0,) * len(full))]
    mesh_ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    mapped = [int(rank_of[r]) if rank_of is not None else r for r in mesh_ranks]
    if rank not in mapped:
        return None
    placements = [from_torch_placement(p) for p in t.placements]
    spec = TensorSpec(name, full, t.dtype)
    got, _ = local_pieces(spec, mapped, tuple(mesh.mesh.shape), placements, "chunk", name, t.dtype)
    return [(p.offsets, p.sizes, p.buffer_offsets) for p in got if p.rank == rank]


def _segment_pieces(spec: TensorSpec, seg: Segment, boxes, buffer: str, rank: int) -> list[Piece]:
    """Pieces of logical tensor ``spec`` sitting at ``seg`` inside a parameter of which this rank
    holds ``boxes`` (parameter coordinates, with their place in the local buffer)."""
    lo = np.array(seg.lead + seg.offsets, np.int64)
    hi = lo + np.array((1,) * len(seg.lead) + spec.shape, np.int64)
    out = []
    for offsets, sizes, boffs in boxes:
        a, b = np.maximum(lo, offsets), np.minimum(hi, np.add(offsets, sizes))
        if (b <= a).any():
            continue
        lead = len(seg.lead)
        out.append(Piece(spec.name, tuple((a - lo)[lead:].tolist()), tuple((b - a)[lead:].tolist()), buffer,
                         tuple((np.array(boffs) + a - np.array(offsets)).tolist()), rank))
    return out


__all__ = ["IN_PLACE", "REPROCESSED", "Side", "WriteReport", "module_pieces"]
