"""A precision refit in tensor groups, so that a rank's staging stays under the refit's cap.

A :class:`~reshard.planning.precision.PrecisionPlan` stages, per rank, the FP8 values and scales of
the blocks it quantizes at source (``<name>@fp8/<k>``), the raw blocks it receives
(``<name>@raw/<k>``) and, with ``assemble``, its assembled boxes (``<name>@asm/<k>``). All at once that
is about half a rank's BF16 share. :class:`TensorGroups` cuts the refit into groups of whole tensors,
in the plan's order, built from the plan alone (the same on every rank). The executor runs each group
as a refit of its own (assembly, quantize at source, its wire plan, quantize at destination), and
frees its staging before the next. How a group shares the cap ``C`` (``max_bucket_bytes``)::

    what a rank holds while a group runs                    bound
    the group's FP8 values, scales, raw blocks and boxes    C // 2     (tensors added in plan order
                                                                        until some rank would pass it)
    its wire's (or an assembly round's) transfer staging    C - C // 2 (the group plan's cap)

A tensor whose staging alone passes ``C // 2`` on some rank is a group of its own, over its share
by its excess: a tensor is never split. Kept and cast tensors stage nothing; they ride with the
group they fall in. Without a cap, or when no rank stages anything, there is one group: the plan
itself (its wire has the whole cap). When everything fits ``C // 2`` there is one group too, but
its wire is planned again under ``C`` less the most a rank stages (the two share the cap).

Four 256 x 256 tensors split 3 ways by rows (86 rows: no whole block), so each crosses raw into
rank 3 (its destination): 128 KiB of raw BF16 staging per tensor. Cap 512 KiB: 256 KiB a group::

    group   tensors   rank 3 stages (raw)   its wire's transfer staging
    0       0, 1      256 KiB               <= 256 KiB
    1       2, 3      256 KiB               <= 256 KiB

>>> import torch, reshard as rs
>>> from reshard.planning.precision import PrecisionPlan
>>> specs = [rs.TensorSpec(f"layers.{i}.mlp.down_proj.weight", (256, 256), torch.bfloat16) for i in range(4)]
>>> src = rs.Layout.merge(rs.Layout.from_placements(s, [0, 1, 2], (3,), [rs.Shard(0)]) for s in specs)
>>> dst = rs.Layout.merge(rs.Layout.from_placements(s, [3], (1,), [rs.Replicate()]) for s in specs)
>>> plan = PrecisionPlan(src, dst, "fp8", max_bucket_bytes=512 << 10)
>>> groups = TensorGroups(plan)
>>> len(groups), [groups.staging_bytes(i) for i in range(len(groups))], plan.staging_bytes()["destination"]
(2, [{3: 262144}, {3: 262144}], {3: 524288})
>>> [len(groups.plan(i).fp8) for i in range(len(groups))]
[2, 2]

Pure: no process group, no device.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..layout import Layout
from .fp8_blocks import FP8_STAGING
from .quantization import staged_tensor

_PLANS = object()  # TensorGroups' default cap: the plan's max_bucket_bytes


def _restricted(layout: Layout, names) -> Layout:
    """``layout`` with only the tensors ``names`` (every rank's buffers kept)."""
    return Layout({n: layout.specs[n] for n in names}, {n: layout.tables[n] for n in names},
                  {r: layout.buffer_map(r) for r in layout.ranks}, validate=False)


def tensor_staging(plan) -> dict[str, dict[int, int]]:
    """``{tensor: {rank: bytes}}``: the staging ``plan`` gives each FP8 tensor on each rank (FP8 values,
    scales, raw blocks, assembled boxes)."""
    out: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for staging in (plan.source_staging, plan.destination_staging, plan.assembly_staging):
        for rank, named in staging.items():
            for buffer, (shape, dtype) in named.items():
                base, sep, _ = buffer.rpartition("/")
                if not sep:
                    continue
                if base.endswith(FP8_STAGING[:-1]):  # <name>@fp8 or <name>_scale_inv@fp8
                    staged = staged_tensor(plan.fp8, base[: -len(FP8_STAGING) + 1])
                    name = None if staged is None else staged[0]
                else:  # <name>@raw, <name>@asm
                    name = base.rpartition("@")[0]
                if name is None or name not in plan.fp8:
                    raise ValueError(f"rank {rank}: staging buffer {buffer!r} names no FP8 tensor of the plan")
                out[name][rank] += int(np.prod(shape)) * dtype.itemsize
    return out


class TensorGroups:
    """``plan``'s tensors in groups whose staging fits half of ``max_bucket_bytes`` on every rank (default:
    the plan's own cap; see module doc). :attr:`names`: each group's tensors; :meth:`plan`: a group's
    :class:`~reshard.planning.precision.PrecisionPlan` (built when asked); :meth:`staging_bytes`: each
    rank's staging in a group."""

    def __init__(self, plan, max_bucket_bytes: int | None | object = _PLANS) -> None:
        self.source_plan = plan
        self.cap = cap = plan.max_bucket_bytes if max_bucket_bytes is _PLANS else max_bucket_bytes
        self.staging_cap = None if cap is None else cap // 2
        self.wire_cap = None if cap is None else cap - cap // 2
        staged = tensor_staging(plan)
        names = list(plan.engine_destination.specs)
        self.names: list[tuple[str, ...]] = []
        self._bytes: list[dict[int, int]] = []
        total: dict[int, int] = defaultdict(int)
        for per in staged.values():
            for rank, nbytes in per.items():
                total[rank] += nbytes
        # the plan itself: nothing to share the cap with
        self.whole = self.staging_cap is None or not any(total.values())
        if self.whole or all(v <= self.staging_cap for v in total.values()):
            self.names, self._bytes = [tuple(names)], [dict(sorted(total.items()))]
            if not self.whole:  # one group: its wire takes what the staging leaves
                self.wire_cap = cap - max(total.values())
            return
        group: list[str] = []
        load: dict[int, int] = defaultdict(int)
        for name in names:
            mine = staged.get(name, {})
            if group and mine and any(load[r] + b > self.staging_cap for r, b in mine.items()):
                self.names.append(tuple(group))
                self._bytes.append(dict(sorted(load.items())))
                group, load = [], defaultdict(int)
            group.append(name)
            for r, b in mine.items():
                load[r] += b
        self.names.append(tuple(group))
        self._bytes.append(dict(sorted(load.items())))

    def __len__(self) -> int:
        return len(self.names)

    def staging_bytes(self, index: int) -> dict[int, int]:
        """Bytes each rank stages in group ``index`` (FP8 values and scales, raw blocks, assembled boxes)."""
        return dict(self._bytes[index])

    def peak_staging_bytes(self) -> dict[int, int]:
        """The most each rank stages in one group."""
        out: dict[int, int] = {}
        for per in self._bytes:
            for rank, nbytes in per.items():
                out[rank] = max(out.get(rank, 0), nbytes)
        return dict(sorted(out.items()))

    def plan(self, index: int):
        """Group ``index``'s plan: the refit of its tensors alone, its wire under :attr:`wire_cap` (the
        plan itself when :attr:`whole`)."""
        plan = self.source_plan
        if self.whole:
            return plan
        names = self.names[index]
        source_names = [n for n in names if n in plan.source.specs]
        try:
            return type(plan)(_restricted(plan.source, source_names), _restricted(plan.engine_destination, names),
                              plan.policy, max_bucket_bytes=self.wire_cap, domains=plan.domains,
                              wire=plan.wire_maker, at_source=plan.at_source, assemble=plan.assemble)
        except ValueError as e:
            if "too small" not in str(e):
                raise
            raise ValueError(f"max_bucket_bytes={self.cap} is too small for this precision refit: beside the "
                             f"quantization staging of tensor group {index} its wire gets {self.wire_cap} bytes "
                             f"({e})") from None


__all__ = ["TensorGroups", "tensor_staging"]
