"""Packing and unpacking: the byte-level half of every executor.

One message becomes one contiguous ``uint8`` staging tensor on the buffers' device, each copy
cast to the destination dtype on the way in (so casts happen on the sender) and written straight
into the destination view on the way out. Plain torch ops (``view``/``copy_``): the same code on
CPU and CUDA.

>>> import torch
>>> from reshard.planning.schedule import Copy, Message
>>> c = Copy("w", (0, 0), (2, 2), "w", (0, 0), "w", (0, 0), torch.float32)
>>> payload = pack(Message(1, 0, [c]), {"w": torch.arange(4.0).view(2, 2)})
>>> out = {"w": torch.zeros(2, 2)}
>>> unpack(Message(0, 0, [c]), payload, out)
>>> out["w"].tolist()
[[0.0, 1.0], [2.0, 3.0]]
"""

from __future__ import annotations

from typing import Mapping

import torch

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
