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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from .errors import ReshardError


class LayoutError(ReshardError, ValueError):
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


INT64_MAX = (1 << 63) - 1


def is_int(value) -> bool:
    """True for a Python or numpy integer (not a bool, a float or a string)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def checked_int(value, what: str, *, minimum: int | None = None) -> int:
    """``value`` as a Python int, or :class:`LayoutError` naming ``what`` (a float, even 2.0, a bool or a
    string is not an integer).

    >>> checked_int(np.int64(3), "rank")
    3
    >>> checked_int(-1, "tensor 'w': rank", minimum=0)
    Traceback (most recent call last):
    ...
    reshard.tensors.LayoutError: tensor 'w': rank must be an integer >= 0, got -1
    """
    if not is_int(value) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise LayoutError(f"{what} must be an integer{bound}, got {value!r}")
    return int(value)


def checked_ints(values, what: str, *, minimum: int | None = None) -> tuple[int, ...]:
    """A sequence of integers as a tuple of Python ints (see :func:`checked_int`); ``what`` names it."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise LayoutError(f"{what} must be a sequence of integers, got {values!r}")
    values = tuple(values)
    if all(type(v) is int for v in values) and (minimum is None or min(values, default=minimum) >= minimum):
        return values
    for v in values:
        if not is_int(v):
            raise LayoutError(f"{what} {values} have {v!r}, which is not an integer")
        if minimum is not None and v < minimum:
            below = "negative" if minimum == 0 else f"below {minimum}"
            raise LayoutError(f"{what} {values} have {v}, which is {below}")
    return tuple(int(v) for v in values)


def _checked_shape(name: str, shape) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        raise LayoutError(f"tensor {name!r}: shape must be a sequence of sizes, got {shape!r}")
    shape = tuple(shape)
    for s in shape:
        if not is_int(s):
            raise LayoutError(f"tensor {name!r}: shape {shape} has a size that is not an integer: {s!r}")
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise LayoutError(f"tensor {name!r}: negative size in shape {shape}")
    return shape


def dtype_name(dtype: torch.dtype) -> str:
    """``'float16'`` for ``torch.float16``."""
    return str(dtype).removeprefix("torch.")


_COMPLEX_PART = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def _max_exponent(dtype: torch.dtype) -> int:
    return math.frexp(torch.finfo(dtype).max)[1] - 1


def narrowing(src: torch.dtype, dst: torch.dtype) -> bool:
    """True when casting ``src`` to ``dst`` (one dtype class) can lose values by range.

    Integers: ``dst`` does not hold every value of ``src`` (int64 -> int32, int8 -> uint8). Floats:
    ``dst`` reaches a lower power of two (fp32 -> fp16, fp64 -> fp32, bf16 -> fp16, bf16 -> fp8).
    Rounding to fewer mantissa bits is not narrowing: fp32 -> bf16 keeps fp32's exponent range (the
    usual refit cast), as fp16 -> fp32 loses nothing. Casts across classes are not casts at all
    (layouts and plans refuse them): False.

    >>> narrowing(torch.int64, torch.int8), narrowing(torch.float32, torch.float16)
    (True, True)
    >>> narrowing(torch.float32, torch.bfloat16), narrowing(torch.float16, torch.float32)
    (False, False)
    """
    if src == dst or dtype_class(src) != dtype_class(dst) or src == torch.bool:
        return False
    src, dst = _COMPLEX_PART.get(src, src), _COMPLEX_PART.get(dst, dst)
    if src.is_floating_point:
        return _max_exponent(dst) < _max_exponent(src)
    s, d = torch.iinfo(src), torch.iinfo(dst)
    return d.min > s.min or d.max < s.max


def _values(n: int) -> str:
    return "1 value" if n == 1 else f"{n} values"


def cast_problem(name: str, t: torch.Tensor, dst: torch.dtype) -> str | None:
    """None if every value of ``t`` survives ``t.to(dst)`` without overflow, else one line that says
    how many values do not and names tensor ``name``.

    Integers must lie within ``dst``'s range; finite floats must stay finite (values within half a
    step of ``dst``'s largest number round to it; NaN and infinities that were there stay as they
    are). One ``aminmax`` per tensor when every value fits; runs on any device.

    >>> cast_problem("w", torch.tensor([1.0, -2.5e5, 7e4]), torch.float16)
    "tensor 'w': 2 values outside float16's range (largest |x| 2.5e+05 > 65504); allow lossy casts to send them anyway"
    >>> cast_problem("w", torch.tensor([1.0, float("inf")]), torch.float16) is None
    True
    >>> cast_problem("ids", torch.tensor([3, 300, -200]), torch.int8).split(";")[0]
    "tensor 'ids': 2 values outside int8's range [-128, 127] (smallest -200, largest 300)"
    """
    src = t.dtype
    if dtype_class(src) != dtype_class(dst):
        return (f"tensor {name!r}: cannot cast {dtype_name(src)} to {dtype_name(dst)}, a dtype of another class "
                f"({dtype_class(src)} -> {dtype_class(dst)})")
    if src == dst or src == torch.bool or t.numel() == 0:
        return None
    if src.is_complex:
        t, src, dst = torch.view_as_real(t), _COMPLEX_PART[src], _COMPLEX_PART[dst]
    allow = "; allow lossy casts to send them anyway"
    if src.is_floating_point:
        if src.itemsize == 1:  # fp8: few ops; every fp8 value is a float16 one
            t, src = t.to(torch.float16), torch.float16
        top = torch.finfo(dst).max
        lo, hi = torch.aminmax(t)
        if all(v <= top for v in torch.stack([lo, hi]).double().abs().tolist()):  # NaN: look closer
            return None
        # round to nearest: |x| >= max + half a step at the top binade overflows
        limit = top + torch.finfo(dst).eps * 2.0 ** _max_exponent(dst) / 2
        a = t.abs()
        near = a[torch.isfinite(a) & (a >= limit / 2)].double()  # limit / 2 stays below limit in any src grid
        over = near[near >= limit]
        if not len(over):
            return None
        return (f"tensor {name!r}: {_values(len(over))} outside {dtype_name(dst)}'s range (largest |x| "
                f"{over.max().item():.4g} > {top:.6g}){allow}")
    info = torch.iinfo(dst)
    if src == torch.uint64:  # few ops support unsigned 64-bit: look at the bits as int64 (>= 2**63: negative)
        v = t.view(torch.int64)
        bad = (v < 0) | (v > info.max) if info.max < INT64_MAX else v < 0
        out = v[bad]
        if not len(out):
            return None
        return (f"tensor {name!r}: {_values(len(out))} outside {dtype_name(dst)}'s range [{info.min}, {info.max}]"
                f"{allow}")
    if src in (torch.uint16, torch.uint32):
        t = t.to(torch.int64)
    lo, hi = (int(v) for v in torch.stack(list(torch.aminmax(t))).tolist())
    if lo >= info.min and hi <= info.max:
        return None
    bad = torch.zeros_like(t, dtype=torch.bool)
    if lo < info.min:
        bad |= t < info.min
    if hi > info.max:
        bad |= t > info.max
    return (f"tensor {name!r}: {_values(int(bad.sum()))} outside {dtype_name(dst)}'s range [{info.min}, {info.max}] "
            f"(smallest {lo}, largest {hi}){allow}")


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A full weight as a checkpoint names it: ``TensorSpec("w", (10, 6), torch.float32)``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise LayoutError(f"tensor name must be a string, got {self.name!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(f"tensor {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        shape = self.shape
        if type(shape) is not tuple or not all(type(s) is int and s >= 0 for s in shape):
            shape = _checked_shape(self.name, shape)
            object.__setattr__(self, "shape", shape)
        if max(shape, default=0) > INT64_MAX:
            raise LayoutError(f"tensor {self.name!r}: size {max(shape)} in shape {shape} does not fit in 64 bits")
        if self.nbytes > INT64_MAX:
            raise LayoutError(f"tensor {self.name!r}: shape {shape} holds {self.nbytes:.3g} bytes of "
                              f"{dtype_name(self.dtype)}, more than a 64-bit byte count can hold")

    def renamed(self, name: str) -> "TensorSpec":
        """This spec under another ``name``, its shape and dtype not checked again (they were): a model's
        ~200 k specs come from a few dozen shapes.

        >>> TensorSpec("w", (2, 3), torch.float32).renamed("v")
        TensorSpec(name='v', shape=(2, 3), dtype=torch.float32)
        """
        if not isinstance(name, str):
            raise LayoutError(f"tensor name must be a string, got {name!r}")
        out = object.__new__(TensorSpec)
        object.__setattr__(out, "name", name)
        object.__setattr__(out, "shape", self.shape)
        object.__setattr__(out, "dtype", self.dtype)
        return out

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
