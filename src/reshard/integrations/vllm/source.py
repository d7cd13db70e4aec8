"""A trainer rank's weights as the ``reshard`` backend sends them: :class:`ReshardSource`.

vLLM's trainer engines take a ``WeightSource``; other backends iterate full tensors, this one
reads each rank's local shards and where they sit (a :class:`~reshard.refit.sides.Side`), so that
every trainer rank sends its own part and no rank gathers.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from ...refit.sides import Side


class ReshardSource(WeightSource):
    """A trainer's weights as ``reshard`` sends them: this rank's local shards and where they sit.

    ``ReshardSource(model)`` reads a module (DTensor parameters of FSDP2, FSDP2 over TP or a
    Hugging Face ``tp_plan`` model by their placements; plain tensors as replicas; transformers 5's
    fused experts by checkpoint names); ``ReshardSource(side)`` takes an explicit
    :class:`~reshard.refit.sides.Side` (a Megatron-Core layout, say). ``rank_of`` maps the ranks of
    the module's device meshes to refit ranks (default: the same numbers).
    """

    def __init__(self, module_or_side: torch.nn.Module | Side, *, rank_of: Mapping[int, int] | None = None) -> None:
        self._what = module_or_side
        self._rank_of = rank_of
        self._side: Side | None = module_or_side if isinstance(module_or_side, Side) else None

    def side(self, rank: int) -> Side:
        """This rank's source side (read from the module once; its tensors are the live shards)."""
        if self._side is None or self._side.rank != rank:
            if isinstance(self._what, Side):
                raise ValueError(f"the source side was built for rank {self._what.rank}, not {rank}")
            self._side = Side.from_module(self._what, rank, rank_of=self._rank_of)
        return self._side

    def metadata(self) -> list[ParamMeta]:
        side = self._side if self._side is not None else self.side(0 if not isinstance(self._what, Side)
                                                                    else self._what.rank)
        return [ParamMeta(spec.name, spec.dtype, spec.shape) for spec in side.layout.specs.values()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers (local shards), not full tensors: reshard never gathers."""
        if self._side is None:
            raise RuntimeError("the source has no rank yet: trainer_init reads it")
        yield from self._side.read().items()


__all__ = ["ReshardSource"]
