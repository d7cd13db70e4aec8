"""The plan of a refit straight into FP8 engines: each block quantized once, where it is whole.

A :class:`PrecisionPlan` refits a destination with each tensor in its precision under a
:class:`~reshard.planning.dtype_policy.DtypePolicy` (:class:`Keep`, :class:`Cast`, :class:`FP8Block`;
the default quantizes the linear weights an FP8 checkpoint stores in FP8). The destination it
writes is :func:`~reshard.planning.fp8_layout.precision_layout`'s: FP8 weights in float8_e4m3fn
and their ``<name>_scale_inv`` tensors.

A block that some source rank holds whole (inside one of its pieces) is quantized there and
crosses as FP8 plus its scale; a block that no source rank holds whole (an uneven FSDP split, a
TP split finer than a block) crosses in the source's precision into a staging buffer of the
destination, which quantizes it there (:mod:`reshard.planning.fp8_blocks`). Per tensor and rank,
256 x 128 source rows split 2 ways by FSDP into 150 + 106 rows (block 128 x 128), TP 2
destination by columns::

    source rank  rows      whole blocks   block row 0 [0:128)   block row 1 [128:256)
    0            0:150     row 0          quantized on rank 0   -
    1            150:256   none           -                     crosses raw, quantized
                                                                on each destination rank

The wire carries three logical tensors per FP8 tensor ``w``: ``w`` (float8_e4m3fn, from source
staging ``w@fp8/k``), ``w_scale_inv`` (from ``w_scale_inv@fp8/k``) and ``w@raw`` (the source's dtype,
into destination staging ``w@raw/k``), one ordinary :class:`~reshard.planning.plan.Plan` for all of
them and for the other tensors. :meth:`PrecisionPlan.quantization` gives what each rank quantizes
before and after it (:mod:`reshard.planning.quantization`); :mod:`reshard.execution.precision`
runs it.

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

The policy types and :func:`precision_layout` are importable from here too (their modules are
:mod:`~reshard.planning.dtype_policy` and :mod:`~reshard.planning.fp8_layout`).

Pure: no process group, no device.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Callable, Iterable, Mapping

import numpy as np
import torch

from ..gc_pause import without_gc
from ..layout import Layout, PieceTable, RankBuffers, Repeated, read_only, shared_geometry_key
from ..quant import FP8_DTYPE
from ..tensors import LayoutError, TensorSpec, dtype_name
from .dtype_policy import (FP8_PATTERNS, KEEP, Cast, DtypePolicy, FP8Block, Keep, MXFP8Block, Precision,
                           as_policy, layout_precisions)
from .fp8_assembly import ASM_SUFFIX, AssemblyBoxes, assembly_boxes
from .fp8_blocks import (FP8_STAGING, RAW_SUFFIX, BlockGeometry, Fp8Tensor, block_geometry, element_boxes,
                         staging_names)
from .fp8_layout import check_whole_blocks, precision_layout
from .hierarchy import hierarchical_plan
from .plan import PhasedPlan, Plan, check_pair
from .quantization import QuantTask, RankQuantization, rank_quantization
from .schedule import Copy
from .tensor_groups import TensorGroups

PRECISION_PLAN_FORMAT = 1
SOURCE, DESTINATION, ASSEMBLED = 1, 2, 3  # block_paths codes: where a block is quantized (3: on a source
# rank after its domain's ranks handed it the block's rows, fp8_assembly)

NO_BOXES = AssemblyBoxes(*read_only(tuple(AssemblyBoxes.empty())))  # a tensor nothing is assembled for
Staging = dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]  # {rank: {buffer: (shape, dtype)}}
# (wire source, wire destination) -> the plan that moves the wire tensors (a method's plan maker)
WireMaker = Callable[[Layout, Layout], PhasedPlan]


def _with_assembled(table: PieceTable, boxes: AssemblyBoxes, dtype: torch.dtype, shared: dict | None
                    ) -> tuple[tuple[np.ndarray, ...], list[int], list[tuple]]:
    """(ranks, offsets, sizes, buffer offsets of ``table``'s pieces and then the assembled ``boxes``; the
    boxes' ranks; their staging (shape, dtype)), shared (read-only) by the tensors alike ``shared`` has
    seen (it holds the arrays its keys name)."""
    key = ("assembled", id(table.ranks), id(table.offsets), id(table.sizes), id(table.buffer_offsets), id(boxes), dtype)
    hit = shared.get(key) if shared is not None else None
    if hit is None:
        arrays = (np.concatenate([table.ranks, boxes.ranks]), np.concatenate([table.offsets, boxes.offsets]),
                  np.concatenate([table.sizes, boxes.sizes]),
                  np.concatenate([table.buffer_offsets, np.zeros_like(boxes.offsets)]))
        for a in arrays:
            a.flags.writeable = False
        hit = ((table, boxes), arrays, boxes.ranks.tolist(), [(tuple(s), dtype) for s in boxes.sizes.tolist()])
        if shared is not None:
            shared[key] = hit
    return hit[1:]


class _WireTensors:
    """The logical tensors the wire carries (specs and pieces of both sides) and the staging they
    need, gathered tensor by tensor."""

    def __init__(self) -> None:
        self.shared: dict = {}  # what tensors alike share (boxes, rank lists, staging numbering); holds its keys' objects
        self.source_specs: dict[str, TensorSpec] = {}
        self.source_tables: dict[str, PieceTable] = {}
        self.destination_specs: dict[str, TensorSpec] = {}
        self.destination_tables: dict[str, PieceTable] = {}
        self.source_staging: Staging = defaultdict(dict)
        self.destination_staging: Staging = defaultdict(dict)

    def add_unchanged(self, name: str, source: Layout, destination: Layout) -> None:
        """A kept or cast tensor: from the source's pieces into the destination's."""
        self.source_specs[name], self.source_tables[name] = source.specs[name], source.tables[name]
        self.destination_specs[name], self.destination_tables[name] = destination.specs[name], destination.tables[name]

    def add_quantized_at_source(self, info: Fp8Tensor, destination: Layout) -> None:
        """Blocks quantized at a source: FP8 values and scales from source staging into the engine's
        FP8 and scale buffers (``destination``: the layout under the policy)."""
        geometry, name, block = info.geometry, info.name, info.block
        if not len(geometry.fp8_rows):
            return
        shape, scale = destination.specs[name].shape, info.precision.scale_name(name)
        scale_dtype = info.precision.scale_dtype
        offsets, sizes, zeros, value_descs = self._boxes(geometry, "whole", shape, block, FP8_DTYPE)
        grid_lo, grid_sizes, grid_zeros, scale_descs = self._grid(geometry, "whole", scale_dtype)
        self.source_specs[name] = _spec(destination.specs[name], shape, FP8_DTYPE)
        self.source_tables[name] = self._wire_table(info.whole_ranks, offsets, sizes, info.whole_names, zeros)
        self.source_specs[scale] = _spec(destination.specs[scale], geometry.grid, scale_dtype)
        scale_names = staging_names(scale + FP8_STAGING, info.whole_ranks, self.shared)  # a rank's k-th: its k-th values'
        self.source_tables[scale] = self._wire_table(info.whole_ranks, grid_lo, grid_sizes, scale_names, grid_zeros)
        for rank, values_buffer, scales_buffer, value_desc, scale_desc in zip(
                self._rank_list(info.whole_ranks), info.whole_names, scale_names, value_descs, scale_descs):
            self.source_staging[rank][values_buffer] = value_desc
            self.source_staging[rank][scales_buffer] = scale_desc
        offsets, sizes, _, _ = self._boxes(geometry, "fp8", shape, block, FP8_DTYPE)
        self.destination_specs[name] = destination.specs[name]
        self.destination_tables[name] = self._rows_cut_to(destination.tables[name], geometry, offsets, sizes)
        self.destination_specs[scale] = destination.specs[scale]
        grid_lo, grid_sizes, _, _ = self._grid(geometry, "fp8", scale_dtype)
        self.destination_tables[scale] = self._rows_cut_to(destination.tables[scale], geometry, grid_lo, grid_sizes)

    def add_raw(self, info: Fp8Tensor, source: Layout) -> None:
        """Blocks no source holds whole: ``<name>@raw`` in the source's dtype, from the source's pieces
        into destination staging."""
        geometry, name = info.geometry, info.name
        if not len(geometry.raw_rows):
            return
        raw = name + RAW_SUFFIX
        shape = source.specs[name].shape
        offsets, sizes, zeros, descs = self._boxes(geometry, "raw", shape, info.block, info.source_dtype)
        self.source_specs[raw] = self.destination_specs[raw] = TensorSpec(raw, shape, info.source_dtype)
        self.source_tables[raw] = source.tables[name]
        self.destination_tables[raw] = self._wire_table(info.raw_ranks, offsets, sizes, info.raw_names, zeros)
        for rank, buffer, desc in zip(self._rank_list(info.raw_ranks), info.raw_names, descs):
            self.destination_staging[rank][buffer] = desc

    def _rows_cut_to(self, table: PieceTable, geometry: BlockGeometry, offsets: np.ndarray, sizes: np.ndarray
                     ) -> PieceTable:
        """``table``'s pieces ``geometry.fp8_rows`` cut to the boxes (``offsets``, ``sizes``) inside them, in place
        in their buffers; the arrays worked out once for the tables alike (read-only), the buffer names each
        table's own."""
        rows = geometry.fp8_rows
        key = ("cut", id(table.ranks), id(table.offsets), id(table.buffer_offsets), id(rows), id(offsets), id(sizes))
        hit = self.shared.get(key)
        if hit is None:
            buffer_offsets = table.buffer_offsets[rows].copy()
            buffer_offsets[:, -2:] += offsets - table.offsets[rows]
            arrays = read_only((table.ranks[rows], offsets, sizes, buffer_offsets))
            hit = self.shared[key] = ((table.ranks, table.offsets, table.buffer_offsets, rows, offsets, sizes), arrays)
        ranks, offsets, sizes, buffer_offsets = hit[1]
        one = table.one_buffer()
        buffers = Repeated(one, len(rows)) if one is not None else tuple(table.buffers[i] for i in rows.tolist())
        return PieceTable(ranks, offsets, sizes, buffers, buffer_offsets)

    def _wire_table(self, ranks: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, names, buffer_offsets: np.ndarray
                    ) -> PieceTable:
        """A wire table of the arrays tensors alike share (as every table's, treated as read-only), its
        geometry key worked out once for them (plans read what tables hold, not how their arrays are shared)."""
        return PieceTable(ranks, offsets, sizes, names, buffer_offsets,
                          shared_geometry_key(ranks, offsets, sizes, self.shared))

    def _boxes(self, geometry: BlockGeometry, path: str, shape, block, dtype: torch.dtype) -> tuple:
        """(element offsets, sizes, zero buffer offsets, each box's staging (shape, dtype)) of a
        geometry's ``path`` boxes ("whole", "fp8", "raw": :func:`element_boxes` of its grid boxes),
        worked out once for the tensors sharing the geometry (read-only)."""
        key = ("boxes", id(geometry), path, shape, block, dtype)
        hit = self.shared.get(key)
        if hit is None:
            lo, hi = getattr(geometry, f"{path}_lo"), getattr(geometry, f"{path}_hi")
            offsets, sizes = element_boxes(lo, hi, shape, block)
            zeros = np.zeros_like(offsets)
            for a in (offsets, sizes, zeros):
                a.flags.writeable = False
            hit = self.shared[key] = (geometry, offsets, sizes, zeros, [(tuple(s), dtype) for s in sizes.tolist()])
        return hit[1:]

    def _grid(self, geometry: BlockGeometry, path: str, dtype: torch.dtype) -> tuple:
        """(grid offsets, grid sizes, zero buffer offsets, each scale box's staging (shape, dtype)) of a
        geometry's ``path`` boxes ("whole", "fp8"), worked out once (read-only)."""
        key = ("grid", id(geometry), path, dtype)
        hit = self.shared.get(key)
        if hit is None:
            lo, hi = getattr(geometry, f"{path}_lo"), getattr(geometry, f"{path}_hi")
            sizes, zeros = read_only((hi - lo, np.zeros_like(lo)))
            hit = self.shared[key] = (geometry, lo, sizes, zeros, [(tuple(s), dtype) for s in sizes.tolist()])
        return hit[1:]

    def _rank_list(self, ranks: np.ndarray) -> list[int]:
        """``ranks.tolist()``, once per shared ranks array."""
        key = ("list", id(ranks))
        hit = self.shared.get(key)
        if hit is None:
            hit = self.shared[key] = (ranks, ranks.tolist())
        return hit[1]

    def layouts(self, source: Layout, destination: Layout) -> tuple[Layout, Layout]:
        """The wire's (source, destination) layouts: the sides' buffers plus the staging."""
        return (Layout(self.source_specs, self.source_tables, _with(source, self.source_staging), validate=None),
                Layout(self.destination_specs, self.destination_tables,
                       _with(destination, self.destination_staging), validate=None))



class PrecisionPlan:
    """The refit of ``destination`` from ``source`` with each tensor in its ``policy`` precision (a
    :class:`~reshard.planning.plan.PhasedPlan`; see module doc).

    ``destination`` is the layout as the engine would hold it at the source's precision (a
    ``vllm_layout``); :attr:`destination` is the layout under the policy
    (:func:`precision_layout`): the buffers a run writes. :attr:`wire` is the plan that moves
    the bytes: ``wire(wire source, wire destination)`` when given (any method's plan maker: the
    method registry passes its own), else hierarchical over ``domains`` when given, else a
    :class:`Plan`. ``at_source``: whether a tensor's blocks that a source rank holds whole are
    quantized there (a predicate on tensor names, or one answer for all); where not, every block of
    the tensor crosses in the source's precision and is quantized at the destination, as a
    receiver-side quantizer does (the wire's tensors, and so the fingerprint, say which). :meth:`quantization`
    says what each rank quantizes before and after the wire. ``assemble`` (source rank -> NVLink domain):
    blocks no source rank holds whole but one domain's source ranks hold together are first handed to
    one of them (:attr:`assembly`, a local phase run before the source quantization:
    :mod:`reshard.planning.fp8_assembly`), which quantizes them and sends FP8; without it such blocks
    cross in the source precision. ``held``: ``precision_layout(destination, policy)`` when the caller
    has made it already (not checked).
    """

    @without_gc
    def __init__(self, source: Layout, destination: Layout, policy: DtypePolicy | str | None = None, *,
                 max_bucket_bytes: int | None = None, domains: Mapping[int, int] | None = None,
                 wire: WireMaker | None = None, at_source: bool | Callable[[str], bool] = True,
                 assemble: Mapping[int, int] | None = None, held: Layout | None = None) -> None:
        check_pair(source, destination)
        self.policy = as_policy(policy)
        self.source = source
        self.engine_destination = destination  # the destination at the source's precision (tensor groups)
        self.wire_maker = wire
        self.max_bucket_bytes = max_bucket_bytes
        self.domains = None if domains is None else dict(domains)
        self.at_source = at_source if callable(at_source) else (lambda name, value=bool(at_source): value)
        self.destination = precision_layout(destination, self.policy) if held is None else held
        self.precisions = layout_precisions(destination, self.policy)
        self.fp8: dict[str, Fp8Tensor] = {}
        self.assemble = None if not assemble else {int(r): int(d) for r, d in assemble.items()}
        self.assembly_staging: Staging = defaultdict(dict)
        tensors = self._wire_tensors(destination)
        self.assembly_staging = dict(self.assembly_staging)
        self.assembly: Plan | None = self._assembly_plan()
        self.source_staging = dict(tensors.source_staging)
        self.destination_staging = dict(tensors.destination_staging)
        wire_source, wire_destination = tensors.layouts(source, self.destination)
        if wire is not None:
            self.wire = wire(wire_source, wire_destination)
        elif self.domains:
            self.wire = hierarchical_plan(wire_source, wire_destination, self.domains, max_bucket_bytes=max_bucket_bytes)
        else:
            self.wire = Plan(wire_source, wire_destination, max_bucket_bytes=max_bucket_bytes)
        self._fingerprint: str | None = None
        self._groups = None

    def tensor_groups(self):
        """The refit in tensor groups under the cap (:class:`~reshard.planning.tensor_groups.TensorGroups`,
        built on the first call: the executor runs a group at a time)."""
        if self._groups is None:
            self._groups = TensorGroups(self)
        return self._groups

    def _wire_tensors(self, destination: Layout) -> _WireTensors:
        """Every destination tensor a source holds, as the wire carries it; fills :attr:`fp8`."""
        wire = _WireTensors()
        geometries: dict[tuple, BlockGeometry] = {}  # tensors of one geometry share their block paths
        for name in destination.specs:
            if name not in self.source.specs:  # a destination tensor no rank holds (check_pair allows it)
                continue
            precision = self.precisions[name]
            if not isinstance(precision, FP8Block):
                wire.add_unchanged(name, self.source, self.destination)
                continue
            if not len(self.destination.tables[name]):
                continue
            info = self.fp8[name] = self._fp8_tensor(name, precision, geometries, wire.shared)
            wire.add_quantized_at_source(info, self.destination)
            wire.add_raw(info, self.source)
        return wire

    def _fp8_tensor(self, name: str, precision: FP8Block, geometries: dict[tuple, BlockGeometry],
                    shared: dict | None = None) -> Fp8Tensor:
        """FP8 tensor ``name``'s block paths and staging, or LayoutError when its sources hold it in
        several dtypes; ``shared``: what tensors alike share, kept over the pass (see :meth:`Fp8Tensor.of`)."""
        source_table, destination_table = self.source.tables[name], self.destination.tables[name]
        source_dtypes = self.source.buffer_dtypes(name)
        source_dtype = source_dtypes.uniform
        if source_dtype is None:
            held = sorted({dtype_name(dtype) for dtype in source_dtypes.per_piece})
            raise LayoutError(f"tensor {name!r}: source ranks hold it in buffers of several dtypes "
                              f"({held}); block FP8 quantizes from one source precision")
        shape = self.destination.specs[name].shape
        at_source = self.at_source(name)
        boxes = NO_BOXES
        if self.assemble is not None and at_source:
            asm_key = ("assembly", shape, precision.block, source_table.geometry_key(shared),
                       source_table.buffer_offsets.shape[1])
            boxes = geometries.get(asm_key)
            if boxes is None:
                boxes = geometries[asm_key] = assembly_boxes(shape, precision.block, source_table, self.assemble)
        asm_names: tuple | Repeated = ()
        table = source_table
        if len(boxes.ranks):  # the assemblers hold their boxes whole, in staging <name>@asm/<k>
            asm_names = staging_names(name + ASM_SUFFIX + "/", boxes.ranks, shared)
            arrays, ranks, descs = _with_assembled(source_table, boxes, source_dtype, shared)
            table = PieceTable(*arrays[:3], tuple(source_table.buffers) + tuple(asm_names), arrays[3])
            for rank, buffer, desc in zip(ranks, asm_names, descs):
                self.assembly_staging[rank][buffer] = desc
        key = (shape, precision.block, at_source, table.geometry_key(shared), destination_table.geometry_key(shared))
        geometry = geometries.get(key)
        if geometry is None:
            geometry = geometries[key] = block_geometry(shape, precision.block, table, destination_table,
                                                        at_source=at_source)
        info = Fp8Tensor.of(name, precision, source_dtype, geometry, table, destination_table, shared)
        if len(boxes.ranks):
            info.source_table, info.assembly, info.assembly_names = table, boxes, asm_names
        return info

    def _assembly_plan(self) -> Plan | None:
        """The local phase that hands assemblers their block rows (None: nothing is assembled): one wire
        tensor ``<name>@asm`` per assembled FP8 tensor, from the source's pieces into assembler staging,
        planned with the domains so each row comes from a rank of the assembler's domain."""
        specs, src_tables, dst_tables = {}, {}, {}
        for name, info in self.fp8.items():
            boxes = info.assembly
            if boxes is None or not len(boxes.ranks):
                continue
            wire_name = name + ASM_SUFFIX
            specs[wire_name] = TensorSpec(wire_name, self.source.specs[name].shape, info.source_dtype)
            src_tables[wire_name] = self.source.tables[name]
            dst_tables[wire_name] = PieceTable(boxes.ranks, boxes.offsets, boxes.sizes, info.assembly_names,
                                               np.zeros_like(boxes.offsets))
        if not specs:
            return None
        source = Layout(specs, src_tables, {rank: self.source.buffer_map(rank) for rank in self.source.ranks},
                        validate=None)
        destination = Layout(specs, dst_tables, {rank: dict(named) for rank, named in self.assembly_staging.items()},
                             validate=None)
        ranks = set(source.ranks) | set(destination.ranks)
        lone = max(self.assemble.values(), default=0) + 1  # a source rank outside the map: a domain of its own
        domains = {r: self.assemble.get(r, lone + r) for r in ranks}
        return Plan(source, destination, max_bucket_bytes=self.max_bucket_bytes, domains=domains)

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
            digest = hashlib.sha256(f"precision-plan-{PRECISION_PLAN_FORMAT}\0{self.policy.key}\0".encode())
            digest.update(self.wire.fingerprint().encode())
            if self.assembly is not None:
                digest.update(b"\0assembly\0" + self.assembly.fingerprint().encode())
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    # ------------------------------------------------------------------ figures
    def _tensor_wire_bytes(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for phase in self.wire.phases:
            for name, nbytes in phase.tensor_wire_bytes().items():
                out[name] += nbytes
        return dict(out)

    def wire_bytes_by_dtype(self) -> dict[str, int]:
        """Bytes between ranks by the dtype they cross in, ``{'float8_e4m3fn': ..., 'float32': ...}``."""
        out: dict[str, int] = defaultdict(int)
        for phase in self.wire.phases:
            for name, nbytes in phase.tensor_wire_bytes().items():
                if nbytes:
                    out[dtype_name(_uniform(phase.destination, name))] += nbytes
        return dict(sorted(out.items()))

    def wire_bytes_by_path(self) -> dict[str, int]:
        """Bytes between ranks by what they are: ``fp8`` (values quantized at a source), ``scales`` (theirs),
        ``raw`` (blocks crossing in the source's precision) and ``other`` (kept or cast tensors)."""
        out = {"fp8": 0, "scales": 0, "raw": 0, "other": 0}
        scales = self._scale_names()
        for name, nbytes in self._tensor_wire_bytes().items():
            if name.endswith(RAW_SUFFIX):
                out["raw"] += nbytes
            elif name in self.fp8:
                out["fp8"] += nbytes
            elif name in scales:
                out["scales"] += nbytes
            else:
                out["other"] += nbytes
        return out

    def _scale_names(self) -> set[str]:
        return {info.precision.scale_name(name) for name, info in self.fp8.items()}

    def block_paths(self, name: str) -> np.ndarray:
        """Where each block of FP8 tensor ``name`` is quantized: :data:`SOURCE` (1) on a source rank that
        holds it whole, :data:`DESTINATION` (2) on the destination ranks that hold it, :data:`ASSEMBLED` (3)
        on a source rank its domain's ranks handed the block's rows to (``assemble``); int8 [grid]."""
        info = self._info(name)
        geometry = info.geometry
        out = np.zeros(geometry.grid, np.int8)
        for lo, hi, covered in zip(geometry.rect_lo.tolist(), geometry.rect_hi.tolist(),
                                   geometry.rect_covered.tolist()):
            out[lo[0]:hi[0], lo[1]:hi[1]] = SOURCE if covered else DESTINATION
        if info.assembly is not None:
            block = np.array(info.block, np.int64)
            lo_all = info.assembly.offsets // block
            hi_all = -(-(info.assembly.offsets + info.assembly.sizes) // block)
            for lo, hi in zip(lo_all.tolist(), hi_all.tolist()):
                out[lo[0]:hi[0], lo[1]:hi[1]] = ASSEMBLED
        return out

    def tensor_paths(self) -> dict[str, dict[str, int]]:
        """Per FP8 tensor: ``blocks`` (its grid), ``source`` / ``assembled`` / ``destination`` (blocks quantized on a
        source rank that held them / on one its domain handed them to / on destination ranks), ``raw_bytes``
        (raw blocks' bytes, once per destination that takes them)."""
        out = {}
        alike: dict[tuple, dict[str, int]] = {}  # tensors sharing geometry and assembly share their counts
        for name, info in self.fp8.items():
            shape = self.destination.specs[name].shape
            key = (id(info.geometry), id(info.assembly), shape, info.block, info.source_dtype.itemsize)
            hit = alike.get(key)
            if hit is None:
                paths = self.block_paths(name)
                geometry = info.geometry
                sizes = element_boxes(geometry.raw_lo, geometry.raw_hi, shape, info.block)[1]
                raw = int(sizes.prod(axis=1).sum())
                hit = alike[key] = {"blocks": int(paths.size), "source": int((paths == SOURCE).sum()),
                                    "assembled": int((paths == ASSEMBLED).sum()),
                                    "destination": int((paths == DESTINATION).sum()),
                                    "raw_bytes": raw * info.source_dtype.itemsize}
            out[name] = dict(hit)
        return out

    def staging_bytes(self) -> dict[str, dict[int, int]]:
        """Staging each rank needs for the quantization over the whole refit: ``source`` (FP8 values and
        scales of its whole blocks), ``destination`` (raw blocks, in the source's precision) and
        ``assembly`` (boxes); the executor holds one tensor group's at a time
        (:meth:`peak_staging_bytes`)."""
        def total(staging):
            return {rank: sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in named.values())
                    for rank, named in staging.items()}
        out = {"source": total(self.source_staging), "destination": total(self.destination_staging)}
        if self.assembly is not None:  # assemblers' staging: the block rows handed to them, source precision
            out["assembly"] = total(self.assembly_staging)
        return out

    def peak_staging_bytes(self) -> dict[int, int]:
        """The most quantization staging each rank holds at once (FP8 values and scales, raw blocks and
        boxes of one tensor group: :meth:`tensor_groups`), at most half ``max_bucket_bytes`` but for a
        tensor over it alone; the group's transfer staging, under the other half, comes on top."""
        return self.tensor_groups().peak_staging_bytes()

    @property
    def assembly_bytes(self) -> int:
        """Bytes the assembly phase moves between ranks (inside domains; 0 without ``assemble``)."""
        return 0 if self.assembly is None else self.assembly.wire_bytes

    def assembly_cross_domain_bytes(self) -> int:
        """Bytes of the assembly phase between ranks of different domains (0 by construction, unless a
        replica outside the domain was the planner's only choice)."""
        if self.assembly is None:
            return 0
        out = 0
        for (src, dst), nbytes in self.assembly.pair_bytes.items():
            if self.assemble.get(src, -1 - src) != self.assemble.get(dst, -2 - dst):
                out += nbytes
        return out

    def summary(self) -> dict:
        paths = self.tensor_paths()
        out = {"policy": self.policy.key, "fp8_tensors": len(self.fp8),
               "blocks_at_source": sum(counts["source"] for counts in paths.values()),
               "blocks_at_destination": sum(counts["destination"] for counts in paths.values()),
               "wire_bytes": self.wire_bytes, "wire_bytes_by_dtype": self.wire_bytes_by_dtype(),
               "wire_bytes_by_path": self.wire_bytes_by_path(), "wire": self.wire.summary()}
        if self.assembly is not None:
            out.update(blocks_assembled=sum(counts["assembled"] for counts in paths.values()),
                       assembly_bytes=self.assembly_bytes)
        return out

    def __repr__(self) -> str:
        return f"PrecisionPlan({len(self.fp8)} FP8 tensors, wire_bytes={self.wire_bytes}, policy {self.policy.key!r})"

    # ------------------------------------------------------------------ quantization per rank
    def _info(self, name: str) -> Fp8Tensor:
        try:
            return self.fp8[name]
        except KeyError:
            raise LayoutError(f"tensor {name!r} is not an FP8 tensor of this plan") from None

    def quantization(self, rank: int, reads: Iterable[Copy] | None = None) -> RankQuantization:
        """What ``rank`` quantizes: ``source`` tasks before the transfer (the whole blocks the wire's
        copies read from its source buffers, each quantized once) and ``destination`` tasks after it
        (the raw blocks it receives). ``reads``: those copies, when the caller has built them
        (``self.wire.source_reads(rank)`` otherwise)."""
        if reads is None:
            reads = self.wire.source_reads(rank)
        return rank_quantization(self.fp8, self.source, self.destination, rank, reads)

    def source_reads(self, rank: int) -> list[Copy]:
        """The wire's copies that read ``rank``'s source buffers (its own staging included)."""
        return self.wire.source_reads(rank)


def _spec(spec: TensorSpec, shape: tuple[int, ...], dtype: torch.dtype) -> TensorSpec:
    """``spec`` where it already is ``(spec.name, shape, dtype)`` (specs are frozen: tensors may share one), else
    a new one."""
    return spec if spec.shape == shape and spec.dtype == dtype else TensorSpec(spec.name, shape, dtype)


def _uniform(layout: Layout, name: str) -> torch.dtype:
    dtype = layout.buffer_dtypes(name).uniform
    return dtype if dtype is not None else layout.specs[name].dtype


def _with(layout: Layout, staging: Mapping[int, Mapping]) -> dict[int, Mapping]:
    """``layout``'s buffers plus ``staging`` (``{rank: {name: (shape, dtype)}}``; the ranks without staging
    keep the shared mappings)."""
    out: dict[int, Mapping] = {rank: layout.buffer_map(rank) for rank in layout.ranks}
    for rank, named in staging.items():
        base = out.get(rank)
        out[rank] = RankBuffers(named) if base is None else RankBuffers.overlay(base, named)
    return out


def precision_plan(source: Layout, destination: Layout, policy: DtypePolicy | str | None = None, *,
                   max_bucket_bytes: int | None = None, domains: Mapping[int, int] | None = None,
                   assemble: Mapping[int, int] | None = None) -> PrecisionPlan:
    """Plan the refit of ``destination`` from ``source`` in ``policy``'s precisions (see :class:`PrecisionPlan`)."""
    return PrecisionPlan(source, destination, policy, max_bucket_bytes=max_bucket_bytes, domains=domains,
                         assemble=assemble)


# the policy types and the FP8 layout, importable from here as before their modules were split out
__all__ = ["ASSEMBLED", "Cast", "DESTINATION", "DtypePolicy", "FP8Block", "FP8_PATTERNS", "Fp8Tensor", "KEEP", "Keep", "MXFP8Block",
           "Precision", "PrecisionPlan", "QuantTask", "RAW_SUFFIX", "RankQuantization", "SOURCE", "as_policy",
           "check_whole_blocks", "layout_precisions", "precision_layout", "precision_plan"]
