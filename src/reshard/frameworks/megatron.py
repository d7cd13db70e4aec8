"""Megatron-Core training layouts: which rank holds which box of which Hugging Face tensor, where.

:func:`megatron_layout` turns a Megatron-Core parallel configuration (TP, PP, EP, expert-TP,
DP, CP) into a :class:`~reshard.Layout` whose logical tensors are exactly
``reshard.models.model_specs(arch)`` (Hugging Face names) and whose buffers are Megatron-Core's
own parameters, named as ``model.named_parameters()`` names them on each pipeline stage.

Rank order (megatron-core ``parallel_state.initialize_model_parallel``, default
``order="tp-cp-ep-dp-pp"``, through ``RankGenerator``; leftmost varies fastest). Two grids
share the global ranks: the dense grid (``tp, cp, dp, pp``; its generator has ``ep=1``) and the
expert grid (``etp, ep, expert-dp, pp``; its generator has ``cp=1``), with
``expert-dp = world / (etp * ep * pp)``. Eight ranks, tp=2, dp=2, pp=2, ep=2, etp=1::

    index in ranks   0  1  2  3  4  5  6  7
    dense   tp       0  1  0  1  0  1  0  1
            dp       0  0  1  1  0  0  1  1
            pp       0  0  0  0  1  1  1  1
    expert  etp      0  0  0  0  0  0  0  0
            ep       0  1  0  1  0  1  0  1
            edp      0  0  1  1  0  0  1  1

``ranks[i]`` is the global rank of Megatron rank ``i`` (pass ``range(world)`` when the
training job's ranks are the refit group's first ranks).

Local forms (each TP / expert-TP split is even; Megatron refuses uneven ones)::

    buffer (per stage, local layer index)       holds                             split over
    embedding.word_embeddings.weight            embed_tokens rows, vocab padded   tp rows
    output_layer.weight                         lm_head rows, vocab padded        tp rows
    self_attention.linear_qkv.weight            per query group g:                tp, whole groups
                                                [q heads of g; k of g; v of g]
    self_attention.linear_proj.weight           o_proj                            tp columns
    mlp.linear_fc1.weight                       [gate_r; up_r]                    tp rows
    mlp.linear_fc2.weight                       down_proj                         tp columns
    mlp.router.weight, mlp.router.expert_bias   gate, e_score_correction_bias     replicated
    mlp.experts ... fc1 / fc2 (local expert j)  expert ep_rank * E/ep + j         etp like fc1/fc2
    mlp.shared_experts.linear_fc1 / fc2         shared experts                    tp like fc1/fc2
    MLA linear_q_up_proj, linear_kv_up_proj,    q_b_proj, kv_b_proj, q_proj       tp rows
        linear_q_proj
    MLA linear_q_down_proj, linear_kv_down_proj q_a_proj, kv_a_proj_with_mqa      replicated (TE
                                                                                  'duplicated');
                                                                                  tp rows (local)
    MTP eh_proj                                 eh_proj                           tp rows
    norms (layer_norm_weight, *_layernorm)      norms                             replicated

The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * tp`` (Megatron-LM's
``_vocab_size_with_padding``); padding rows belong to no logical tensor. Layers are split across
pipeline stages evenly (or by ``pp_layers``) and numbered from 0 on each stage; the embedding
lives on the first stage, the final norm and ``output_layer`` on the last. With tied embeddings
and ``pp > 1`` the last stage's ``output_layer.weight`` is a second copy of ``embed_tokens``
(Megatron keeps the two in sync). DP and CP ranks hold identical copies (replicas the planner
chooses among); so do expert-DP ranks for experts.

Norm names follow ``transformer_impl``: ``"transformer_engine"`` (the default, what GPU training
uses: the input norm is fused into ``linear_qkv`` as ``layer_norm_weight``, the pre-MLP norm of
dense layers into ``linear_fc1``; MoE layers keep ``pre_mlp_layernorm``) or ``"local"``
(Megatron-Core's own modules: ``input_layernorm`` / ``pre_mlp_layernorm`` / ``q_layernorm`` ...,
and MLA's down projections split over TP). Expert weights are named as ``TEGroupedMLP`` names them
(``moe_grouped_gemm=True``, the default: ``mlp.experts.linear_fc1.weight{j}``) or as
``SequentialMLP`` does (``mlp.experts.local_experts.{j}.linear_fc1.weight``); the local shapes
are the same.

DeepSeek-V3's MTP layers live on the last stage (``mtp.layers.{k}.enorm`` / ``hnorm`` /
``eh_proj`` / ``transformer_layer.*`` / ``final_layernorm``). Megatron shares the MTP's
embedding and output head with the main model's, while Hugging Face checkpoints store them again
(``model.layers.{n}.embed_tokens`` and ``shared_head.head``); those two are laid out in *alias*
buffers, ``embedding.word_embeddings.weight#mtp{k}`` and ``output_layer.weight#mtp{k}``: bind
them to the same tensors as the names before ``#`` (:func:`with_aliases` does it).

Not covered: virtual (interleaved) pipeline stages, ``pipeline_model_parallel_layout`` strings
that give the embedding or the loss a stage of their own, the legacy ``GroupedMLP``
(``transformer_impl="local"`` with ``moe_grouped_gemm``), biases (``add_bias_linear``).

Everything here is pure data; pieces are built as numpy arrays, vectorized over ranks, so a
DeepSeek-V3 layout over 128 ranks builds in under a second. The names, local shapes, rank order,
checkpoint metadata and forward results are checked against megatron-core 0.16 in
``tests/test_megatron_layouts.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from ..gc_pause import without_gc
from ..layout import Layout, PieceTable, Repeated, read_only
from ..models.arch import Arch, model_specs
from ..placements import check_ranks, check_sizes
from ..tensors import LayoutError

ALIAS = "#"
TRANSFORMER_IMPLS = ("transformer_engine", "local")

# ---------------------------------------------------------------------------------------------
# rank grids


@dataclass(frozen=True)
class MegatronGrid:
    """Megatron coordinates of each index ``i`` into the training side's rank list.

    ``dense[i] = (tp, cp, dp, pp)`` and ``expert[i] = (etp, ep, edp, pp)`` (int arrays [world, 4]).
    """

    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    @property
    def dense(self) -> np.ndarray:
        i = np.arange(self.world)
        return np.stack([i % self.tp, (i // self.tp) % self.cp, (i // (self.tp * self.cp)) % self.dp,
                         i // (self.tp * self.cp * self.dp)], axis=1)

    @property
    def expert(self) -> np.ndarray:
        i = np.arange(self.world)
        return np.stack([i % self.etp, (i // self.etp) % self.ep, (i // (self.etp * self.ep)) % self.edp,
                         i // (self.etp * self.ep * self.edp)], axis=1)


def megatron_grid(world: int, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, cp: int = 1,
                  dp: int | None = None) -> MegatronGrid:
    """The dense and expert grids of ``world`` ranks (``dp`` defaults to what ``world`` leaves).

    >>> g = megatron_grid(8, tp=2, pp=2, ep=2, etp=1)    # the table of the module doc
    >>> g.dp, g.edp, g.dense[:, 2].tolist(), g.expert[:, 1].tolist()   # dense dp, expert ep
    (2, 2, [0, 0, 1, 1, 0, 0, 1, 1], [0, 1, 0, 1, 0, 1, 0, 1])
    """
    etp = tp if etp is None else etp
    check_sizes("megatron", tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, **({} if dp is None else {"dp": dp}))
    model = tp * cp * pp
    if dp is None:
        if world % model:
            raise LayoutError(f"megatron: {world} ranks do not divide by tp*cp*pp = {model}")
        dp = world // model
    if dp < 1 or world != model * dp:
        raise LayoutError(f"megatron: {world} ranks given, but tp*cp*dp*pp = {tp}*{cp}*{dp}*{pp} = {model * dp}")
    if world % (etp * ep * pp):
        raise LayoutError(f"megatron: world size {world} does not divide by etp*ep*pp = {etp}*{ep}*{pp} "
                          f"(expert grid etp, ep, expert-dp, pp)")
    return MegatronGrid(tp, cp, dp, pp, ep, etp)


def vocab_size_with_padding(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: round up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def suggest_pp_layers(layers: int, pp: int) -> list[int]:
    """An uneven split Megatron can express (``--decoder-first-pipeline-num-layers`` and
    ``--decoder-last-pipeline-num-layers``; middle stages even), with the smallest biggest stage:

    * the first stage takes the remainder: 61 layers, pp=4 -> [16, 15, 15, 15];
    * or middle stages take ``ceil(layers / pp)`` and the first and last share the rest, when
      that is better balanced: 61 layers, pp=16 -> [2, 4, ..., 4, 3] rather than [16, 3, ..., 3].
    """
    q = layers // pp
    first_takes_rest = [layers - q * (pp - 1)] + [q] * (pp - 1)
    if pp < 3:
        return first_takes_rest
    m = -(-layers // pp)
    rest = layers - m * (pp - 2)
    if rest < 0:
        return first_takes_rest
    ends = [rest // 2, rest - rest // 2]
    balanced = [ends[0]] + [m] * (pp - 2) + [ends[1]]
    return balanced if max(balanced) < max(first_takes_rest) else first_takes_rest


def pipeline_split(layers: int, pp: int, pp_layers: Sequence[int] | None = None) -> list[int]:
    """Decoder layers per pipeline stage: even by default, or ``pp_layers`` (checked)."""
    if pp_layers is None:
        if layers % pp:
            raise LayoutError(f"megatron: {layers} layers do not split evenly over pp={pp}; pass pp_layers "
                              f"(decoder layers per stage), e.g. pp_layers={suggest_pp_layers(layers, pp)}")
        return [layers // pp] * pp
    counts = [int(n) for n in pp_layers]
    if len(counts) != pp:
        raise LayoutError(f"megatron: pp_layers has {len(counts)} entries for pp={pp}")
    if any(n < 0 for n in counts):
        raise LayoutError(f"megatron: pp_layers {counts} has a negative entry")
    if sum(counts) != layers:
        raise LayoutError(f"megatron: pp_layers {counts} sum to {sum(counts)}, the model has {layers} layers")
    return counts


# ---------------------------------------------------------------------------------------------
# piece templates: one tensor's pieces for every TP (or expert-TP) coordinate, computed once


@dataclass(frozen=True, eq=False)
class _Kind:
    coord: np.ndarray  # int64 [k]: the TP coordinate holding piece row i
    offsets: np.ndarray  # int64 [k, ndim]
    sizes: np.ndarray  # int64 [k, ndim]
    boffs: np.ndarray  # int64 [k, ndim]
    shape: tuple[int, ...]  # the local buffer's shape (the same on every coordinate)


def _kind(rows: list[tuple[int, tuple, tuple, tuple]], shape: tuple[int, ...]) -> _Kind:
    rows = [r for r in rows if all(s > 0 for s in r[2])]
    nd = len(shape)
    arr = lambda i: np.array([r[i] for r in rows], np.int64).reshape(len(rows), nd)  # noqa: E731
    return _Kind(np.array([r[0] for r in rows], np.int64), arr(1), arr(2), arr(3), tuple(shape))


def _replicated(shape: tuple[int, ...], n: int) -> _Kind:
    z = (0,) * len(shape)
    return _kind([(t, z, tuple(shape), z) for t in range(n)], shape)


def _rows(r: int, c: int, n: int) -> _Kind:
    """Column-parallel: rows split contiguously over ``n``."""
    k = r // n
    return _kind([(t, (t * k, 0), (k, c), (0, 0)) for t in range(n)], (k, c))


def _cols(r: int, c: int, n: int) -> _Kind:
    """Row-parallel: columns split contiguously over ``n``."""
    k = c // n
    return _kind([(t, (0, t * k), (r, k), (0, 0)) for t in range(n)], (r, k))


def _vocab(v: int, h: int, n: int, divisible_by: int) -> _Kind:
    per = vocab_size_with_padding(v, n, divisible_by) // n
    return _kind([(t, (t * per, 0), (max(0, min(per, v - t * per)), h), (0, 0)) for t in range(n)], (per, h))


def _fused(which: int, parts: int, r: int, c: int, n: int) -> _Kind:
    """Part ``which`` of ``parts`` tensors of ``r`` rows stacked per rank as [a_t; b_t; ...]."""
    k = r // n
    return _kind([(t, (t * k, 0), (k, c), (which * k, 0)) for t in range(n)], (parts * k, c))


def _qkv(which: str, heads: int, groups: int, hd: int, h: int, n: int) -> _Kind:
    """Megatron's ``linear_qkv``: per query group [q heads; k; v] x head_dim, groups split over ``n``."""
    qpg = heads // groups
    per_group = (qpg + 2) * hd
    local = groups // n
    rows = []
    for t in range(n):
        for lg in range(local):
            g = t * local + lg
            if which == "q":
                rows.append((t, (g * qpg * hd, 0), (qpg * hd, h), (lg * per_group, 0)))
            else:
                extra = qpg * hd + (0 if which == "k" else hd)
                rows.append((t, (g * hd, 0), (hd, h), (lg * per_group + extra, 0)))
    return _kind(rows, (local * per_group, h))


# ---------------------------------------------------------------------------------------------
# the model walk: (hf tensor, stage, buffer name, kind, grid)

_DENSE, _EXPERT = "dense", "expert"


class _Entry(NamedTuple):  # one per tensor of a model (~200 k): a tuple, made fast
    hf: str
    stage: int
    buffer: str
    kind: tuple  # key into the kind cache
    grid: str = _DENSE
    ep_rank: int = 0
    fp32: bool = False


class _Walker:
    def __init__(self, a: Arch, g: MegatronGrid, stage_layers: list[int], te: bool, grouped: bool,
                 divisible_by: int) -> None:
        self.a, self.g, self.te, self.grouped, self.div = a, g, te, grouped, divisible_by
        self.stage_of: list[tuple[int, int]] = []
        for s, n in enumerate(stage_layers):
            self.stage_of += [(s, i) for i in range(n)]

    # kind keys: (name, *args), built by _make_kind
    def rep(self, *shape) -> tuple:
        return ("rep", shape)

    def layer(self, i: int, stage: int, prefix: str) -> Iterator[_Entry]:
        a, te, tp = self.a, self.te, self.g.tp
        h = a.hidden
        p = f"model.layers.{i}."
        sa = "self_attention."

        def E(name, buf, kind, **kw) -> _Entry:  # noqa: N802
            return _Entry(p + name, stage, prefix + buf, kind, **kw)

        dense_mlp = not a.is_moe_layer(i)
        if a.is_mla:
            qk = a.qk_nope_head_dim + a.qk_rope_head_dim
            yield E("input_layernorm.weight", "input_layernorm.weight", self.rep(h))
            # TE: duplicated (replicated) down projections; local: ColumnParallelLinear over TP
            down = (lambda r: self.rep(r, h)) if te else (lambda r: ("rows", r, h, tp))  # noqa: E731
            if a.q_lora_rank:
                yield E("self_attn.q_a_proj.weight", sa + "linear_q_down_proj.weight", down(a.q_lora_rank))
                yield E("self_attn.q_a_layernorm.weight",
                        sa + ("linear_q_up_proj.layer_norm_weight" if te else "q_layernorm.weight"),
                        self.rep(a.q_lora_rank))
                yield E("self_attn.q_b_proj.weight", sa + "linear_q_up_proj.weight",
                        ("rows", a.heads * qk, a.q_lora_rank, tp))
            else:
                yield E("self_attn.q_proj.weight", sa + "linear_q_proj.weight", ("rows", a.heads * qk, h, tp))
            yield E("self_attn.kv_a_proj_with_mqa.weight", sa + "linear_kv_down_proj.weight",
                    down(a.kv_lora_rank + a.qk_rope_head_dim))
            yield E("self_attn.kv_a_layernorm.weight",
                    sa + ("linear_kv_up_proj.layer_norm_weight" if te else "kv_layernorm.weight"),
                    self.rep(a.kv_lora_rank))
            yield E("self_attn.kv_b_proj.weight", sa + "linear_kv_up_proj.weight",
                    ("rows", a.heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank, tp))
            yield E("self_attn.o_proj.weight", sa + "linear_proj.weight", ("cols", h, a.heads * a.v_head_dim, tp))
        else:
            yield E("input_layernorm.weight",
                    sa + "linear_qkv.layer_norm_weight" if te else "input_layernorm.weight", self.rep(h))
            for w in "qkv":
                yield E(f"self_attn.{w}_proj.weight", sa + "linear_qkv.weight",
                        ("qkv", w, a.heads, a.kv_heads, a.head_dim, h, tp))
            yield E("self_attn.o_proj.weight", sa + "linear_proj.weight", ("cols", h, a.heads * a.head_dim, tp))
            if a.family in ("qwen3", "qwen3_moe"):
                yield E("self_attn.q_norm.weight", sa + "q_layernorm.weight", self.rep(a.head_dim))
                yield E("self_attn.k_norm.weight", sa + "k_layernorm.weight", self.rep(a.head_dim))
        yield E("post_attention_layernorm.weight",
                "mlp.linear_fc1.layer_norm_weight" if te and dense_mlp else "pre_mlp_layernorm.weight", self.rep(h))
        if dense_mlp:
            yield from self.mlp(p + "mlp.", prefix + "mlp.", stage, a.intermediate, tp, _DENSE, 0, ("", ""))
            return
        yield E("mlp.gate.weight", "mlp.router.weight", self.rep(a.experts, h))
        if a.is_mla:
            yield E("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias", self.rep(a.experts), fp32=True)
        per = a.experts // self.g.ep
        for e in range(a.experts):
            j = e % per
            names = ((f"experts.linear_fc1.weight{j}", f"experts.linear_fc2.weight{j}") if self.grouped else
                     (f"experts.local_experts.{j}.linear_fc1.weight", f"experts.local_experts.{j}.linear_fc2.weight"))
            yield from self.mlp(f"{p}mlp.experts.{e}.", prefix + "mlp.", stage, a.moe_intermediate, self.g.etp,
                                _EXPERT, e // per, names)
        if a.shared_experts:
            yield from self.mlp(p + "mlp.shared_experts.", prefix + "mlp.shared_experts.", stage,
                                a.shared_experts * a.moe_intermediate, tp, _DENSE, 0, ("", ""))

    def mlp(self, hf: str, buf: str, stage: int, inter: int, n: int, grid: str, ep_rank: int,
            names: tuple[str, str]) -> Iterator[_Entry]:
        h = self.a.hidden
        fc1 = names[0] or "linear_fc1.weight"
        fc2 = names[1] or "linear_fc2.weight"
        yield _Entry(hf + "gate_proj.weight", stage, buf + fc1, ("fused", 0, 2, inter, h, n), grid, ep_rank)
        yield _Entry(hf + "up_proj.weight", stage, buf + fc1, ("fused", 1, 2, inter, h, n), grid, ep_rank)
        yield _Entry(hf + "down_proj.weight", stage, buf + fc2, ("cols", h, inter, n), grid, ep_rank)

    def entries(self) -> Iterator[_Entry]:
        a, g = self.a, self.g
        last = g.pp - 1
        vocab = ("vocab", a.vocab, a.hidden, g.tp, self.div)
        yield _Entry("model.embed_tokens.weight", 0, "embedding.word_embeddings.weight", vocab)
        for i, (s, li) in enumerate(self.stage_of):
            yield from self.layer(i, s, f"decoder.layers.{li}.")
        yield _Entry("model.norm.weight", last, "decoder.final_layernorm.weight", self.rep(a.hidden))
        if not a.tie_embeddings:
            yield _Entry("lm_head.weight", last, "output_layer.weight", vocab)
        elif g.pp > 1:  # the last stage's copy of the tied embedding
            yield _Entry("model.embed_tokens.weight", last, "output_layer.weight", vocab)
        for k in range(a.mtp_layers):
            i = a.layers + k
            p, q = f"model.layers.{i}.", f"mtp.layers.{k}."
            yield _Entry(p + "enorm.weight", last, q + "enorm.weight", self.rep(a.hidden))
            yield _Entry(p + "hnorm.weight", last, q + "hnorm.weight", self.rep(a.hidden))
            yield _Entry(p + "eh_proj.weight", last, q + "eh_proj.weight", ("rows", a.hidden, 2 * a.hidden, g.tp))
            yield _Entry(p + "embed_tokens.weight", last, f"embedding.word_embeddings.weight{ALIAS}mtp{k}", vocab)
            yield _Entry(p + "shared_head.norm.weight", last, q + "final_layernorm.weight", self.rep(a.hidden))
            yield _Entry(p + "shared_head.head.weight", last, f"output_layer.weight{ALIAS}mtp{k}", vocab)
            yield from self.layer(i, last, q + "transformer_layer.")


def _make_kind(key: tuple, g: MegatronGrid, grid: str) -> _Kind:
    n = g.tp if grid == _DENSE else g.etp
    name = key[0]
    if name == "rep":
        return _replicated(key[1], n)
    if name == "rows":
        return _rows(*key[1:])
    if name == "cols":
        return _cols(*key[1:])
    if name == "fused":
        return _fused(*key[1:])
    if name == "qkv":
        return _qkv(*key[1:])
    if name == "vocab":
        return _vocab(*key[1:])
    raise AssertionError(key)


# ---------------------------------------------------------------------------------------------
# checks


def _check(a: Arch, g: MegatronGrid, te: bool) -> None:
    tp, etp, ep = g.tp, g.etp, g.ep
    msgs = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            msgs.append(msg)

    need(a.heads % tp == 0, f"tp={tp} does not divide the {a.heads} attention heads")
    if not a.is_mla:
        need(a.heads % a.kv_heads == 0, f"{a.kv_heads} kv heads do not divide the {a.heads} attention heads")
        need(a.kv_heads % tp == 0, f"tp={tp} does not divide the {a.kv_heads} kv heads (query groups)")
    elif not te:
        if a.q_lora_rank:
            need(a.q_lora_rank % tp == 0, f"tp={tp} does not divide q_lora_rank {a.q_lora_rank} (local MLA)")
        kvd = a.kv_lora_rank + a.qk_rope_head_dim
        need(kvd % tp == 0, f"tp={tp} does not divide kv_lora_rank + qk_rope_head_dim = {kvd} (local MLA)")
    layers = range(a.layers + a.mtp_layers)
    if any(not a.is_moe_layer(i) for i in layers):
        need(a.intermediate % tp == 0, f"tp={tp} does not divide the intermediate size {a.intermediate}")
    if a.is_moe:
        need(a.experts % ep == 0, f"ep={ep} does not divide the {a.experts} experts")
        need(a.moe_intermediate % etp == 0, f"etp={etp} does not divide the expert intermediate size "
                                            f"{a.moe_intermediate}")
        if a.shared_experts:
            s = a.shared_experts * a.moe_intermediate
            need(s % tp == 0, f"tp={tp} does not divide the shared-expert intermediate size {s}")
    else:
        need(ep == 1, f"ep={ep} but the model has no experts")
    if a.mtp_layers:
        need(a.hidden % tp == 0, f"tp={tp} does not divide the hidden size {a.hidden} (MTP eh_proj)")
    if msgs:
        raise LayoutError("megatron: " + "; ".join(msgs))


# ---------------------------------------------------------------------------------------------
# the layout


@without_gc
def megatron_layout(
    arch: Arch,
    ranks: Sequence[int],
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    dp: int | None = None,
    cp: int = 1,
    pp_layers: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    transformer_impl: str = "transformer_engine",
    moe_grouped_gemm: bool = True,
    make_vocab_size_divisible_by: int = 128,
    validate: bool | None = None,
) -> Layout:
    """The Megatron-Core layout of ``arch`` over ``ranks`` (in Megatron's global rank order).

    ``len(ranks)`` must be ``tp * cp * dp * pp`` (``dp``, the dense data-parallel size, defaults
    to what the ranks leave); ``etp`` (expert tensor parallel) defaults to ``tp``, and expert-DP is
    ``len(ranks) / (etp * ep * pp)``: DeepSeek-V3 on 128 ranks with tp=1, ep=16, pp=4 has dp=32
    and expert-DP 2. ``pp_layers`` gives the decoder
    layers of each stage (default: even). ``dtype`` overrides the buffers' dtype (fp32 master
    weights, say); the router's ``expert_bias`` stays float32 as Megatron keeps it.
    ``validate=None`` validates layouts up to :data:`VALIDATE_MAX_PIECES` pieces (the layout is
    correct by construction; tests validate it on small configurations).
    See the module docstring for rank order, names and local forms. Impossible configurations
    raise :class:`LayoutError` with a one-line message.
    """
    ranks = [int(r) for r in ranks]
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise LayoutError(f"megatron: transformer_impl must be one of {TRANSFORMER_IMPLS}, got {transformer_impl!r}")
    te = transformer_impl == "transformer_engine"
    if not te and moe_grouped_gemm and arch.is_moe:
        raise LayoutError("megatron: transformer_impl='local' with moe_grouped_gemm uses the legacy GroupedMLP, "
                          "which is not supported; pass moe_grouped_gemm=False (SequentialMLP)")
    g = megatron_grid(len(ranks), tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, dp=dp)
    check_ranks(ranks, "megatron", tp=g.tp, cp=g.cp, dp=g.dp, pp=g.pp)
    stage_layers = pipeline_split(arch.layers, pp, pp_layers)
    _check(arch, g, te)

    specs = {s.name: s for s in model_specs(arch)}
    rank_arr = np.array(ranks, np.int64)
    # [pp, replicas, tp] and [pp, ep, replicas, etp] of global ranks
    dense_grid = rank_arr.reshape(g.pp, g.dp * g.cp, g.tp)
    expert_grid = rank_arr.reshape(g.pp, g.edp, g.ep, g.etp).transpose(0, 2, 1, 3)

    kinds: dict[tuple, _Kind] = {}
    # (grid, kind, stage, ep rank) -> (piece arrays, where the buffer goes, its shape); a buffer is named
    # once per rank set: dense per (stage, tp coord), experts per (stage, ep, etp coord)
    placed: dict[tuple, tuple] = {}
    parts: dict[str, list[tuple]] = {}
    dense_bufs: dict[tuple[int, int], dict] = {(s, t): {} for s in range(g.pp) for t in range(g.tp)}
    expert_bufs: dict[tuple[int, int, int], dict] = {}
    walker = _Walker(arch, g, stage_layers, te, moe_grouped_gemm, make_vocab_size_divisible_by)
    for hf, stage, buffer, kind_key, grid, ep_rank, fp32 in walker.entries():
        pkey = (grid, kind_key, stage, ep_rank)
        hit = placed.get(pkey)
        if hit is None:
            kind = kinds.get((grid, kind_key))
            if kind is None:
                kind = kinds[(grid, kind_key)] = _make_kind(kind_key, g, grid)
            reps = dense_grid[stage] if grid == _DENSE else expert_grid[stage, ep_rank]  # [replicas, n]
            nrep = reps.shape[0]
            arrays = read_only((np.ascontiguousarray(reps[:, kind.coord].reshape(-1)),
                                np.tile(kind.offsets, (nrep, 1)), np.tile(kind.sizes, (nrep, 1)),
                                np.tile(kind.boffs, (nrep, 1))))
            into = ([dense_bufs[(stage, t)] for t in range(g.tp)] if grid == _DENSE else
                    [expert_bufs.setdefault((stage, ep_rank, t), {}) for t in range(g.etp)])
            hit = placed[pkey] = (arrays, into, kind.shape)
        arrays, into, shape = hit
        found = parts.get(hf)
        if found is None:
            parts[hf] = [(arrays, buffer)]
        else:
            found.append((arrays, buffer))
        desc = (shape, torch.float32 if fp32 else (dtype or specs[hf].dtype))
        for d in into:
            d[buffer] = desc

    tables: dict[str, PieceTable] = {}
    for name, lst in parts.items():
        if len(lst) == 1:
            (r, o, s, b), buf = lst[0]
            tables[name] = PieceTable(r, o, s, Repeated(buf, len(r)), b)
        else:
            tables[name] = PieceTable(np.concatenate([x[0][0] for x in lst]), np.concatenate([x[0][1] for x in lst]),
                                      np.concatenate([x[0][2] for x in lst]),
                                      sum(((buf,) * len(x[0]) for x, buf in lst), ()),
                                      np.concatenate([x[0][3] for x in lst]))
    missing = set(specs) - set(tables)
    if missing:  # pragma: no cover - the walk covers model_specs
        raise AssertionError(f"megatron layout misses {sorted(missing)[:3]}")

    dense_c, expert_c = g.dense, g.expert
    buffers: dict[int, dict] = {}
    for i, r in enumerate(ranks):
        t, _, _, s = dense_c[i]
        et, e, _, _ = expert_c[i]
        d = dict(dense_bufs[(int(s), int(t))])
        d.update(expert_bufs.get((int(s), int(e), int(et)), {}))
        buffers[r] = d
    return Layout(specs, tables, buffers, validate=validate)


def with_aliases(layout: Layout, rank: int, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` (a rank's Megatron parameters by name) plus the alias buffers the layout names
    (``"output_layer.weight#mtp0"`` -> ``params["output_layer.weight"]``)."""
    out = dict(params)
    for name in layout.buffers(rank):
        if ALIAS in name and name not in out:
            base = name.split(ALIAS, 1)[0]
            if base not in params:
                raise LayoutError(f"rank {rank}: alias buffer {name!r} needs parameter {base!r}, which was not given")
            out[name] = params[base]
    return out


__all__ = ["ALIAS", "MegatronGrid", "megatron_grid", "megatron_layout", "pipeline_split", "suggest_pp_layers",
           "vocab_size_with_padding", "with_aliases"]
