"""Block FP8 quantization: the one rule every path of an FP8 refit follows, and its reference.

A 2-D weight ``x`` is cut into blocks of ``block = (bn, bk)`` rows and columns (128 x 128 by
default, as DeepSeek-V3 / Kimi-K2 checkpoints and vLLM's block-FP8 layers use); the last block of
a dim that ``bn`` / ``bk`` does not divide is a partial block, and a block like any other. For
every block, in float32::

    amax  = max |x| over the block                (x converted to float32 first)
    s     = amax / 448                            (448: the largest float8_e4m3fn value)
    s     = 2 ** ceil(log2(s))                    (UE8M0 only: rounded up to a power of two)
    s     = 1   where s == 0                      (an all-zero block, or amax / 448 underflows)
    q     = float8_e4m3fn(clamp(x / s, -448, 448))    round to nearest, ties to even

``q`` is the FP8 weight, ``s`` the block's entry of ``<name>_scale_inv`` (float32, shape
``ceil(rows / bn) x ceil(cols / bk)``): the multiplier that dequantizes, ``x ~ q * s``. The clamp
makes saturation explicit (``x / s`` can land a rounding step above 448; float8_e4m3fn has no
infinity, and casts of out-of-range values differ between devices), so the result does not depend
on the device's cast. NaN stays NaN; a block holding an infinity gets an infinite scale and NaN
values (inf / inf), as IEEE arithmetic gives. Every step is elementwise or a max, so a block's
result depends only on its own values: quantizing a box of whole blocks gives the same bits as
quantizing the full tensor and cutting the box out (what lets an FP8 refit quantize each block
wherever it is whole, :mod:`reshard.planning.precision`).

>>> import torch
>>> x = torch.tensor([[1.0, -2.0, 0.5], [4.0, 0.0, 3.0]])
>>> q, s = quantize_blocks(x, (2, 2))
>>> s.tolist()          # block [0:2, 0:2] has amax 4, block [0:2, 2:3] has amax 3
[[0.008928571827709675, 0.0066964286379516125]]
>>> q.float().tolist()      # x / s, to the nearest float8_e4m3fn (0.5 / s = 74.67 -> 72)
[[112.0, -224.0, 72.0], [448.0, 0.0, 448.0]]
>>> quantize_blocks(x, (2, 2), ue8m0=True)[1].tolist()   # 4/448, 3/448 rounded up: 2**-6, 2**-7
[[0.015625, 0.0078125]]

Pure torch: no process group; the same code runs on CPU and CUDA.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_DTYPE = torch.float32
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # checkpoint naming: <weight name>_scale_inv, vLLM's weight_scale_inv


def scale_name(name: str) -> str:
    """The name of a weight's block scales, as FP8 checkpoints and vLLM name them.

    >>> scale_name("model.layers.0.mlp.down_proj.weight")
    'model.layers.0.mlp.down_proj.weight_scale_inv'
    """
    return name + SCALE_SUFFIX


def grid_shape(shape, block) -> tuple[int, ...]:
    """Blocks per dim of a 2-D ``shape`` (partial edge blocks count): the ``_scale_inv`` shape.

    >>> grid_shape((300, 128), (128, 128))
    (3, 1)
    """
    return tuple(-(-int(n) // int(b)) for n, b in zip(shape, block))


def check_block(block, what: str = "block") -> tuple[int, int]:
    """``block`` as a pair of positive ints, else ``ValueError`` naming ``what``.

    >>> check_block([128, 64])
    (128, 64)
    """
    ok = (not isinstance(block, (str, bytes)) and hasattr(block, "__len__") and len(block) == 2
          and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block))
    if not ok:
        raise ValueError(f"{what} must be two positive integers (rows, columns), got {block!r}")
    return int(block[0]), int(block[1])


def _blocked(x: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x32, x4)``: a float32 copy of 2-D ``x``, zero-padded to whole blocks, and its
    ``(block rows, bn, block cols, bk)`` view (zeros leave every block's max of ``|x|`` unchanged)."""
    bn, bk = check_block(block)
    if x.dim() != 2:
        raise ValueError(f"block quantization takes a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    gr, gc = grid_shape((rows, cols), (bn, bk))
    whole = gr * bn == rows and gc * bk == cols
    x32 = (torch.empty if whole else torch.zeros)((gr * bn, gc * bk), dtype=torch.float32, device=x.device)
    x32[:rows, :cols].copy_(x.detach())
    return x32, x32.view(gr, bn, gc, bk)


def _scales(x4: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    amax = torch.maximum(x4.amax(dim=(1, 3)), x4.amin(dim=(1, 3)).neg_())  # max |x|, no |x| temporary
    s = amax / FP8_MAX
    if ue8m0:
        mant, exp = torch.frexp(s)  # s = mant * 2**exp, mant in [0.5, 1): a power of two has mant 0.5
        s = torch.where(s > 0, torch.ldexp(torch.ones_like(s), exp - (mant == 0.5).to(exp.dtype)), s)
    return torch.where(s == 0, torch.ones_like(s), s)


def _scaled(x32: torch.Tensor, x4: torch.Tensor, scales: torch.Tensor, shape) -> torch.Tensor:
    """``clamp(x / s, -448, 448)`` in place in ``x32``, cut back to ``shape`` (float32, not yet FP8)."""
    x4.div_(scales[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return x32[: shape[0], : shape[1]]


def quantize_blocks(x: torch.Tensor, block=DEFAULT_BLOCK, ue8m0: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, float32 scale_inv)`` of 2-D ``x`` under the module's rule, block by block.

    >>> q, s = quantize_blocks(torch.full((3, 5), 2.0), (2, 4))
    >>> q.dtype, tuple(q.shape), tuple(s.shape), q.float().unique().tolist()
    (torch.float8_e4m3fn, (3, 5), (2, 2), [448.0])
    """
    x32, x4 = _blocked(x, block)
    s = _scales(x4, ue8m0)
    return _scaled(x32, x4, s, x.shape).to(FP8_DTYPE), s


def quantize_into(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, block=DEFAULT_BLOCK,
                  ue8m0: bool = False) -> None:
    """Quantize ``x`` (a box of whole blocks) into the views ``q_out`` (its shape, float8_e4m3fn) and
    ``s_out`` (its block grid, float32), in place: what senders and receivers of an FP8 refit run."""
    x32, x4 = _blocked(x, block)
    s = _scales(x4, ue8m0)
    s_out.copy_(s)
    q_out.copy_(_scaled(x32, x4, s, x.shape))


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block=DEFAULT_BLOCK,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * s`` block by block, in ``dtype`` (for checks and reports; a refit never dequantizes).

    >>> x = torch.tensor([[3.0, -1.5]])
    >>> dequantize_blocks(*quantize_blocks(x, (1, 2)), (1, 2)).tolist()
    [[3.0, -1.5]]
    """
    bn, bk = check_block(block)
    rows, cols = q.shape
    full = scale_inv.to(torch.float32).repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
    return (q.to(torch.float32) * full).to(dtype)


def fp8_bytes(shape, block=DEFAULT_BLOCK) -> int:
    """Bytes of a 2-D weight in block FP8: one byte per element plus four per block scale.

    >>> fp8_bytes((256, 300))     # 76800 fp8 bytes + 2 x 3 scales
    76824
    """
    return math.prod(shape) + 4 * math.prod(grid_shape(shape, block))


__all__ = ["DEFAULT_BLOCK", "FP8_DTYPE", "FP8_MAX", "SCALE_DTYPE", "SCALE_SUFFIX", "check_block",
           "dequantize_blocks", "fp8_bytes", "grid_shape", "quantize_blocks", "quantize_into",
           "scale_name"]
