"""Packing, unpacking and in-process execution of a plan.

``pack``/``unpack`` are the byte-level half of every executor: one message becomes
one contiguous ``uint8`` staging tensor on the buffers' device, each copy cast to
the destination dtype on the way in (so casts happen on the sender) and written
straight into the destination view on the way out. ``run_local`` runs every rank's
part of a plan in one process through exactly these functions: the fuzzing target.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..planning.plan import Plan
from ..planning.schedule import Copy, Message, aligned
from ..tensors import LayoutError, buffer_view

Buffers = Mapping[str, torch.Tensor]


def _view(buffers: Buffers, name: str, offsets, sizes, rank: int, side: str) -> torch.Tensor:
    try:
        buf = buffers[name]
    except KeyError:
        raise LayoutError(f"rank {rank}: {side} buffer {name!r} was not given") from None
    return buffer_view(buf, offsets, sizes)


def pack(msg: Message, buffers: Buffers, rank: int = -1, out: torch.Tensor | None = None) -> torch.Tensor:
    """The message's payload, read from the sender's ``buffers``."""
    if out is None:
        device = next(iter(buffers.values())).device if buffers else "cpu"
        out = torch.empty(msg.nbytes, dtype=torch.uint8, device=device)
    pos = 0
    for c in msg.copies:
        n = c.nbytes
        src = _view(buffers, c.src_buffer, c.src_offsets, c.sizes, rank, "source")
        out[pos: pos + n].view(c.dtype).view(c.sizes).copy_(src)
        pos += aligned(n)
    return out


def unpack(msg: Message, payload: torch.Tensor, buffers: Buffers, rank: int = -1) -> None:
    """Write a received payload into the receiver's destination ``buffers`` in place."""
    pos = 0
    for c in msg.copies:
        n = c.nbytes
        dst = _view(buffers, c.dst_buffer, c.dst_offsets, c.sizes, rank, "destination")
        dst.copy_(payload[pos: pos + n].view(c.dtype).view(c.sizes))
        pos += aligned(n)


def copy_within(copies: list[Copy], src: Buffers, dst: Buffers, rank: int = -1) -> None:
    """Local copies (``src`` = source buffers) or fan-out copies (``src`` = destination buffers)."""
    for c in copies:
        _view(dst, c.dst_buffer, c.dst_offsets, c.sizes, rank, "destination").copy_(
            _view(src, c.src_buffer, c.src_offsets, c.sizes, rank, "source"))


def run_local(plan: Plan, src_buffers: Mapping[int, Buffers], dst_buffers: Mapping[int, Buffers]) -> None:
    """Run every rank's part of ``plan`` in this process.

    ``src_buffers[rank]`` / ``dst_buffers[rank]`` are ``{buffer_name: Tensor}``;
    destination tensors are written in place. A :class:`~reshard.planning.hierarchy.HierarchicalPlan`
    runs its network phase, then its later phases from the destination buffers.
    """
    phases = getattr(plan, "phases", None)
    if phases is not None:
        run_local(phases[0], src_buffers, dst_buffers)
        for p in phases[1:]:
            run_local(p, dst_buffers, dst_buffers)
        return
    ranks = sorted(set(plan.source.ranks) | set(plan.destination.ranks))
    parts = {r: plan.for_rank(r) for r in ranks}
    empty: dict[str, torch.Tensor] = {}
    for r, p in parts.items():
        copy_within(p.local, src_buffers.get(r, empty), dst_buffers.get(r, empty), r)
    rounds = max((p.num_rounds for p in parts.values()), default=0)
    for j in range(rounds):
        for r, p in parts.items():
            for msg in p.round(j)[0]:
                payload = pack(msg, src_buffers.get(r, empty), r)
                peer_msg = next(m for m in parts[msg.peer].round(j)[1] if m.peer == r)
                unpack(peer_msg, payload, dst_buffers.get(msg.peer, empty), msg.peer)
    for r, p in parts.items():
        copy_within(p.fanout, dst_buffers.get(r, empty), dst_buffers.get(r, empty), r)
