"""Small real checkpoints and engine inspection for the vLLM tests, the example and the benchmark.

Checkpoints are made at test time with transformers (random weights, a byte-level BPE tokenizer
trained on a sentence): nothing is downloaded. Heads are 32 wide, a size vLLM's CPU attention
supports. :func:`engine_tensors` runs inside a vLLM worker (``llm.collective_rpc``) and returns every
tensor the model computes with: parameters, buffers, and the weights vLLM's CPU backend packed into
the closures of its linear layers.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

import torch

DENSE = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, vocab_size=320, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, intermediate_size=128)
MOE = dict(DENSE, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
COMMON = dict(max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0,
              tie_word_embeddings=False)
PROMPTS = ["hello world", "the quick brown fox"]


def save_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog " * 20], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(path)


def config(kind: str, **overrides):
    from transformers import AutoConfig

    fields = {**(MOE if kind == "moe" else DENSE), **COMMON, **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def save_checkpoint(path: str, kind: str = "dense", *, seed: int = 0, state: dict | None = None,
                    dtype: torch.dtype = torch.bfloat16, **overrides) -> None:
    """A Hugging Face checkpoint: random weights from ``seed``, or ``state`` (``named_parameters``
    names, transformers 5's fused experts included) cast to ``dtype``; config and tokenizer beside it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(kind, **overrides))
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    model.to(dtype).save_pretrained(path)
    save_tokenizer(path)


@contextmanager
def reap_engine_processes():
    """Kill the vLLM processes (``VLLM::EngineCore``, ``VLLM::Worker...``) a test started and left
    behind: when a test's process is killed while it holds an engine, the engine's processes
    outlive it (they are not told their parent died)."""
    def engine_pids() -> set[int]:
        out = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().startswith(b"VLLM::"):
                        out.add(int(pid))
            except OSError:
                continue
        return out

    before = engine_pids()
    try:
        yield
    finally:
        for pid in engine_pids() - before:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def close_engine(llm) -> None:
    """Stop an offline engine's EngineCore and workers (vLLM 0.32's ``LLM`` has no ``shutdown``; without
    this a spawned process that made one cannot exit: it waits for the engine's processes)."""
    llm.llm_engine.engine_core.shutdown()


def engine_tensors(worker) -> dict[str, torch.Tensor]:
    """Every tensor the worker's model computes with (run in the worker by ``collective_rpc``)."""
    model = worker.model_runner.get_model()
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update((f"buffer:{n}", b.detach().clone()) for n, b in model.named_buffers())
    for mod_name, module in model.named_modules():
        fn = getattr(module, "cpu_linear", None)
        for i, cell in enumerate(getattr(fn, "__closure__", None) or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if isinstance(value, torch.Tensor):
                out[f"packed:{mod_name}:{i}"] = value.detach().clone()
    return out


def refit_stats(worker):
    """The worker's last refit figures (run in the worker by ``collective_rpc``)."""
    engine = worker.weight_transfer_engine
    s = engine.last_stats
    return None if s is None else {"in_place": s.in_place_bytes, "reprocessed": s.reprocessed_bytes,
                                   "recv": s.recv_bytes, "fingerprint": engine.session.plan.fingerprint(),
                                   "plan_id": id(engine.session.plan), "rss_mb": _rss_mb()}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in shape, dtype or any bit."""
    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [n for n in a if a[n].shape != b[n].shape or a[n].dtype != b[n].dtype
            or not torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))]
