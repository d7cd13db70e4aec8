"""Small random Hugging Face checkpoints for the examples, benchmarks and tests: nothing downloaded.

:func:`save_checkpoint` writes a Qwen3 (``"dense"``) or Qwen3-MoE (``"moe"``) checkpoint made with
transformers (random weights from a seed, or a given state), its config, and a byte-level BPE
tokenizer trained on one sentence. Heads are 32 wide, a size vLLM's CPU attention supports;
``overrides`` change any config field (``hidden_size=1024, num_hidden_layers=8``, ...).
"""

from __future__ import annotations

import torch

DENSE = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, vocab_size=320, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, intermediate_size=128)
MOE = dict(DENSE, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
COMMON = dict(max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0,
              tie_word_embeddings=False)
TOKENIZER_TEXT = "hello world the quick brown fox jumps over the lazy dog " * 20


def save_tokenizer(path: str, vocab: int = 300) -> None:
    """A byte-level BPE tokenizer (``vocab`` tokens at most), saved as ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TOKENIZER_TEXT], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(path)


def config(kind: str = "dense", **overrides):
    """The transformers config of a toy model (``kind``: ``"dense"`` or ``"moe"``)."""
    from transformers import AutoConfig

    fields = {**(MOE if kind == "moe" else DENSE), **COMMON, **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def save_checkpoint(path: str, kind: str = "dense", *, seed: int = 0, state: dict | None = None,
                    dtype: torch.dtype = torch.bfloat16, **overrides) -> None:
    """A checkpoint at ``path``: random weights from ``seed``, or ``state`` (``named_parameters`` names,
    transformers 5's fused experts included), cast to ``dtype``; config and tokenizer beside it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(kind, **overrides))
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if "rotary" not in m]:
            raise ValueError(f"state does not fit the model: missing {missing}, unexpected {unexpected}")
    model.to(dtype).save_pretrained(path)
    save_tokenizer(path)


__all__ = ["config", "save_checkpoint", "save_tokenizer"]
