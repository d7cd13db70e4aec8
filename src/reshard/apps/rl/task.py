"""The toy task: speak in word pieces. Verifiable, and learnable by a tiny random model in a few dozen steps.

The toy tokenizer (:func:`reshard.apps.toy_models.save_tokenizer`) has single bytes and the word
pieces BPE merged from its corpus (``"Ġquick"``, ``"own"``, ``"hello"``, ...). A completion's reward
is the share of its tokens that are word pieces (tokens of two characters or more)::

    completion tokens          word pieces    reward
    Ġquick  Ġfox  x  Ġdog      3 of 4         0.75
    a  ?  Ġ  q                 0 of 4         0.00

A random policy samples about ``len(word pieces) / vocab`` of them (0.13 with the toy model's 320
logits), so the reward starts low; a policy that puts its mass on word pieces scores 1.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PROMPTS = ("the", "hello", "quick brown", "over the", "lazy dog", "fox jumps", "world", "the lazy", "brown fox",
           "hello world", "jumps over", "dog", "quick", "a", "the quick brown fox", "over")


@dataclass(frozen=True)
class WordPieceTask:
    """Reward = share of generated tokens in :attr:`targets` (the tokenizer's multi-character tokens)."""

    targets: frozenset[int]
    vocab_size: int  # the model's logits (ids past the tokenizer's are never targets)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int) -> WordPieceTask:
        special = set(tokenizer.all_special_ids)
        pieces = {i for tok, i in tokenizer.get_vocab().items()
                  if i not in special and len(tokenizer.convert_tokens_to_string([tok])) >= 2}
        return cls(frozenset(pieces), vocab_size)

    @property
    def random_reward(self) -> float:
        """The expected reward of a uniformly random policy."""
        return len(self.targets) / self.vocab_size

    def reward(self, token_ids) -> float:
        ids = list(token_ids)
        return sum(i in self.targets for i in ids) / len(ids) if ids else 0.0

    @staticmethod
    def prompts(step: int, count: int, seed: int) -> list[str]:
        """``count`` prompts for ``step`` (the same for the same seed and step, in every run)."""
        return random.Random(seed * 100_003 + step).sample(PROMPTS, count)


__all__ = ["PROMPTS", "WordPieceTask"]
