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
from ..deepspeed import is_zero3_model, zero3_side


class ReshardSource(WeightSource):
    """A trainer's weights as ``reshard`` sends them: this rank's local shards and where they sit.

    ``ReshardSource(model)`` reads a module (DTensor parameters of FSDP2, FSDP2 over TP or a
    Hugging Face ``tp_plan`` model by their placements; plain tensors as replicas; transformers 5's
    fused experts by checkpoint names); ``ReshardSource(side)`` takes an explicit
    :class:`~reshard.refit.sides.Side` (a Megatron-Core layout, say). ``rank_of`` maps the ranks of
    the module's device meshes to refit ranks (default: the same numbers).

    A DeepSpeed ZeRO-3 model (a ``DeepSpeedEngine`` or its ``module``: parameters with ``ds_tensor``)
    is read by :func:`~reshard.integrations.deepspeed.zero3_side`: each rank sends from its own
    partitions; ``rank_of`` then maps default-group ranks to refit ranks.
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
            if is_zero3_model(self._what):
                self._side = zero3_side(self._what, rank, rank_of=self._rank_of)
            else:
                self._side = Side.from_module(self._what, rank, rank_of=self._rank_of)
        return self._side

    def metadata(self) -> list[ParamMeta]:
        if self._side is not None:
            side = self._side
        elif isinstance(self._what, Side):
            side = self.side(self._what.rank)
        elif is_zero3_model(self._what):  # its own partitions: this process's rank (every rank names every tensor)
            import torch.distributed as dist

            me = dist.get_rank() if dist.is_initialized() else 0
            side = self.side(int(self._rank_of[me]) if self._rank_of is not None else me)
        else:
            side = self.side(0)
        return [ParamMeta(spec.name, spec.dtype, spec.shape) for spec in side.layout.specs.values()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers (local shards), not full tensors: reshard never gathers."""
        if self._side is None:
            raise RuntimeError("the source has no rank yet: trainer_init reads it")
        yield from self._side.read().items()


__all__ = ["ReshardSource"]
