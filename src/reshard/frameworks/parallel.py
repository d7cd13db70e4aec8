"""The parallel configuration of each side of a refit: parsed once, validated once, laid out on request.

Configurations are written the way papers and launch scripts say them::

    TrainParallel.parse("tp1,ep16,pp4,dp2")      Megatron-Core (the default framework): world =
                                                 tp x cp x pp x dp, or with ep > 1 etp x ep x pp x dp
                                                 (dp = replicas of the expert grid; dense data
                                                 parallel is then world / (tp x cp x pp))
    TrainParallel.parse("fsdp:dp64,tp8,hsdp2")   FSDP2 over TP, 2 HSDP replicas
    InferParallel.parse("tp8,dp16")              vLLM (the default): 16 engines of 8 ranks, one
                                                 deployment with data_parallel_size=16
    InferParallel.parse("tp8,dp16,ep")           ... with expert parallelism
    InferParallel.parse("tp8,dp128,ep,deployments2")  two such deployments side by side, each
                                                 of its own 1024 ranks holding the whole model
    InferParallel.parse("dtensor:tp2,dp2")       torch DTensor tensor parallelism, 2 replicas

>>> t = TrainParallel.parse("tp1,ep16,pp4,dp2")
>>> t.world, t.dense_dp, str(t)
(128, 32, 'tp1,ep16,pp4,dp2')
>>> InferParallel.parse("tp8,dp16").world
128
>>> TrainParallel.parse("fsdp:dp4,pp2")
Traceback (most recent call last):
...
reshard.tensors.LayoutError: fsdp:dp4,pp2: fsdp takes dp, hsdp, tp, not pp

:func:`model_layouts` builds both sides of a named model's refit: training ranks ``0..M-1``,
inference ranks ``M..M+N-1`` (or ``0..N-1`` when colocated). Pure: no process group.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from ..layout import Layout
from ..models.arch import Arch, get_arch, model_specs
from ..placements import check_sizes
from ..tensors import LayoutError, TensorSpec
from .fsdp import fsdp_layout
from .megatron import megatron_layout, suggest_pp_layers
from .tensor_parallel import tensor_parallel_layout
from .vllm import vllm_layout

TRAIN_KEYS = {"megatron": ("tp", "cp", "ep", "etp", "pp", "dp"), "fsdp": ("dp", "tp", "hsdp")}
INFER_KEYS = {"vllm": ("tp", "dp", "ep", "independent", "deployments"), "dtensor": ("tp", "dp")}
# inference keys written without a size: vLLM's enable_expert_parallel, and "the dp engines are
# separate vLLM instances" (else one deployment with data_parallel_size=dp)
FLAGS = {"ep", "independent"}
MAX_WORLD = 1 << 16
"""Most ranks one side may have: far beyond any cluster refit modeled here (the biggest, 1024), and small
enough that a typo (dp100000000) is refused at once instead of building layouts of 10**8 ranks."""


def _check_world(side: str, sizes: _Sides) -> None:
    if sizes.world > MAX_WORLD:
        raise LayoutError(f"{side} {sizes.framework}: {sizes.world} ranks; at most {MAX_WORLD} ranks per side")


def _parse(text: str, frameworks: dict[str, tuple[str, ...]], flags: set[str]) -> tuple[str, dict[str, int | bool]]:
    """``"fsdp:tp2,dp4"`` -> ``("fsdp", {"tp": 2, "dp": 4})``; the first framework is the default."""
    framework, _, body = text.rpartition(":")
    framework = framework.strip().lower() or next(iter(frameworks))
    if framework not in frameworks:
        raise LayoutError(f"{text}: unknown framework {framework!r}; use one of "
                          f"{', '.join(f + ':' for f in frameworks)}")
    allowed = frameworks[framework]
    out: dict[str, int | bool] = {}
    for item in filter(None, (t.strip().lower() for t in body.split(","))):
        m = re.fullmatch(r"([a-z]+)(\d*)", item)
        if not m:
            raise LayoutError(f"{text}: cannot read {item!r}; use comma-separated sizes like tp8,dp16")
        key, num = m.groups()
        if key not in allowed:
            raise LayoutError(f"{text}: {framework} takes {', '.join(sorted(allowed))}, not {key}")
        if key in out:
            raise LayoutError(f"{text}: {key} is given twice")
        if key in flags:
            if num:
                raise LayoutError(f"{text}: {key} takes no size ({framework} sets it from the other sizes)")
            out[key] = True
        elif not num:
            raise LayoutError(f"{text}: {key} needs a size, like {key}2")
        else:
            out[key] = int(num)
    return framework, out


class _Sides:
    """What both sides' configurations share: parsing, formatting, describing. Subclasses set
    ``KEYS`` (framework -> its sizes; the first framework is the default) and ``FLAGS``."""

    KEYS: ClassVar[dict[str, tuple[str, ...]]]
    FLAGS: ClassVar[set[str]] = set()
    framework: str

    @classmethod
    def parse(cls, text: str):
        framework, sizes = _parse(text, cls.KEYS, cls.FLAGS)
        try:
            return cls(framework, **sizes)
        except LayoutError as e:
            raise LayoutError(f"{text}: {e}") from None

    def shown_sizes(self) -> dict[str, int | bool]:
        raise NotImplementedError

    def __str__(self) -> str:
        body = ",".join(k if v is True else f"{k}{v}" for k, v in self.shown_sizes().items())
        return body if self.framework == next(iter(self.KEYS)) else f"{self.framework}:{body}"

    def describe(self) -> str:
        """``"megatron tp1,ep16,pp4,dp2"``, ``"vllm tp8,dp16"``: the framework, then the sizes."""
        return f"{self.framework} {str(self).rpartition(':')[2]}"


@dataclass(frozen=True)
class TrainParallel(_Sides):
    """The training side's parallel sizes (Megatron-Core or FSDP2), validated when built.

    Megatron: ``tp, cp, pp, ep, etp`` (expert TP, default ``tp`` without EP, 1 with it) and ``dp``
    (with ``ep > 1``: replicas of the expert grid). FSDP2: ``dp`` (shard), ``hsdp`` (replicas), ``tp``.
    """

    KEYS = TRAIN_KEYS

    framework: str = "megatron"
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    dp: int = 1
    hsdp: int = 1

    def __post_init__(self) -> None:
        if self.framework not in TRAIN_KEYS:
            raise LayoutError(f"training framework {self.framework!r} unknown; use one of {', '.join(TRAIN_KEYS)}")
        sizes = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "framework"}
        check_sizes(f"training {self.framework}", **{k: v for k, v in sizes.items() if v is not None})
        unused = [k for k, v in sizes.items() if k not in TRAIN_KEYS[self.framework] and v not in (None, 1)]
        if unused:
            raise LayoutError(f"training {self.framework}: {unused[0]}={sizes[unused[0]]} is not a {self.framework} "
                              f"size ({', '.join(TRAIN_KEYS[self.framework])})")
        _check_world("training", self)
        if self.framework == "megatron" and self.world % (self.tp * self.cp * self.pp):
            raise LayoutError(f"training megatron: {self.world} ranks do not split into tp{self.tp} x cp{self.cp} "
                              f"x pp{self.pp} groups")

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else (1 if self.ep > 1 else self.tp)

    @property
    def world(self) -> int:
        if self.framework == "fsdp":
            return self.tp * self.dp * self.hsdp
        if self.ep > 1:
            return self.expert_tp * self.ep * self.pp * self.dp
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dense_dp(self) -> int:
        """Megatron's dense data-parallel size (``world / (tp x cp x pp)``)."""
        return self.world // (self.tp * self.cp * self.pp)

    def shown_sizes(self) -> dict[str, int | bool]:
        always = {"tp", "etp"} if self.framework == "megatron" else {"dp"}  # etp: when given
        return {k: getattr(self, k) for k in TRAIN_KEYS[self.framework]
                if getattr(self, k) not in (None, 1) or (k in always and getattr(self, k) is not None)}

    def layout(self, arch: Arch | str, ranks=None, *, dtype: torch.dtype | None = None) -> Layout:
        """``arch``'s parameters as this framework lays them out over ``ranks`` (default ``0..world-1``)."""
        arch = get_arch(arch)
        ranks = range(self.world) if ranks is None else ranks
        if self.framework == "fsdp":
            return fsdp_layout(arch, ranks, dp_shard=self.dp, dp_replicate=self.hsdp, tp=self.tp, dtype=dtype)
        # MTP layers sit on the last stage outside the pipeline split of the decoder layers
        pp_layers = None if arch.layers % self.pp == 0 else suggest_pp_layers(arch.layers, self.pp)
        return megatron_layout(arch, ranks, tp=self.tp, pp=self.pp, ep=self.ep, etp=self.expert_tp,
                               dp=self.dense_dp, cp=self.cp, pp_layers=pp_layers, dtype=dtype)


@dataclass(frozen=True)
class InferParallel(_Sides):
    """The inference side's parallel sizes: ``dp`` engines (or replicas) of ``tp`` ranks, and for vLLM
    whether MoE layers are expert parallel (their EP size is then the MoE group, ``tp x dp``).

    vLLM has two readings of ``dp``: one deployment with ``data_parallel_size=dp`` (the default;
    its MoE layers spread over all ``tp x dp`` ranks), or ``independent``: ``dp`` separate engines
    of ``tp`` ranks, each holding the whole model, as most RL stacks run them. ``deployments``:
    that many copies of the whole arrangement on consecutive ranks (each its own vLLM deployment,
    its expert parallelism over its own ``tp x dp`` ranks): how a model whose experts do not
    divide over ``tp x dp x deployments`` ranks still uses them all.

    >>> InferParallel.parse("tp32,dp8").describe(), InferParallel.parse("tp32,dp8,independent").describe()
    ('vllm tp32,dp8 (one deployment, data_parallel_size=8)', 'vllm tp32,dp8,independent (8 independent engines)')
    >>> two = InferParallel.parse("tp2,dp2,ep,deployments2")
    >>> two.world, two.describe()
    (8, 'vllm tp2,dp2,ep,deployments2 (2 deployments, each data_parallel_size=2)')
    """

    KEYS = INFER_KEYS
    FLAGS = FLAGS

    framework: str = "vllm"
    tp: int = 1
    dp: int = 1
    ep: bool = False
    independent: bool = False
    deployments: int = 1

    def __post_init__(self) -> None:
        if self.framework not in INFER_KEYS:
            raise LayoutError(f"inference framework {self.framework!r} unknown; use one of {', '.join(INFER_KEYS)}")
        check_sizes(f"inference {self.framework}", tp=self.tp, dp=self.dp, deployments=self.deployments)
        _check_world("inference", self)
        if self.ep and "ep" not in INFER_KEYS[self.framework]:
            raise LayoutError(f"inference {self.framework}: no expert parallelism")

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.deployments

    def shown_sizes(self) -> dict[str, int | bool]:
        sizes: dict[str, int | bool] = {"tp": self.tp}
        if self.dp > 1:
            sizes["dp"] = self.dp
        if self.ep:
            sizes["ep"] = True
        if self.independent:
            sizes["independent"] = True
        if self.deployments > 1:
            sizes["deployments"] = self.deployments
        return sizes

    def describe(self) -> str:
        text = super().describe()
        if self.framework != "vllm" or self.dp == 1:
            return text
        if self.independent:
            return text + f" ({self.dp * self.deployments} independent engines)"
        if self.deployments > 1:
            return text + f" ({self.deployments} deployments, each data_parallel_size={self.dp})"
        return text + f" (one deployment, data_parallel_size={self.dp})"

    def layout(self, arch: Arch | str, ranks=None, *, dtype: torch.dtype | None = None) -> Layout:
        """``arch``'s weights as the engines hold them on ``ranks`` (default ``0..world-1``), engine by engine."""
        arch = get_arch(arch)
        ranks = range(self.world) if ranks is None else ranks
        if self.framework == "dtensor":
            return tensor_parallel_layout(arch, ranks, self.tp, self.dp, dtype=dtype)
        return vllm_layout(arch, list(ranks), self.tp, self.dp, expert_parallel=self.ep, dtype=dtype,
                           independent_engines=self.independent, deployments=self.deployments)


@dataclass(frozen=True)
class ModelLayouts:
    """Both sides of a named model's refit (see :func:`model_layouts`)."""

    arch: Arch
    train: TrainParallel
    infer: InferParallel
    source: Layout
    destination: Layout
    colocate: bool
    build_s: float  # seconds to build both layouts

    @property
    def train_world(self) -> int:
        return self.train.world

    @property
    def infer_world(self) -> int:
        return self.infer.world

    @property
    def source_ranks(self) -> list[int]:
        return list(range(self.train.world))

    @property
    def destination_ranks(self) -> list[int]:
        first = 0 if self.colocate else self.train.world
        return list(range(first, first + self.infer.world))

    @property
    def world_size(self) -> int:
        """Ranks of the process group that runs the refit."""
        return max(self.source_ranks + self.destination_ranks) + 1

    @property
    def specs(self) -> list[TensorSpec]:
        return model_specs(self.arch)


def model_layouts(model: Arch | str, train: TrainParallel | str, infer: InferParallel | str, *,
                  colocate: bool = False, source_dtype: torch.dtype | None = None) -> ModelLayouts:
    """The training and inference layouts of ``model`` (a preset name or an :class:`Arch`).

    ``source_dtype``: the training side's parameter dtype (fp32 master weights, say; the inference
    side keeps the model's). ``colocate``: inference ranks are ``0..N-1``, sharing GPUs with the
    training ranks ``0..M-1`` (else they are ``M..M+N-1``).

    >>> lay = model_layouts("qwen3-30b-a3b", "ep8,pp2", "tp8,dp2")
    >>> lay.source_ranks[-1], lay.destination_ranks[0], lay.world_size
    (15, 16, 32)
    """
    arch = get_arch(model)
    t0 = time.perf_counter()
    train = TrainParallel.parse(train) if isinstance(train, str) else train
    infer = InferParallel.parse(infer) if isinstance(infer, str) else infer
    first = 0 if colocate else train.world
    source = train.layout(arch, dtype=source_dtype)
    destination = infer.layout(arch, range(first, first + infer.world))
    return ModelLayouts(arch, train, infer, source, destination, colocate, time.perf_counter() - t0)


__all__ = ["InferParallel", "ModelLayouts", "TrainParallel", "model_layouts"]
