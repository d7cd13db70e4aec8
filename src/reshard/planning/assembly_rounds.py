"""The assembly phase in rounds, so that an assembler's staging stays under the refit's cap.

A :class:`~reshard.planning.precision.PrecisionPlan` with ``assemble`` hands the block rows no source
rank holds whole to an assembler (:mod:`reshard.planning.fp8_assembly`), which stages each of them in
the source's precision (``<name>@asm/<k>``), quantizes it into FP8 staging and forgets it. Staged all
at once that is about the rank's own share of the model. :class:`AssemblyRounds` cuts the phase into
rounds: round ``i`` hands over the boxes of round ``i``, their assemblers quantize them, their staging
is freed, then round ``i + 1``. Every rank runs the same rounds (built from the plan alone).

How a round shares ``max_bucket_bytes`` (the most staging a rank holds at once), cap ``C``::

    what a rank holds in a round              bound
    its boxes of the round (source precision)  C // 2    (a rank's boxes, in plan order, fill
                                                          rounds one after the other)
    the round's transfer staging               C - C // 2 (the round's Plan, max_bucket_bytes)

The FP8 values and scales the assemblers quantize into are source staging (sent by the wire after
every round), as for blocks a source held whole; the executor bounds them, with the boxes, by
running the refit in tensor groups (:mod:`reshard.planning.tensor_groups`), whose plans' caps these
rounds then share. A block row larger
than ``C // 2`` (128 rows x the columns no rank holds whole: a few MiB for real models, against a
default cap of 256 MiB) is a round of its own, over its share by its excess: a box is never split.
Without a cap (``None``) there is one round.

Three tensors of 384 x 128 rows split by FSDP over ranks 0-1 (192 rows each: block row 1, rows
128:256, is on both; rank 0 assembles it, 32 KiB in BF16 a tensor), cap 128 KiB: 64 KiB of boxes a
round, so two rounds::

    round   rank 0 stages                      its transfer staging
    0       tensors 0 and 1's boxes (64 KiB)   <= 64 KiB
    1       tensor 2's box (32 KiB)            <= 64 KiB

>>> import torch, reshard as rs
>>> from reshard.planning.precision import PrecisionPlan
>>> specs = [rs.TensorSpec(f"layers.{i}.mlp.down_proj.weight", (384, 128), torch.bfloat16) for i in range(3)]
>>> src = rs.Layout.merge(rs.Layout.from_placements(s, [0, 1], (2,), [rs.Shard(0)]) for s in specs)
>>> dst = rs.Layout.merge(rs.Layout.from_placements(s, [2], (1,), [rs.Replicate()]) for s in specs)
>>> plan = PrecisionPlan(src, dst, "fp8", max_bucket_bytes=128 << 10, assemble={0: 0, 1: 0})
>>> rounds = AssemblyRounds(plan)
>>> [rounds.staging_bytes(i) for i in range(len(rounds))], plan.staging_bytes()["assembly"]
([{0: 65536}, {0: 32768}], {0: 98304})
>>> small = AssemblyRounds(plan, max_bucket_bytes=32 << 10)      # a box (32 KiB) over 16 KiB: one a round
>>> [small.staging_bytes(i) for i in range(len(small))]
[{0: 32768}, {0: 32768}, {0: 32768}]

Pure: no process group, no device.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from ..layout import Layout, PieceTable
from .plan import Plan
from .quantization import QuantTask

Staged = dict[str, tuple[tuple[int, ...], object]]  # {buffer: (shape, dtype)}
_PLANS = object()  # AssemblyRounds' default cap: the plan's max_bucket_bytes


def _nbytes(shape: Sequence[int], dtype) -> int:
    return int(np.prod(shape)) * dtype.itemsize


def _rows(table: PieceTable, rows: list[int]) -> PieceTable:
    index = np.array(rows, np.int64)
    return PieceTable(table.ranks[index], table.offsets[index], table.sizes[index],
                      tuple(table.buffers[i] for i in rows), table.buffer_offsets[index])


class AssemblyRounds:
    """``plan``'s assembly phase (:attr:`PrecisionPlan.assembly`) in rounds under ``max_bucket_bytes``
    (default: the plan's own; see module doc). :attr:`plans`: one :class:`Plan` per round;
    :meth:`buffers`: a rank's staging of a round; :meth:`split`: a rank's source quantization by
    round."""

    def __init__(self, plan, max_bucket_bytes: int | None | object = _PLANS) -> None:
        self.cap = cap = plan.max_bucket_bytes if max_bucket_bytes is _PLANS else max_bucket_bytes
        self.staging_cap = None if cap is None else cap // 2
        self.transfer_cap = None if cap is None else cap - cap // 2
        assembly = plan.assembly
        self.round_of: dict[int, dict[str, int]] = {}  # rank -> its staging buffer -> round
        self._buffers: list[dict[int, Staged]] = []
        for rank in sorted(plan.assembly_staging):
            self.round_of[rank] = self._fill(rank, plan.assembly_staging[rank])
        self.plans: list[Plan] = []
        if assembly is None:
            return
        known = assembly.domains
        ranks = set(assembly.source.ranks) | set(assembly.destination.ranks)
        domains = None if known is None else {r: int(known[r]) for r in ranks}
        for i in range(len(self._buffers)):
            self.plans.append(self._round_plan(assembly, i, domains))

    def _fill(self, rank: int, staged: Staged) -> dict[str, int]:
        """Round of each of ``rank``'s boxes: in plan order, each round up to :attr:`staging_cap`."""
        out, index, load = {}, 0, 0
        for buffer, (shape, dtype) in staged.items():
            nbytes = _nbytes(shape, dtype)
            if self.staging_cap is not None and load and load + nbytes > self.staging_cap:
                index, load = index + 1, 0
            out[buffer] = index
            load += nbytes
            while len(self._buffers) <= index:
                self._buffers.append({})
            self._buffers[index].setdefault(rank, {})[buffer] = (tuple(shape), dtype)
        return out

    def _round_plan(self, assembly: Plan, index: int, domains) -> Plan:
        """The assembly plan cut to round ``index``'s boxes (their tensors only)."""
        mine = self._buffers[index]
        specs, src_tables, dst_tables = {}, {}, {}
        for name, table in assembly.destination.tables.items():
            rows = [i for i, (rank, buffer) in enumerate(zip(table.ranks.tolist(), table.buffers))
                    if buffer in mine.get(rank, {})]
            if rows:
                specs[name], src_tables[name] = assembly.destination.specs[name], assembly.source.tables[name]
                dst_tables[name] = _rows(table, rows)
        source = Layout(specs, src_tables, {r: assembly.source.buffer_map(r) for r in assembly.source.ranks},
                        validate=None)
        destination = Layout(specs, dst_tables, {r: dict(named) for r, named in mine.items()}, validate=None)
        return Plan(source, destination, max_bucket_bytes=self.transfer_cap, domains=domains)

    def __len__(self) -> int:
        return len(self._buffers)

    def buffers(self, index: int, rank: int) -> Staged:
        """``rank``'s staging buffers of round ``index`` (``{name: (shape, dtype)}``)."""
        return dict(self._buffers[index].get(rank, {}))

    def staging_bytes(self, index: int) -> dict[int, int]:
        """Bytes each rank stages for its boxes in round ``index`` (at most :attr:`staging_cap`)."""
        return {rank: sum(_nbytes(shape, dtype) for shape, dtype in named.values())
                for rank, named in sorted(self._buffers[index].items())}

    def split(self, rank: int, tasks: Iterable[QuantTask]) -> tuple[list[list[QuantTask]], list[QuantTask]]:
        """``rank``'s source quantization tasks as (per round: those reading its boxes of the round, run
        right after it; the others, run after every round)."""
        rounds: list[list[QuantTask]] = [[] for _ in self._buffers]
        rest = []
        own = self.round_of.get(rank, {})
        for task in tasks:
            index = own.get(task.src_buffer)
            (rest if index is None else rounds[index]).append(task)
        return rounds, rest


__all__ = ["AssemblyRounds"]
