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

MXFP8 (OCP Microscaling Formats v1.0, :func:`quantize_mx`): blocks of 32 consecutive elements along
the last dim (the reduction dim of a linear weight ``[out, in]``: block ``(1, 32)``), one shared
E8M0 scale per block, stored as a uint8 biased exponent (bias 127; 0xFF is NaN)::

    amax  = max |x| over the block                (float32)
    e     = floor(log2(amax)) - 8                 (8: emax of e4m3; exact, from the float's exponent)
    e     = clamp(e, -127, 127)                   (E8M0's range; -127 also for an all-zero block)
    q     = float8_e4m3fn(clamp(x * 2**-e, -448, 448))    round to nearest, ties to even (saturating)
    code  = e + 127                               (uint8); 0xFF and q NaN where the block holds NaN/inf

>>> q, code = quantize_mx(torch.tensor([[1.0, -3.0, 500.0, 0.25]]), block=(1, 4))
>>> code.tolist(), q.float().tolist()       # amax 500: e = 8 - 8 = 0; 500 saturates to 448
([[127]], [[1.0, -3.0, 448.0, 0.25]])

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
MX_BLOCK = (1, 32)  # OCP MX: 32 elements along the last (reduction) dim share one scale
MX_SCALE_DTYPE = torch.uint8  # E8M0: the biased exponent, as vLLM's MXFP8 layers hold weight_scale
MX_SCALE_SUFFIX = "_scale"  # <weight name>_scale: vLLM's (ModelOpt / compressed-tensors MXFP8) weight_scale
E8M0_BIAS = 127
E8M0_NAN = 0xFF
MX_EMAX_ELEM = 8  # emax of float8_e4m3fn (448 = 1.75 * 2**8)


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


def _mx_codes(x4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E8M0 codes as int32 [grid], finite [grid]) of the blocks of ``x4`` (see module doc)."""
    amax = torch.maximum(x4.amax(dim=(1, 3)), x4.amin(dim=(1, 3)).neg_())
    finite = torch.isfinite(amax)
    _, exp = torch.frexp(torch.where(finite, amax, torch.zeros_like(amax)))  # amax = m * 2**exp, m in [0.5, 1)
    e = torch.where(amax > 0, exp - 1 - MX_EMAX_ELEM, torch.full_like(exp, -E8M0_BIAS))
    return e.clamp_(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS, finite


def _mx_scaled(x32: torch.Tensor, x4: torch.Tensor, codes: torch.Tensor, finite: torch.Tensor, shape
               ) -> torch.Tensor:
    """``clamp(x * 2**-e, -448, 448)`` in place in ``x32`` (NaN in non-finite blocks), cut to ``shape``."""
    # 2**-e for e in [-127, 127] is a normal float32: the multiply is exact (a power of two)
    inv = torch.ldexp(torch.ones(codes.shape, dtype=torch.float32, device=codes.device), E8M0_BIAS - codes)
    inv = torch.where(finite, inv, torch.full_like(inv, float("nan")))
    x4.mul_(inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return x32[: shape[0], : shape[1]]


def quantize_mx(x: torch.Tensor, block=MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, uint8 E8M0 scale codes)`` of 2-D ``x`` by the OCP MX v1.0 rule (module doc); the
    reference every MXFP8 path of a refit is checked against. Scales have shape ``[rows, ceil(cols / 32)]``
    (a partial last block is a block of the elements it has). ``block`` other than ``(1, 32)`` is for tests.

    Rounding, as chosen here from the spec: the shared exponent is ``floor(log2(amax)) - 8`` read exactly
    from the float's exponent (no ``log2`` rounding), clamped to E8M0's ``[-127, 127]``; an all-zero block
    takes the smallest scale (code 0, 2**-127) and zero elements; elements are ``x * 2**-e`` (exact) cast
    to e4m3 by round to nearest, ties to even, saturating at +-448 (the spec's clamp of normal values; the
    block's largest elements, ``amax * 2**-e`` in ``[256, 512)``, saturate when above 448); a block holding
    NaN or an infinity has scale code 0xFF (NaN) and NaN elements. vLLM's own online MXFP8 quantizer
    (``mxfp8_e4m3_quantize``) rounds the exponent up instead (``ceil(log2(amax / 448))``), so for blocks
    whose amax mantissa is above 1.75 its scale is twice this one's.

    >>> q, s = quantize_mx(torch.tensor([[2.0 ** -140, 0.0], [0.0, 0.0], [float("inf"), 1.0]]), (1, 2))
    >>> s.tolist(), q.float()[2].isnan().tolist()
    ([[0], [0], [255]], [True, True])
    """
    x32, x4 = _blocked(x, block)
    codes, finite = _mx_codes(x4)
    q = _mx_scaled(x32, x4, codes, finite, x.shape).to(FP8_DTYPE)
    return q, torch.where(finite, codes, torch.full_like(codes, E8M0_NAN)).to(MX_SCALE_DTYPE)


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """The float32 scales of E8M0 ``codes`` (uint8): ``2 ** (code - 127)``, NaN for 0xFF.

    >>> e8m0_to_float(torch.tensor([0, 127, 134, 255], dtype=torch.uint8)).tolist()[1:]
    [1.0, 128.0, nan]
    """
    c = codes.to(torch.int32)
    out = torch.ldexp(torch.ones(c.shape, dtype=torch.float32, device=c.device), c - E8M0_BIAS)
    return torch.where(c == E8M0_NAN, torch.full_like(out, float("nan")), out)


def dequantize_mx(q: torch.Tensor, codes: torch.Tensor, block=MX_BLOCK, dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor:
    """``q * 2 ** (code - 127)`` block by block, in ``dtype`` (for checks; a refit never dequantizes).

    >>> x = torch.tensor([[3.0, -1.5, 0.0, 96.0]])
    >>> dequantize_mx(*quantize_mx(x, (1, 4)), (1, 4)).tolist()
    [[3.0, -1.5, 0.0, 96.0]]
    """
    return dequantize_blocks(q, e8m0_to_float(codes), block, dtype)


def quantize_into(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, block=DEFAULT_BLOCK,
                  ue8m0: bool = False, mx: bool = False) -> None:
    """Quantize ``x`` (a box of whole blocks) into the views ``q_out`` (its shape, float8_e4m3fn) and
    ``s_out`` (its block grid, float32; uint8 E8M0 codes when ``mx``), in place: what senders and
    receivers of an FP8 refit run."""
    x32, x4 = _blocked(x, block)
    if mx:
        codes, finite = _mx_codes(x4)
        s_out.copy_(torch.where(finite, codes, torch.full_like(codes, E8M0_NAN)))
        q_out.copy_(_mx_scaled(x32, x4, codes, finite, x.shape))
        return
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


def fp8_bytes(shape, block=DEFAULT_BLOCK, scale_bytes: int = 4) -> int:
    """Bytes of a 2-D weight in block FP8: one byte per element plus ``scale_bytes`` per block scale
    (4: float32; 1: MXFP8's E8M0).

    >>> fp8_bytes((256, 300))     # 76800 fp8 bytes + 2 x 3 scales
    76824
    >>> fp8_bytes((256, 320), MX_BLOCK, 1)   # 81920 fp8 bytes + 256 x 10 scales
    84480
    """
    return math.prod(shape) + scale_bytes * math.prod(grid_shape(shape, block))


__all__ = ["DEFAULT_BLOCK", "E8M0_BIAS", "E8M0_NAN", "FP8_DTYPE", "FP8_MAX", "MX_BLOCK", "MX_SCALE_DTYPE",
           "MX_SCALE_SUFFIX", "SCALE_DTYPE", "SCALE_SUFFIX", "check_block", "dequantize_blocks", "dequantize_mx",
           "e8m0_to_float", "fp8_bytes", "grid_shape", "quantize_blocks", "quantize_into", "quantize_mx",
           "scale_name"]
