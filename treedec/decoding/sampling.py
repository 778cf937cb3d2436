"""The target's sampling distribution, shared by vanilla decoding and verification.

Lossless speculative sampling means "the same distribution vanilla sampling draws from",
so temperature, top-k and top-p are defined once, here, and both paths call it.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise ValueError(f"top_k must be a whole number (0 = off), got {self.top_k!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token over the last dim (first index among equal maxima).

    ``max(-1).indices`` rather than ``argmax``: the same choice, but about 4x faster for bf16
    logits on CPU, and every greedy path (vanilla, verification) calls this one function.
    """
    return logits.max(-1).indices


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 probabilities [..., V] after temperature, top-k and top-p (greedy: one-hot argmax)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(greedy_pick(logits), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` [..., V] -> LongTensor [...], with no host synchronisation.

    The exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d. picks i with probability
    p_i exactly (the Gumbel-max trick in another form), batched over every leading dimension.
    """
    race = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return (probs.float() / race).argmax(-1)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """The token vanilla decoding emits after ``logits`` [..., V]."""
    if params.greedy:
        return greedy_pick(logits)
    return sample(target_probs(logits, params), generator)
