"""Logical tensors and boxes: the words every other module speaks.

A :class:`TensorSpec` names a full weight as a checkpoint does; a *box* of it is an n-D
rectangle (``offsets``, ``sizes``); a :class:`Piece` is a box held by one rank at
``buffer_offsets`` inside one of its local buffers. :class:`LayoutError` is the one error for
anything wrong with them, and its message names the tensor, rank and box.

>>> import torch
>>> w = TensorSpec("w", (4, 6), torch.float32)
>>> w.numel, w.nbytes
(24, 96)
>>> box_str((2, 0), (2, 6))
'[2:4, 0:6]'

Pure data: no process group, no device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch


class LayoutError(ValueError):
    """A layout or a pair of layouts is invalid; the message names tensor, rank and box."""


def dtype_class(dtype: torch.dtype) -> str:
    """'float', 'complex', 'bool' or 'int': a cast within one class is allowed."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    return "int"


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A full weight as a checkpoint names it: ``TensorSpec("w", (10, 6), torch.float32)``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        shape = self.shape
        if type(shape) is not tuple or not all(type(s) is int and s >= 0 for s in shape):
            shape = tuple(int(s) for s in shape)
            object.__setattr__(self, "shape", shape)
            if any(s < 0 for s in shape):
                raise LayoutError(f"tensor {self.name!r}: negative size in shape {shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


class Piece(NamedTuple):
    """One box of ``tensor`` held by ``rank`` at ``buffer_offsets`` inside ``buffer``."""

    tensor: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    buffer: str
    buffer_offsets: tuple[int, ...]
    rank: int


def box_str(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    """``[0:2, 3:6]`` for offsets (0, 3), sizes (2, 3)."""
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"



def box_slices(offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(int(o), int(o) + int(s)) for o, s in zip(offsets, sizes))


def buffer_view(buf: torch.Tensor, buffer_offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view of ``buf`` a piece occupies, shaped like its box (leading buffer dims dropped)."""
    lead = len(buffer_offsets) - len(sizes)
    index = tuple(int(o) for o in buffer_offsets[:lead]) + box_slices(buffer_offsets[lead:], sizes)
    return buf[index]
