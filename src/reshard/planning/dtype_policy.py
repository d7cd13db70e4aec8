"""Destination precision per tensor: what dtype each destination tensor takes in a refit.

A :class:`DtypePolicy` maps every destination tensor to its precision: :class:`Keep` (the dtype the
destination layout gives it), :class:`Cast` (``Cast(torch.bfloat16)``: the sender casts) or
:class:`FP8Block` (float8_e4m3fn with one float32 scale per block, 128 x 128 by default; the rule
is :mod:`reshard.quant`'s). The default, :meth:`DtypePolicy.fp8`, quantizes the 2-D linear weights
an FP8 checkpoint (DeepSeek-V3, Kimi-K2) stores in FP8 and keeps the rest::

    model.layers.0.self_attn.q_proj.weight           FP8Block   (attention projections, MLA's too)
    model.layers.0.mlp.experts.7.down_proj.weight    FP8Block   (dense MLP, experts, shared experts)
    model.layers.0.mlp.gate.weight                   Keep       (router)
    model.layers.0.input_layernorm.weight            Keep       (norms, biases)
    model.embed_tokens.weight, lm_head.weight        Keep

Pure: no process group, no device.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Union

import torch

from ..layout import Layout
from ..quant import (DEFAULT_BLOCK, MX_BLOCK, MX_SCALE_DTYPE, MX_SCALE_SUFFIX, SCALE_DTYPE, SCALE_SUFFIX,
                     check_block)
from ..tensors import TensorSpec, dtype_name


@dataclass(frozen=True)
class Keep:
    """The dtype the destination layout gives the tensor (what the engine allocated)."""

    def __str__(self) -> str:
        return "keep"


@dataclass(frozen=True)
class Cast:
    """Destination buffers in ``dtype`` (``Cast(torch.bfloat16)``); the sender casts, as in any refit."""

    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"Cast takes a torch.dtype, got {self.dtype!r}")

    def __str__(self) -> str:
        return f"cast:{dtype_name(self.dtype)}"


@dataclass(frozen=True)
class FP8Block:
    """float8_e4m3fn with one float32 scale per ``block`` (rows, columns); ``ue8m0``: every scale
    rounded up to a power of two (see :mod:`reshard.quant`)."""

    block: tuple[int, int] = DEFAULT_BLOCK
    ue8m0: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", check_block(self.block, "FP8Block block"))
        if not isinstance(self.ue8m0, bool):
            raise ValueError(f"FP8Block ue8m0 must be True or False, got {self.ue8m0!r}")

    def __str__(self) -> str:
        return f"fp8:{self.block[0]}x{self.block[1]}" + (":ue8m0" if self.ue8m0 else "")

    #: whether the scales are MX E8M0 codes (:class:`MXFP8Block`) rather than float32 multipliers; the
    #: scales' dtype and the suffix of their name (float32, ``<name>_scale_inv``): class constants, no fields
    mx, scale_dtype, scale_suffix = False, SCALE_DTYPE, SCALE_SUFFIX

    def scale_name(self, name: str) -> str:
        """The name of tensor (or buffer) ``name``'s scales: ``<name>_scale_inv`` (``<name>_scale`` for MXFP8)."""
        return name + self.scale_suffix


@dataclass(frozen=True)
class MXFP8Block(FP8Block):
    """MXFP8 (OCP Microscaling v1.0): float8_e4m3fn with one E8M0 scale (uint8 biased exponent) per
    32 elements along the last dim, the reduction dim of a linear weight ``[out, in]``: block
    ``(1, 32)``; the scales are ``<name>_scale`` (vLLM's ``weight_scale``), shape ``[out, in / 32]``. The
    rule is :func:`reshard.quant.quantize_mx`.

    >>> p = MXFP8Block()
    >>> str(p), p.block, p.scale_dtype, p.scale_name("w")
    ('mxfp8:1x32', (1, 32), torch.uint8, 'w_scale')
    """

    block: tuple[int, int] = MX_BLOCK
    mx, scale_dtype, scale_suffix = True, MX_SCALE_DTYPE, MX_SCALE_SUFFIX

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block != MX_BLOCK or self.ue8m0:
            raise ValueError(f"MXFP8Block takes no options: its blocks are 1x32 with E8M0 scales, got block "
                             f"{self.block}, ue8m0={self.ue8m0}")

    def __str__(self) -> str:
        return "mxfp8:1x32"


Precision = Union[Keep, Cast, FP8Block]
KEEP = Keep()

#: the 2-D linear weights FP8 checkpoints store in FP8 (Hugging Face and Megatron names): attention
#: projections (MLA's ``q_a_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj`` too), dense and expert
#: MLPs. Routers (``mlp.gate.weight``), norms, biases, embeddings and heads match none.
FP8_PATTERNS: tuple[str, ...] = (
    r"_proj(_with_mqa)?\.weight$",
    r"(^|\.)linear_(qkv|proj|fc1|fc2)\.weight$",
)

LEGACY_MODULE = "reshard.planning.precision"  # where the policy types were defined first (see DtypePolicy.named)

def is_precision(value) -> bool:
    """Whether ``value`` is one of the precisions (:class:`Keep`, :class:`Cast`, :class:`FP8Block`)."""
    return isinstance(value, (Keep, Cast, FP8Block))


def _compiled_rules(rules) -> tuple[tuple[re.Pattern, Precision], ...]:
    """``rules`` as (compiled pattern, precision) pairs, or ValueError naming the bad rule."""
    compiled = []
    for rule in rules:
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str) and is_precision(rule[1])):
            raise ValueError(f"DtypePolicy rule {rule!r}: expected (regular expression, Keep() / Cast(dtype) / "
                             f"FP8Block())")
        try:
            compiled.append((re.compile(rule[0]), rule[1]))
        except re.error as error:
            raise ValueError(f"DtypePolicy pattern {rule[0]!r} is not a regular expression: {error}") from None
    return tuple(compiled)


@dataclass(frozen=True)
class DtypePolicy:
    """Each destination tensor's precision: the first of ``rules`` (``(regular expression, precision)``,
    ``re.search`` on the name) that matches, else ``default``. ``predicate(spec)``, if given, is asked
    first; it returns a precision or None (then the rules decide).

    >>> pol = DtypePolicy.fp8()
    >>> [str(pol(TensorSpec(n, (256, 256), torch.bfloat16))) for n in
    ...  ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate.weight", "lm_head.weight")]
    ['fp8:128x128', 'keep', 'keep']
    >>> str(DtypePolicy.fp8(keep=[r"layers\\.0\\."])(TensorSpec("model.layers.0.mlp.up_proj.weight", (8, 8), torch.float32)))
    'keep'
    >>> str(DtypePolicy(default=Cast(torch.bfloat16))(TensorSpec("w", (4,), torch.float32)))
    'cast:bfloat16'
    """

    rules: tuple[tuple[str, Precision], ...] = ()
    default: Precision = KEEP
    predicate: Callable[[TensorSpec], Precision | None] | None = None
    _compiled: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.rules, (str, bytes)) or not isinstance(self.rules, Iterable):
            raise ValueError(f"DtypePolicy rules must be (pattern, precision) pairs, got {self.rules!r}")
        rules = tuple(tuple(rule) if isinstance(rule, (tuple, list)) else rule for rule in self.rules)
        compiled = _compiled_rules(rules)
        if not is_precision(self.default):
            raise ValueError(f"DtypePolicy default must be Keep(), Cast(dtype) or FP8Block(), got {self.default!r}")
        if self.predicate is not None and not callable(self.predicate):
            raise ValueError(f"DtypePolicy predicate must be callable, got {self.predicate!r}")
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "_compiled", compiled)

    def __call__(self, spec: TensorSpec) -> Precision:
        if self.predicate is not None:
            chosen = self.predicate(spec)
            if chosen is not None:
                if not is_precision(chosen):
                    raise ValueError(f"tensor {spec.name!r}: the DtypePolicy predicate returned {chosen!r}, not a "
                                     f"precision (Keep(), Cast(dtype), FP8Block()) or None")
                return chosen
        for pattern, precision in self._compiled:
            if pattern.search(spec.name):
                return precision
        return self.default

    @classmethod
    def _linear_weights(cls, precision: Precision, keep: Iterable[str]) -> "DtypePolicy":
        """``precision`` for :data:`FP8_PATTERNS`, the rest kept; ``keep`` (a pattern or several) first."""
        if isinstance(keep, str):
            keep = [keep]
        return cls(tuple((pattern, KEEP) for pattern in keep) + tuple((pattern, precision) for pattern in FP8_PATTERNS))

    @classmethod
    def fp8(cls, block=DEFAULT_BLOCK, ue8m0: bool = False, keep: Iterable[str] = ()) -> "DtypePolicy":
        """FP8 for the linear weights (:data:`FP8_PATTERNS`), the rest kept; names matching ``keep``
        (regular expressions) are kept too."""
        return cls._linear_weights(FP8Block(block, ue8m0), keep)

    @classmethod
    def mxfp8(cls, keep: Iterable[str] = ()) -> "DtypePolicy":
        """MXFP8 (:class:`MXFP8Block`) for the linear weights (:data:`FP8_PATTERNS`), the rest kept; names
        matching ``keep`` are kept too.

        >>> str(DtypePolicy.mxfp8()(TensorSpec("model.layers.0.mlp.down_proj.weight", (64, 64), torch.bfloat16)))
        'mxfp8:1x32'
        """
        return cls._linear_weights(MXFP8Block(), keep)

    @classmethod
    def named(cls, precision: str) -> "DtypePolicy":
        """The policies of ``--precision``: ``fp8`` (:meth:`fp8`), ``mxfp8`` (:meth:`mxfp8`), ``bf16`` / ``fp16`` /
        ``fp32`` (every floating tensor cast; integer tensors kept), ``keep``.

        >>> str(DtypePolicy.named("bf16")(TensorSpec("w", (2,), torch.float32)))
        'cast:bfloat16'
        """
        if precision == "fp8":
            return cls.fp8()
        if precision == "mxfp8":
            return cls.mxfp8()
        if precision == "keep":
            return cls()
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        if precision not in dtypes:
            raise ValueError(f"unknown precision {precision!r}; choose one of fp8, mxfp8, bf16, fp16, fp32, keep")
        cast = Cast(dtypes[precision])
        predicate = lambda spec: cast if spec.dtype.is_floating_point else KEEP  # noqa: E731
        # :attr:`key` names a predicate by module and qualified name; this one keeps the module it was
        # written in (before the policy types moved here), so plan fingerprints stay what they were
        predicate.__module__ = LEGACY_MODULE
        return cls(predicate=predicate)

    @property
    def key(self) -> str:
        """What identifies the policy across processes (plan fingerprints): its rules and default, and its
        predicate's qualified name (a predicate's code cannot be compared)."""
        rules = "|".join(f"{pattern}={precision}" for pattern, precision in self.rules)
        predicate = ""
        if self.predicate is not None:
            named = self.predicate
            qualname = getattr(named, "__qualname__", type(named).__qualname__)
            predicate = f";predicate:{getattr(named, '__module__', '?')}.{qualname}"
        return f"rules:{rules};default:{self.default}{predicate}"


def as_policy(policy) -> DtypePolicy:
    """``policy`` as a :class:`DtypePolicy`: a policy, a name (``"fp8"``, ``"bf16"``, ...), or None (the
    default :meth:`DtypePolicy.fp8`)."""
    if policy is None:
        return DtypePolicy.fp8()
    if isinstance(policy, DtypePolicy):
        return policy
    if isinstance(policy, str):
        return DtypePolicy.named(policy)
    raise ValueError(f"dtype policy {policy!r}: expected a DtypePolicy or one of 'fp8', 'mxfp8', 'bf16', 'fp16', "
                     f"'fp32', 'keep'")


def layout_precisions(destination: Layout, policy: DtypePolicy | str | None = None) -> dict[str, Precision]:
    """``{tensor: precision}`` of every destination tensor under ``policy``."""
    policy = as_policy(policy)
    return {name: policy(spec) for name, spec in destination.specs.items()}


__all__ = ["Cast", "DtypePolicy", "FP8Block", "FP8_PATTERNS", "KEEP", "Keep", "MXFP8Block", "Precision", "as_policy",
           "is_precision", "layout_precisions"]
