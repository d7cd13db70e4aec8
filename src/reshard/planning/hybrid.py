"""The hybrid refit: which tensors go by reshard, which by packed broadcast, decided in one place.

NeMo RL ships a hybrid of the two methods: the FFN / expert weights (most of an MoE model's bytes,
sharded differently on each side) go by reshard, everything else (attention, norms, routers,
embeddings: small, often replicated) by the packed broadcast. :class:`HybridRule` is that choice,
a predicate on tensor names; :func:`split_layout` cuts a layout in two by it. The cost model
(:meth:`reshard.modeling.pipeline.RefitModel.hybrid`) and an executor method use the same rule,
so changing the rule here changes both.

Default rule (a name matching any pattern goes by reshard)::

    model.layers.3.mlp.experts.7.up_proj.weight      reshard    (expert)
    model.layers.0.mlp.down_proj.weight              reshard    (dense FFN)
    model.layers.3.mlp.shared_experts.gate_proj.w... reshard    (shared expert)
    model.layers.3.mlp.gate.weight                   broadcast  (router)
    model.layers.3.self_attn.q_proj.weight           broadcast  (attention)
    model.embed_tokens.weight, lm_head.weight        broadcast

>>> import torch, reshard as rs
>>> rule = HybridRule()
>>> rule("model.layers.3.mlp.experts.7.up_proj.weight"), rule("model.layers.3.mlp.gate.weight")
(True, False)
>>> specs = [rs.TensorSpec(n, (4, 4), torch.float32) for n in ("mlp.up_proj.weight", "self_attn.q_proj.weight")]
>>> lay = rs.Layout.merge([rs.Layout.from_placements(s, [0, 1], (2,), [rs.Shard(0)]) for s in specs])
>>> by_reshard, by_broadcast = split_layout(lay, rule)
>>> list(by_reshard.specs), list(by_broadcast.specs), by_broadcast.ranks
(['mlp.up_proj.weight'], ['self_attn.q_proj.weight'], [0, 1])

Pure: no process group, no device.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..layout import Layout

#: Hugging Face / vLLM / Megatron names of FFN and expert weights (regular expressions, searched)
FFN_PATTERNS: tuple[str, ...] = (
    r"experts",  # routed and shared experts, any framework (vLLM's fused w13/w2 included)
    r"(^|\.)(gate|up|down|gate_up)_proj\.",  # HF / vLLM dense and expert projections
    r"(^|\.)linear_fc[12]\.",  # Megatron's MLP
)


@dataclass(frozen=True)
class HybridRule:
    """Which tensors the hybrid refit moves by reshard: a name matching any of ``patterns``
    (regular expressions, ``re.search``) or, if given, for which ``predicate(name)`` is true.
    All others go by the packed broadcast.

    >>> HybridRule(patterns=(r"\\.self_attn\\.",))("model.layers.0.self_attn.o_proj.weight")
    True
    >>> HybridRule(predicate=lambda n: n.startswith("lm_head"))("lm_head.weight")
    True
    """

    patterns: tuple[str, ...] = FFN_PATTERNS
    predicate: Callable[[str], bool] | None = None
    _compiled: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", tuple(re.compile(p) for p in self.patterns))

    def __call__(self, name: str) -> bool:
        if self.predicate is not None:
            return bool(self.predicate(name))
        return any(p.search(name) for p in self._compiled)


def tensor_subset(layout: Layout, names) -> Layout:
    """The pieces of the tensors ``names`` only, with the buffers that hold them (ranks that hold
    none of them drop out). The tensor-wise twin of :meth:`Layout.subset`, which keeps ranks."""
    wanted = set(names)
    keep = [n for n in layout.specs if n in wanted]
    tables = {n: layout.tables[n] for n in keep}
    used: dict[int, set[str]] = {}
    for t in tables.values():
        if not len(t):
            continue
        b = t.one_buffer()
        for r, buf in zip(t.ranks.tolist(), (b,) * len(t) if b is not None else t.buffers):
            used.setdefault(r, set()).add(buf)
    buffers = {r: {b: layout.buffer_spec(r, b) for b in sorted(bufs)} for r, bufs in used.items()}
    return Layout({n: layout.specs[n] for n in keep}, tables, buffers, validate=False)


def split_layout(layout: Layout, rule: Callable[[str], bool] | None = None) -> tuple[Layout, Layout]:
    """``(reshard part, broadcast part)`` of ``layout``: the tensors ``rule`` selects, and the rest
    (default rule: :class:`HybridRule`). Split the source and the destination with the same rule
    and each pair plans on its own."""
    rule = HybridRule() if rule is None else rule
    by_reshard = [n for n in layout.specs if rule(n)]
    chosen = set(by_reshard)
    return tensor_subset(layout, by_reshard), tensor_subset(layout, [n for n in layout.specs if n not in chosen])


__all__ = ["FFN_PATTERNS", "HybridRule", "split_layout", "tensor_subset"]
