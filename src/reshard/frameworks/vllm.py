"""vLLM inference-side layouts: every weight of a model as vLLM's parallel layers hold it.

``vllm_layout(arch, ranks, tp, dp)`` is the destination layout of a refit into ``dp``
vLLM engines of ``tp`` ranks each: ``ranks[d * tp + t]`` is TP rank ``t`` of engine
``d``. Logical tensors keep their Hugging Face names; buffers are vLLM's parameters,
by vLLM's names and per-rank shapes, so a refit writes straight into them.

What TP rank ``t`` of ``tp`` holds (vLLM 0.32; ``tests/test_vllm_loaders.py`` checks
every row against vLLM's own weight loaders)::

    vLLM parameter (buffer)                 rows / columns it holds                 vLLM layer
    model.embed_tokens.weight, lm_head      vocab rows t*P .. (t+1)*P - 1, where    VocabParallelEmbedding,
      [P, H], P = ceil(V / 64) * 64 / tp    tp*P is V padded to a multiple of 64;   ParallelLMHead
                                            padding rows belong to no tensor
    self_attn.qkv_proj                      [q_t ; k_u ; v_u], u = t // max(1,      QKVParallelLinear
                                            tp / kv_heads): when tp > kv_heads,
                                            tp / kv_heads ranks hold the same head
    self_attn.o_proj, mlp.down_proj         columns t of tp                         RowParallelLinear
    mlp.gate_up_proj                        [gate_t ; up_t]                         MergedColumnParallelLinear
    *norm*, mlp.gate (router)               everything (replicated)                 RMSNorm, GateLinear
    mlp.experts.routed_experts.             per local expert: [gate_m ; up_m]       FusedMoE
      w13_weight [E_r, 2*I_m, H]
    mlp.experts.routed_experts.             per local expert: down columns m
      w2_weight  [E_r, H, I_m]
    DeepSeek-V3 / Kimi-K2 (MLA):
    self_attn.fused_qkv_a_proj              [q_a_proj ; kv_a_proj_with_mqa], all    MergedColumnParallelLinear
                                            ranks (no q_lora_rank: q_proj split by  (disable_tp)
                                            rows, kv_a_proj_with_mqa replicated)
    self_attn.q_b_proj, kv_b_proj           rows t of tp                            ColumnParallelLinear
    mlp.shared_experts.gate_up_proj/down    as mlp.gate_up_proj / down_proj; whole  DeepseekV2MLP
                                            on every rank under sequence-parallel MoE
    mlp.gate.e_score_correction_bias        replicated, always float32

The MoE group: vLLM's data parallelism (one deployment, ``data_parallel_size=dp``)
flattens TP across DP for MoE layers, so FusedMoE spans all ``tp * dp`` ranks and
MoE rank ``m = d * tp + t``. Without expert parallelism each expert's intermediate
size is split over the group (``I_m = I / (tp * dp)``, every rank holds every expert);
with it experts are split whole over the group, contiguously, the first
``E % (tp * dp)`` ranks getting one more (vLLM's ``determine_expert_map``, "linear";
``expert_placement="round_robin"`` gives rank ``m`` experts ``m, m + ep, ...``).
``independent_engines=True`` describes ``dp`` separate vLLM instances instead (as
many RL frameworks launch them): the MoE group is then each engine's ``tp`` ranks.
Attention, dense MLPs, embeddings and the head are always split over the engine's TP.

Example: Qwen3-MoE, 8 experts, tp=2, dp=2, ``expert_parallel=True``, ranks 4..7::

    rank  engine  tp rank  EP rank  experts (routed_experts.w13_weight[0], [1])
    4     0       0        0        0, 1
    5     0       1        1        2, 3
    6     1       0        2        4, 5
    7     1       1        3        6, 7

Everything here is pure data: no vLLM import, no process group. Layouts are built
with numpy arrays per tensor (no Python object per piece): DeepSeek-V3 on 128 ranks
(5.8 M pieces) builds in about a second.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import torch

from ..gc_pause import without_gc
from ..layout import Layout, PieceTable, Repeated, read_only
from ..models.arch import Arch, model_specs
from ..placements import check_ranks
from ..tensors import LayoutError, TensorSpec

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
EXPERT_PLACEMENTS = ("linear", "round_robin")
# FusedMoE's parameters under a layer: vLLM 0.32 registers them on the MoE runner's
# ``routed_experts`` child (older releases had them directly under ``mlp.experts``)
EXPERTS_W13 = "mlp.experts.routed_experts.w13_weight"
EXPERTS_W2 = "mlp.experts.routed_experts.w2_weight"
_ROUTED_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_REPLICATED_SUFFIXES = frozenset({
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
    "self_attn.k_norm.weight", "self_attn.q_a_layernorm.weight", "self_attn.kv_a_layernorm.weight",
    "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
})


def pad_vocab(vocab: int, pad_to: int = VOCAB_PADDING) -> int:
    """The vocabulary size vLLM allocates: ``vocab`` rounded up to a multiple of ``pad_to``."""
    return -(-vocab // pad_to) * pad_to


def expert_owners(experts: int, ep_size: int, placement: str = "linear") -> tuple[np.ndarray, np.ndarray]:
    """``(ep_rank, local_index)`` of every expert, as vLLM's ``determine_expert_map`` places them.

    >>> [a.tolist() for a in expert_owners(7, 3)]      # 7 experts, 3 EP ranks: 3, 2, 2
    [[0, 0, 0, 1, 1, 2, 2], [0, 1, 2, 0, 1, 0, 1]]
    """
    e = np.arange(experts, dtype=np.int64)
    if placement == "round_robin":
        return e % ep_size, e // ep_size
    if placement != "linear":
        raise LayoutError(f"unknown expert placement {placement!r}; choose one of {EXPERT_PLACEMENTS}")
    base, rem = divmod(experts, ep_size)
    counts = np.full(ep_size, base, np.int64)
    counts[:rem] += 1
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    owner = np.repeat(np.arange(ep_size, dtype=np.int64), counts)
    return owner, e - starts[owner]


@without_gc
def vllm_layout(arch: Arch, ranks: Sequence[int], tp: int, dp: int = 1, *, expert_parallel: bool = False,
                dtype: torch.dtype | None = None, independent_engines: bool = False,
                expert_placement: str = "linear", sequence_parallel_moe: bool | None = None,
                validate: bool | None = None, deployments: int = 1) -> Layout:
    """The layout of ``arch``'s weights in ``dp`` vLLM engines of ``tp`` ranks (see module doc).

    ``ranks``: the inference side's global ranks, engine by engine (``len == tp * dp * deployments``).
    ``expert_parallel``: vLLM's ``enable_expert_parallel`` (EP size = the MoE group size).
    ``dtype``: vLLM's model dtype (buffers; default the checkpoint's). DeepSeek's
    ``e_score_correction_bias`` stays float32, as vLLM allocates it.
    ``independent_engines``: the ``dp`` engines are separate vLLM instances, so MoE
    layers are split within each engine only (default: one deployment with
    ``data_parallel_size=dp``, MoE split over all ``tp * dp`` ranks).
    ``expert_placement``: the placement vLLM actually uses (``"linear"`` or ``"round_robin"``).
    vLLM honours ``--expert-placement-strategy round_robin`` only for models with several
    expert groups (``n_group > 1``), without EPLB, and, when its all2all kernels are in use
    (EP with ``data_parallel_size > 1``), only with the DeepEP low-latency or NIXL EP
    backends; otherwise it falls back to ``"linear"`` (``determine_expert_placement_strategy``).
    ``sequence_parallel_moe``: vLLM's ``use_sequence_parallel_moe``, under which DeepSeek's
    shared experts are replicated instead of TP-split; default vLLM's rule with its default
    all2all backend: expert parallel, ``tp > 1`` and ``data_parallel_size > 1``.
    ``validate``: run :meth:`Layout.validate` (default: only up to 100 k pieces; the layout
    is correct by construction and tests validate it on small configs).
    ``deployments``: that many copies of the whole arrangement side by side on consecutive ranks, each
    its own vLLM deployment (its MoE layers over its own ``tp * dp`` ranks); built in one pass, the
    same layout as the deployments' layouts merged.

    Logical tensors: ``model_specs(arch)`` except DeepSeek's multi-token-prediction layers
    (``model.layers.{num_hidden_layers + j}.*``), which vLLM's main model skips when it
    loads weights (they belong to its separate MTP draft model). Tied embeddings: vLLM's
    ``lm_head`` is ``model.embed_tokens``, one buffer.

    Raises :class:`LayoutError` for configurations vLLM refuses: ``tp`` not dividing the
    heads, KV heads (or not a multiple of them), intermediate sizes or the padded vocab,
    a wrong number of ranks, ...
    """
    ranks_arr = check_ranks(ranks, "vLLM layout", tp=tp, dp=dp, **({"deployments": deployments} if deployments != 1 else {}))
    if expert_placement not in EXPERT_PLACEMENTS:
        raise LayoutError(f"unknown expert placement {expert_placement!r}; choose one of {EXPERT_PLACEMENTS}")
    vllm_dp = 1 if independent_engines else dp
    if sequence_parallel_moe is None:
        sequence_parallel_moe = expert_parallel and tp > 1 and vllm_dp > 1
    _check(arch, tp, dp, independent_engines, expert_parallel, sequence_parallel_moe)
    b = _Builder(arch, ranks_arr, tp, dp, dtype or arch.dtype, expert_parallel=expert_parallel,
                 independent_engines=independent_engines, expert_placement=expert_placement,
                 shared_replicated=sequence_parallel_moe)
    specs = {}
    for spec in model_specs(arch):
        if b.add(spec):
            specs[spec.name] = spec
    tables = {name: b.tables[name] for name in specs}
    return Layout(specs, tables, b.rank_buffers(), validate=validate)


def _check(a: Arch, tp: int, dp: int, independent: bool, ep: bool, shared_replicated: bool) -> None:
    """One-line LayoutErrors for what vLLM's layers would refuse (its ``divide`` asserts)."""

    def need(n: int, parts: int, label: str, why: str = "") -> None:
        if n % parts:
            raise LayoutError(f"vLLM tp={tp}: {label} ({n}) is not divisible by {parts}{why}")

    need(a.heads, tp, "attention heads")
    if not a.is_mla:
        if tp >= a.kv_heads and tp % a.kv_heads:
            raise LayoutError(f"vLLM tp={tp}: tp is not a multiple of the KV heads ({a.kv_heads}); with tp >= KV "
                              f"heads every KV head must be replicated on the same number of ranks")
        if tp < a.kv_heads:
            need(a.kv_heads, tp, "KV heads")
    elif a.tie_embeddings:
        raise LayoutError("vLLM's DeepSeek-V3 model does not tie word embeddings; tie_embeddings must be False")
    if any(not a.is_moe_layer(i) for i in range(a.layers)):
        need(a.intermediate, tp, "intermediate size")
    need(pad_vocab(a.vocab), tp, f"vocab padded to a multiple of {VOCAB_PADDING}", f" (vocab {a.vocab})")
    if not a.is_moe:
        return
    if a.family == "qwen3_moe" and tp > a.experts:
        raise LayoutError(f"vLLM tp={tp}: tensor parallel size is greater than the number of experts ({a.experts})")
    if not ep:
        group = tp if independent else tp * dp
        need(a.moe_intermediate, group, "MoE intermediate size",
             "" if independent else f" (tp x dp: vLLM splits expert weights over all {group} ranks of its "
                                    f"data-parallel deployment)")
    if a.shared_experts and not shared_replicated:
        need(a.shared_experts * a.moe_intermediate, tp, "shared-expert intermediate size")


class _Builder:
    """Per-tensor piece tables, vectorized over ranks; identical geometries share arrays."""

    def __init__(self, arch: Arch, ranks: np.ndarray, tp: int, dp: int, dtype: torch.dtype, *,
                 expert_parallel: bool, independent_engines: bool, expert_placement: str,
                 shared_replicated: bool) -> None:
        self.a = arch
        self.ranks = ranks
        self.n = len(ranks)
        self.tp = tp
        self.dtype = dtype
        self.t = np.arange(self.n, dtype=np.int64) % tp  # TP rank of each position
        self.tables: dict[str, PieceTable] = {}
        self.common: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # buffers every rank has
        self._cache: dict[tuple, tuple[np.ndarray, ...]] = {}
        self.shared_replicated = shared_replicated
        a = arch
        self.ep = expert_parallel
        if independent_engines:  # MoE groups: each engine's tp ranks
            self.members = np.arange(self.n, dtype=np.int64).reshape(-1, tp)
        else:  # one group of all tp * dp ranks of each deployment (vLLM flattens TP across DP)
            self.members = np.arange(self.n, dtype=np.int64).reshape(-1, tp * dp)
        self.group = self.members.shape[1]
        self.moe_rank = np.empty(self.n, np.int64)
        self.moe_rank[self.members] = np.arange(self.group)[None, :]
        self.expert_buffers: dict[str, str] = {}  # buffer name -> "w13" / "w2", in order of appearance
        self._expert_buffer_names: dict[tuple[int, str], str] = {}  # (layer, gate/up/down) -> buffer name
        if a.is_moe:
            if self.ep:
                self.owner, self.local = expert_owners(a.experts, self.group, expert_placement)
                self.local_experts = np.bincount(self.owner, minlength=self.group)[self.moe_rank]
                self.expert_inter = a.moe_intermediate
            else:
                self.local_experts = np.full(self.n, a.experts, np.int64)
                self.expert_inter = a.moe_intermediate // self.group
        if not a.is_mla:  # QKVParallelLinear rows per rank
            self.rep = max(1, tp // a.kv_heads)
            self.q_rows = a.heads * a.head_dim // tp
            self.kv_rows = max(1, a.kv_heads // tp) * a.head_dim

    # ------------------------------------------------------------------ buffers
    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
        self.common.setdefault(name, (tuple(int(s) for s in shape), dtype or self.dtype))

    def rank_buffers(self) -> dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
        """``{rank: {buffer: (shape, dtype)}}``; ranks with equal buffers share one dict."""
        if not self.expert_buffers:
            return {r: self.common for r in self.ranks.tolist()}
        a, i = self.a, self.expert_inter
        by_count: dict[int, dict] = {}
        out = {}
        for r, c in zip(self.ranks.tolist(), self.local_experts.tolist()):
            d = by_count.get(c)
            if d is None:
                d = dict(self.common)
                for buf, kind in self.expert_buffers.items():
                    d[buf] = ((c, 2 * i, a.hidden) if kind == "w13" else (c, a.hidden, i), self.dtype)
                by_count[c] = d
            out[r] = d
        return out

    # ------------------------------------------------------------------ geometries
    def _put(self, spec: TensorSpec, buffer: str, geom: tuple[np.ndarray, ...]) -> None:
        ranks, offsets, sizes, boffs = geom
        self.tables[spec.name] = PieceTable(ranks, offsets, sizes, Repeated(buffer, len(ranks)), boffs)

    def _replicated(self, shape: tuple[int, ...], row: int = 0) -> tuple[np.ndarray, ...]:
        key = ("rep", shape, row)
        g = self._cache.get(key)
        if g is None:
            nd = len(shape)
            boffs = np.zeros((self.n, nd), np.int64)
            boffs[:, 0] = row
            g = (self.ranks, np.zeros((self.n, nd), np.int64), np.tile(np.array(shape, np.int64), (self.n, 1)), boffs)
            self._cache[key] = g = read_only(g)
        return g

    def _rows(self, shape: tuple[int, ...], parts: int, rep: int = 1, row: int = 0) -> tuple[np.ndarray, ...]:
        """Rows split in ``parts`` (TP rank t holds part t // rep) at buffer row ``row``."""
        key = ("rows", shape, parts, rep, row)
        g = self._cache.get(key)
        if g is None:
            s = shape[0] // parts
            offsets = np.zeros((self.n, 2), np.int64)
            offsets[:, 0] = (self.t // rep) * s
            boffs = np.zeros((self.n, 2), np.int64)
            boffs[:, 0] = row
            g = (self.ranks, offsets, np.tile(np.array([s, shape[1]], np.int64), (self.n, 1)), boffs)
            self._cache[key] = g = read_only(g)
        return g

    def _cols(self, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        """Columns split over TP (RowParallelLinear)."""
        key = ("cols", shape)
        g = self._cache.get(key)
        if g is None:
            s = shape[1] // self.tp
            offsets = np.zeros((self.n, 2), np.int64)
            offsets[:, 1] = self.t * s
            g = (self.ranks, offsets, np.tile(np.array([shape[0], s], np.int64), (self.n, 1)),
                 np.zeros((self.n, 2), np.int64))
            self._cache[key] = g = read_only(g)
        return g

    def _vocab(self, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        key = ("vocab", shape)
        g = self._cache.get(key)
        if g is None:
            v, h = shape
            per = pad_vocab(v) // self.tp
            start = self.t * per
            real = np.clip(v - start, 0, per)
            keep = np.flatnonzero(real > 0)  # ranks holding only padding hold no piece
            k = len(keep)
            offsets = np.zeros((k, 2), np.int64)
            offsets[:, 0] = start[keep]
            sizes = np.stack([real[keep], np.full(k, h, np.int64)], axis=1)
            g = (self.ranks[keep], offsets, sizes, np.zeros((k, 2), np.int64))
            self._cache[key] = g = read_only(g)
        return g

    def _expert(self, e: int, which: str) -> tuple[np.ndarray, ...]:
        """Pieces of expert ``e``'s ``gate``/``up``/``down`` in w13 / w2."""
        a = self.a
        if not self.ep:  # every rank holds every expert; intermediate split over the MoE group
            key = ("xtp", which)
            g = self._cache.get(key)
            if g is None:
                s = a.moe_intermediate // self.group
                m = self.moe_rank
                offsets = np.zeros((self.n, 2), np.int64)
                if which == "down":
                    offsets[:, 1] = m * s
                    sizes = np.array([a.hidden, s], np.int64)
                else:
                    offsets[:, 0] = m * s
                    sizes = np.array([s, a.hidden], np.int64)
                boffs = np.zeros((a.experts, self.n, 3), np.int64)
                boffs[:, :, 0] = np.arange(a.experts)[:, None]
                if which == "up":
                    boffs[:, :, 1] = s
                g = read_only((self.ranks, offsets, np.tile(sizes, (self.n, 1)), boffs))
                self._cache[key] = g = g[:3] + (list(g[3]),)  # one view per expert, reused by every layer
            return g[0], g[1], g[2], g[3][e]
        key = ("xep", which)
        g = self._cache.get(key)
        if g is None:  # expert e lives whole on MoE rank owner[e] of every group
            groups = self.members.shape[0]
            idx = self.members[:, self.owner].T  # [E, groups] positions
            shape = (a.hidden, a.moe_intermediate) if which == "down" else (a.moe_intermediate, a.hidden)
            boffs = np.zeros((a.experts, groups, 3), np.int64)
            boffs[:, :, 0] = self.local[:, None]
            if which == "up":
                boffs[:, :, 1] = a.moe_intermediate
            g = read_only((self.ranks[idx], np.zeros((groups, 2), np.int64),
                         np.tile(np.array(shape, np.int64), (groups, 1)), boffs))
            self._cache[key] = g = (list(g[0]), g[1], g[2], list(g[3]))  # per-expert views, reused by every layer
        return g[0][e], g[1], g[2], g[3][e]

    def _expert_buffer(self, layer: int, which: str) -> str:
        """The FusedMoE buffer of ``layer`` holding ``which`` (gate / up / down) of every local expert,
        noted as w13 or w2 the first time (buffer names made once per layer)."""
        key = (layer, which)
        buf = self._expert_buffer_names.get(key)
        if buf is None:
            w2 = which == "down"
            buf = self._expert_buffer_names[key] = f"model.layers.{layer}." + (EXPERTS_W2 if w2 else EXPERTS_W13)
            self.expert_buffers.setdefault(buf, "w2" if w2 else "w13")
        return buf

    # ------------------------------------------------------------------ tensors
    def add(self, spec: TensorSpec) -> bool:
        """Place one logical tensor; False if vLLM does not keep it."""
        a, name, shape = self.a, spec.name, spec.shape
        routed = _ROUTED_EXPERT.fullmatch(name)  # most of a MoE's tensors: one match, then look-ups
        if routed is not None:
            layer, e, which = int(routed[1]), int(routed[2]), routed[3]
            if layer >= a.layers:  # DeepSeek MTP layer: not part of vLLM's main model
                return False
            buf = self._expert_buffer(layer, which)
            self._put(spec, buf, self._expert(e, which))
            return True
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            self._buffer(name, (pad_vocab(shape[0]) // self.tp, shape[1]))
            self._put(spec, name, self._vocab(shape))
            return True
        if name == "model.norm.weight":
            self._buffer(name, shape)
            self._put(spec, name, self._replicated(shape))
            return True
        if not name.startswith("model.layers."):
            raise LayoutError(f"tensor {name!r}: no vLLM rule places it")
        layer_str, _, suffix = name[len("model.layers."):].partition(".")
        layer = int(layer_str)
        if layer >= a.layers:  # DeepSeek MTP layer: not part of vLLM's main model
            return False
        p = f"model.layers.{layer}."
        if suffix in _REPLICATED_SUFFIXES:
            self._buffer(name, shape, torch.float32 if suffix.endswith("e_score_correction_bias") else None)
            self._put(spec, name, self._replicated(shape))
            return True
        tp = self.tp
        if suffix in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                      "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
                      "mlp.shared_experts.down_proj.weight"):
            mlp = suffix.rpartition(".")[0].rpartition(".")[0]  # "mlp" or "mlp.shared_experts"
            parts = 1 if (mlp == "mlp.shared_experts" and self.shared_replicated) else tp
            if suffix.endswith("down_proj.weight"):
                self._buffer(p + mlp + ".down_proj.weight", (shape[0], shape[1] // parts))
                geom = self._cols(shape) if parts > 1 else self._replicated(shape)
                self._put(spec, p + mlp + ".down_proj.weight", geom)
            else:
                s = shape[0] // parts
                self._buffer(p + mlp + ".gate_up_proj.weight", (2 * s, shape[1]))
                row = 0 if suffix.endswith("gate_proj.weight") else s
                geom = self._rows(shape, parts, row=row) if parts > 1 else self._replicated(shape, row)
                self._put(spec, p + mlp + ".gate_up_proj.weight", geom)
            return True
        if suffix == "self_attn.o_proj.weight":
            self._buffer(name, (shape[0], shape[1] // tp))
            self._put(spec, name, self._cols(shape))
            return True
        if a.is_mla:
            return self._add_mla(spec, p, suffix)
        if suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            buf = p + "self_attn.qkv_proj.weight"
            self._buffer(buf, (self.q_rows + 2 * self.kv_rows, a.hidden))
            if suffix == "self_attn.q_proj.weight":
                geom = self._rows(shape, tp)
            else:
                row = self.q_rows + (self.kv_rows if suffix == "self_attn.v_proj.weight" else 0)
                geom = self._rows(shape, tp // self.rep, self.rep, row)
            self._put(spec, buf, geom)
            return True
        raise LayoutError(f"tensor {name!r}: no vLLM rule places it")

    def _add_mla(self, spec: TensorSpec, p: str, suffix: str) -> bool:
        a, shape, tp = self.a, spec.shape, self.tp
        if suffix in ("self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.q_proj.weight"):
            self._buffer(spec.name, (shape[0] // tp, shape[1]))
            self._put(spec, spec.name, self._rows(shape, tp))
            return True
        if suffix in ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"):
            if a.q_lora_rank:
                buf = p + "self_attn.fused_qkv_a_proj.weight"
                self._buffer(buf, (a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim, a.hidden))
                row = 0 if suffix == "self_attn.q_a_proj.weight" else a.q_lora_rank
            else:
                buf, row = spec.name, 0
                self._buffer(buf, shape)
            self._put(spec, buf, self._replicated(shape, row))
            return True
        raise LayoutError(f"tensor {spec.name!r}: no vLLM rule places it")
