"""What the ranks of a session tell each other when they connect or regroup.

Every rank contributes the layout of each side it holds (a training rank its source part, an
engine rank its destination part); every rank merges the parts into the same two whole layouts.
On GPUs the ranks also tell their hosts, and ranks on one host form one NVLink domain. Each
process has a member name that membership changes know it by, and on a regroup its sides move to
its new rank number.

>>> import torch
>>> from reshard.layout import Layout
>>> from reshard.placements import Shard
>>> from reshard.tensors import TensorSpec
>>> whole = Layout.from_placements(TensorSpec("w", (4, 6), torch.float32), [0, 1], (2,), [Shard(0)])
>>> merged_layout([whole.subset([0]), None, whole.subset([1])], "source").pieces(1) == whole.pieces(1)
True
"""

from __future__ import annotations

import os
import socket
import uuid

from ..errors import OptionsError
from ..execution.group import Group
from ..layout import Layout
from ..tensors import LayoutError
from .sides import Side


def check_ranks(rank, world_size) -> None:
    """A rank or group size a user got wrong, named before any process connects."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise OptionsError(f"{name} must be an integer >= 0, got {value!r}")
    if rank is not None and world_size is not None and rank >= world_size:
        raise OptionsError(f"rank {rank} is outside a group of world_size {world_size}")


def member_name() -> str:
    """This process's name in membership changes: host, pid and a random suffix."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


def renumbered(side: Side | None, rank: int) -> Side | None:
    """``side`` moved to ``rank`` (the same tensors; only the rank its pieces are filed under)."""
    if side is None or side.rank == rank:
        return side
    return side.renumbered(rank)


def layout_part(side: Side | None) -> Layout | None:
    """What a rank contributes of one side: its part of the layout, or None where it holds none."""
    return None if side is None else side.layout


def merged_layout(parts: list[Layout | None], what: str) -> Layout:
    """The whole ``what`` side ("source" or "destination") from every rank's part."""
    got = [p for p in parts if p is not None]
    if not got:
        raise LayoutError(f"no rank holds a {what} side")
    return Layout.merge(got)


def detect_domains(group: Group) -> dict[int, int] | None:
    """NVLink domains on GPUs: ranks on one host share one (the common case of 8-GPU nodes);
    ``None`` on CPUs (gloo), where there is no NVLink to use."""
    if group.backend != "nccl":
        return None
    hosts = group.all_gather_object(os.environ.get("RESHARD_DOMAIN") or socket.gethostname())
    index = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    return {r: index[h] for r, h in enumerate(hosts)} if len(index) > 1 else None


__all__ = ["check_ranks", "detect_domains", "layout_part", "member_name", "merged_layout", "renumbered"]
