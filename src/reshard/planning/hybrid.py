"""The hybrid refit: which tensors go by reshard, which by packed broadcast, decided in one place.

NeMo RL ships a hybrid of the two methods: the FFN / expert weights (most of an MoE model's bytes,
sharded differently on each side) go by reshard, everything else (attention, norms, routers,
embeddings: small, often replicated) by the packed broadcast. :class:`HybridRule` is that choice,
a predicate on tensor names; :func:`split_layout` cuts a layout in two by it; :class:`HybridPlan`
plans both parts (the ``hybrid`` method of :mod:`reshard.execution.methods`, run by
:class:`~reshard.execution.hybrid.HybridExecutor`). The cost model
(:meth:`reshard.modeling.pipeline.RefitModel.hybrid`) and the executor method use the same rule,
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

import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from ..layout import Layout, RankBuffers
from .baseline import GatherBroadcastPlan, gather_broadcast_bytes
from .hierarchy import HierarchicalPlan, hierarchical_plan
from .plan import Plan, check_pair

HYBRID_PLAN_FORMAT = 1

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
        if isinstance(self.patterns, str) or not isinstance(self.patterns, Iterable):
            raise ValueError(f"HybridRule patterns must be a list of regular expressions, got {self.patterns!r}")
        object.__setattr__(self, "patterns", tuple(self.patterns))
        compiled = []
        for p in self.patterns:
            if not isinstance(p, str):
                raise ValueError(f"HybridRule pattern {p!r} is not a string")
            try:
                compiled.append(re.compile(p))
            except re.error as e:
                raise ValueError(f"HybridRule pattern {p!r} is not a regular expression: {e}") from None
        object.__setattr__(self, "_compiled", tuple(compiled))
        object.__setattr__(self, "_any", _one_search(self.patterns))  # not a field: the same rule, searched faster
        if self.predicate is not None and not callable(self.predicate):
            raise ValueError(f"HybridRule predicate must be callable, got {self.predicate!r}")

    def __call__(self, name: str) -> bool:
        if self.predicate is not None:
            return bool(self.predicate(name))
        if self._any is not None:
            return self._any.search(name) is not None
        return any(p.search(name) for p in self._compiled)

    @property
    def key(self) -> str:
        """What identifies the rule across processes (in plan fingerprints and executor options): its
        patterns, or its predicate's qualified name (a predicate's code cannot be compared).

        >>> HybridRule(patterns=("experts", "mlp")).key
        'patterns:experts|mlp'
        """
        if self.predicate is None:
            return "patterns:" + "|".join(self.patterns)
        p = self.predicate
        return f"predicate:{getattr(p, '__module__', '?')}.{getattr(p, '__qualname__', type(p).__qualname__)}"


def _one_search(patterns: tuple[str, ...]) -> "re.Pattern | None":
    """The patterns as one alternation, which matches a name where any of them does (one search per
    name instead of one per pattern); None where joining could change what one of them matches: a
    reference to a group by number or name, or a flag that only the start of a pattern can set.

    >>> _one_search((r"experts", r"(^|\\.)(gate|up)_proj\\.")).search("model.layers.0.mlp.up_proj.weight") is not None
    True
    >>> _one_search((r"(a)\\1",)) is None, _one_search(()) is None
    (True, True)
    """
    if not patterns or any(re.search(r"\\[1-9]|\(\?P=|\(\?\(|\(\?[aiLmsux]+\)", p) for p in patterns):
        return None
    try:
        return re.compile("|".join(f"(?:{p})" for p in patterns))
    except re.error:
        return None


#: the rule that picks no tensor: the hybrid degenerates to gather-and-broadcast
BROADCAST_ONLY = HybridRule(patterns=())


def as_rule(rule) -> HybridRule | None:
    """``rule`` as a :class:`HybridRule`: a rule, a list of regular expressions, or a predicate on names
    (``None`` stays ``None``: the default rule). Raises ``ValueError`` naming what is wrong.

    >>> as_rule(["experts"]) == HybridRule(patterns=("experts",)), as_rule(None)
    (True, None)
    """
    if rule is None or isinstance(rule, HybridRule):
        return rule
    if isinstance(rule, str):
        raise ValueError(f"hybrid rule {rule!r}: give a list of regular expressions, e.g. [{rule!r}]")
    if callable(rule):
        return HybridRule(predicate=rule)
    if isinstance(rule, Iterable):
        return HybridRule(patterns=tuple(rule))
    raise ValueError(f"hybrid rule {rule!r}: expected a HybridRule, a list of regular expressions or a predicate")


def tensor_subset(layout: Layout, names) -> Layout:
    """The pieces of the tensors ``names`` only, with the buffers that hold them (ranks that hold
    none of them drop out). The tensor-wise twin of :meth:`Layout.subset`, which keeps ranks."""
    wanted = set(names)
    keep = [n for n in layout.specs if n in wanted]
    tables = {n: layout.tables[n] for n in keep}
    by_ranks: dict[int, tuple[np.ndarray, dict[str, None]]] = {}  # id(ranks array) -> (it, its buffers)
    own: dict[int, set[str]] = {}  # buffers of tables whose pieces live in several buffers, by rank
    ranks: dict[int, None] = {}  # ranks in the order the tables name them
    for t in tables.values():  # every table stays alive while this runs: ids are unique
        if not len(t):
            continue
        b = t.one_buffer()
        if b is None:
            for r, buf in zip(t.ranks.tolist(), t.buffers):
                ranks.setdefault(r)
                own.setdefault(r, set()).add(buf)
            continue
        hit = by_ranks.get(id(t.ranks))
        if hit is None:  # tables alike share ranks arrays: each is looked at once
            hit = by_ranks[id(t.ranks)] = (t.ranks, {})
            ranks.update(dict.fromkeys(t.ranks.tolist()))
        hit[1][b] = None
    member: dict[int, list[int]] = {r: [] for r in ranks}
    for k, (held, _) in enumerate(by_ranks.values()):
        for r in np.unique(held).tolist():
            member[r].append(k)
    groups = [set(bufs) for _, bufs in by_ranks.values()]
    sorted_names: dict[tuple[int, ...], list[str]] = {}  # ranks in the same groups hold the same buffers
    picked: dict[tuple, RankBuffers] = {}  # (rank's shared buffers, groups) -> the part kept, shared too
    buffers = {}
    for r in ranks:
        key = tuple(member[r])
        if r in own:
            buffers[r] = _buffer_specs(layout, r, sorted(own[r].union(*(groups[k] for k in key))))
            continue
        hit = picked.get((id(layout.buffer_map(r)), key))
        if hit is None:
            bufs = sorted_names.get(key)
            if bufs is None:
                bufs = sorted_names[key] = sorted(set().union(*(groups[k] for k in key)))
            hit = picked[(id(layout.buffer_map(r)), key)] = _buffer_specs(layout, r, bufs)
        buffers[r] = hit
    return Layout({n: layout.specs[n] for n in keep}, tables, buffers, validate=False)


def _buffer_specs(layout: Layout, rank: int, names: list[str]) -> dict:
    """``{name: (shape, dtype)}`` of ``rank``'s buffers ``names``."""
    held = layout.buffer_map(rank)
    try:
        return RankBuffers(zip(names, map(held.__getitem__, names)))
    except KeyError:  # a buffer the rank lacks: buffer_spec names it
        return RankBuffers({b: held[b] if b in held else layout.buffer_spec(rank, b) for b in names})


def split_layout(layout: Layout, rule: Callable[[str], bool] | None = None) -> tuple[Layout, Layout]:
    """``(reshard part, broadcast part)`` of ``layout``: the tensors ``rule`` selects, and the rest
    (default rule: :class:`HybridRule`). Split the source and the destination with the same rule
    and each pair plans on its own."""
    rule = HybridRule() if rule is None else rule
    by_reshard = [n for n in layout.specs if rule(n)]
    chosen = set(by_reshard)
    return tensor_subset(layout, by_reshard), tensor_subset(layout, [n for n in layout.specs if n not in chosen])


def _holds_any(layout: Layout) -> bool:
    return any(len(t) for t in layout.tables.values())


class HybridPlan:
    """The hybrid refit of ``destination`` from ``source``: the tensors ``rule`` picks (default
    :class:`HybridRule`) by reshard, the others by gather-and-broadcast, one after the other, both
    into the destination's buffers (a :class:`~reshard.planning.plan.PhasedPlan`).

    ``reshard``: the plan of the picked tensors (hierarchical over ``domains`` when given), or None
    when the rule picks none; ``broadcast``: the plan of the others, run by gather-and-broadcast
    from ``root`` (the lowest source rank of that part), or None when the rule picks all. Phases:
    the reshard part's, then ``"gather-broadcast"`` (which reads the source buffers).

    >>> import torch, reshard as rs
    >>> specs = [rs.TensorSpec(n, (4, 4), torch.float32) for n in ("mlp.up_proj.weight", "norm.weight")]
    >>> src = rs.Layout.merge([rs.Layout.from_placements(s, [0, 1], (2,), [rs.Shard(0)]) for s in specs])
    >>> dst = rs.Layout.merge([rs.Layout.from_placements(s, [2, 3], (2,), [rs.Shard(1)]) for s in specs])
    >>> h = HybridPlan(src, dst)
    >>> h.phase_names, h.reshard.tensors, h.broadcast.tensors, h.part_bytes()
    (['transfer', 'gather-broadcast'], ['mlp.up_proj.weight'], ['norm.weight'], {'reshard': 64, 'gather': 32, 'broadcast': 128})
    >>> HybridPlan(src, dst, BROADCAST_ONLY).reshard is None
    True
    """

    def __init__(self, source: Layout, destination: Layout, rule: HybridRule | None = None, *,
                 max_bucket_bytes: int | None = None, domains: Mapping[int, int] | None = None) -> None:
        check_pair(source, destination)  # errors name the tensor before the layouts are cut
        self.rule = HybridRule() if rule is None else as_rule(rule)
        self.source, self.destination = source, destination
        self.max_bucket_bytes = max_bucket_bytes
        self.domains = None if domains is None else dict(domains)
        src_r, src_b = split_layout(source, self.rule)
        dst_r, dst_b = split_layout(destination, self.rule)
        self.reshard: Plan | HierarchicalPlan | None = None
        self.broadcast: Plan | None = None
        if _holds_any(dst_r):
            self.reshard = (hierarchical_plan(src_r, dst_r, domains, max_bucket_bytes=max_bucket_bytes) if domains
                            else Plan(src_r, dst_r, max_bucket_bytes=max_bucket_bytes))
        self.gather_broadcast: GatherBroadcastPlan | None = None  # the broadcast part, as its executor runs it
        if _holds_any(dst_b):  # gather-and-broadcast goes tensor by tensor: no rounds, no cap
            self.broadcast = Plan(src_b, dst_b)
            self.gather_broadcast = GatherBroadcastPlan(self.broadcast)
        self._fingerprint: str | None = None

    @property
    def root(self) -> int | None:
        """The rank that gathers the broadcast part (None without one)."""
        return None if self.gather_broadcast is None else self.gather_broadcast.root

    @property
    def phases(self) -> list[Plan]:
        """The reshard part's phases, then the broadcast part's plan (it reads the source buffers)."""
        return (self.reshard.phases if self.reshard is not None else []) + (
            [self.broadcast] if self.broadcast is not None else [])

    @property
    def phase_names(self) -> list[str]:
        return (self.reshard.phase_names if self.reshard is not None else []) + (
            ["gather-broadcast"] if self.broadcast is not None else [])

    def source_reads(self, rank: int) -> list:
        """The copies of ``rank``'s that read its source buffers: the reshard part's and the gather's."""
        return ((self.reshard.source_reads(rank) if self.reshard is not None else [])
                + (self.gather_broadcast.source_reads(rank) if self.gather_broadcast is not None else []))

    @property
    def reshard_tensors(self) -> list[str]:
        return [n for n, t in self.reshard.destination.tables.items() if len(t)] if self.reshard is not None else []

    @property
    def broadcast_tensors(self) -> list[str]:
        return list(self.broadcast.tensors) if self.broadcast is not None else []

    def part_bytes(self) -> dict[str, int]:
        """Bytes between distinct ranks per part: ``reshard`` (the reshard plan's wire bytes), ``gather``
        (sources to the root) and ``broadcast`` (the root to each destination rank, full tensors)."""
        out = {"reshard": self.reshard.wire_bytes if self.reshard is not None else 0, "gather": 0, "broadcast": 0}
        if self.broadcast is not None:
            out.update(gather_broadcast_bytes(self.broadcast))
        return out

    @property
    def wire_bytes(self) -> int:
        """Bytes sent between ranks by both parts (what the executor's ``sent_bytes`` add up to)."""
        return sum(self.part_bytes().values())

    def fingerprint(self) -> str:
        """Equal on ranks with the same layouts, rule (:attr:`HybridRule.key`) and staging cap."""
        if self._fingerprint is None:
            h = hashlib.sha256(f"hybrid-plan-{HYBRID_PLAN_FORMAT}\0{self.rule.key}\0".encode())
            for part in (self.reshard, self.broadcast):
                h.update((part.fingerprint() if part is not None else "-").encode() + b"\0")
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def summary(self) -> dict:
        return {"rule": self.rule.key, "reshard_tensors": len(self.reshard_tensors),
                "broadcast_tensors": len(self.broadcast_tensors), **{f"{k}_bytes": v for k, v in self.part_bytes().items()},
                "reshard": self.reshard.summary() if self.reshard is not None else None,
                "broadcast": self.broadcast.summary() if self.broadcast is not None else None}

    def __repr__(self) -> str:
        return (f"HybridPlan({len(self.reshard_tensors)} tensors by reshard, {len(self.broadcast_tensors)} by "
                f"gather-broadcast, rule {self.rule.key!r})")


__all__ = ["BROADCAST_ONLY", "FFN_PATTERNS", "HybridPlan", "HybridRule", "as_rule", "split_layout", "tensor_subset"]
