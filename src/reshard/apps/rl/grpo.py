"""GRPO in a few lines: group-relative advantages, token log-probs, a clipped policy-gradient loss.

One step: for each prompt, ``G`` completions are sampled; each completion's advantage is its
reward minus its group's mean, divided by the group's standard deviation (a group whose
completions all scored alike teaches nothing: advantage 0). The loss is the PPO-clip surrogate
averaged over every completion token of the batch, with no KL term::

    ratio_t = exp(logp_t - old_logp_t)
    loss    = -mean_t min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)

With one optimizer step per batch (``old_logp`` = the trainer's log-probs before the step) the
ratio is 1 and the gradient is the plain policy gradient ``-A * grad logp_t``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    """One completion as the trainer needs it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    sampler_logprobs: list[float] | None = None  # the engine's log-prob of each sampled token


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` within each row (one row per prompt, one column per completion).

    >>> group_advantages(torch.tensor([[0.0, 1.0], [0.5, 0.5]]))
    tensor([[-0.7071,  0.7071],
            [ 0.0000,  0.0000]])
    """
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=True) if rewards.shape[1] > 1 else torch.zeros_like(mean)
    return (rewards - mean) / (std + eps)


def batch_tensors(samples: list[Sample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``completion_mask`` (1 where a label is a completion token) and
    per-sample ``advantage``; labels are ``input_ids`` shifted by one."""
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width - 1))
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, len(s.prompt_ids) - 1: len(seq) - 1] = 1.0  # position t predicts token t + 1
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return {"input_ids": ids, "completion_mask": mask, "advantage": adv}


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``log p(input_ids[:, t + 1] | input_ids[:, :t + 1])`` for every position: ``[batch, len - 1]``."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantage: torch.Tensor, mask: torch.Tensor,
                num_tokens: int, clip_eps: float = 0.2) -> torch.Tensor:
    """The clipped surrogate summed over this rank's completion tokens, divided by ``num_tokens`` (every
    rank's completion tokens: the loss of a data-parallel batch, averaged over tokens)."""
    ratio = torch.exp(logp - old_logp)
    adv = advantage[:, None]
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    return -(surrogate * mask).sum() / num_tokens


__all__ = ["Sample", "batch_tensors", "group_advantages", "policy_loss", "token_logprobs"]
