"""Sampling parameters, HF-identical logit warping, and sampling without a host sync.

Speculative sampling is lossless with respect to ONE distribution: the target's after temperature,
top-k and top-p, exactly as `model.generate(do_sample=True, ...)` would sample it. So p (target) and
q (draft) are both made with `warp_logits` then `probs_from_scores`, and `warp_logits` reproduces
transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper bit for bit (same ops,
same order, float32, filtered entries -inf, min_tokens_to_keep = 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen, with HF's meaning for every field.

    do_sample:   False = greedy (argmax); the other fields are then not applied.
    temperature: logits are divided by it (> 0 when do_sample).
    top_k:       keep the k highest-scoring tokens (ties with the k-th are kept); 0 = off.
    top_p:       keep the smallest set of top tokens whose probability reaches top_p; 1.0 = off.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be a bool, got {self.do_sample!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if self.do_sample and not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"temperature must be a finite number > 0 when do_sample=True, got {self.temperature!r} "
                "(for greedy decoding set do_sample=False)"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (
            0.0 < self.top_p <= 1.0
        ):
            raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {self.top_p!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))


def warp_logits(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, exactly as HF's logits warpers do them.

    scores: [n, V] (or [V]) logits, any float dtype; they are cast to float32 first, as HF's
            generate() does with the model's logits.
    returns [n, V] (or [V]) float32; filtered entries are -inf. With do_sample=False the float32 scores
            come back unchanged (the same tensor if it already was float32).
    """
    scores = scores.float()
    if not params.do_sample:
        return scores
    if scores.dim() == 1:
        return warp_logits(scores.unsqueeze(0), params).squeeze(0)
    if scores.dim() != 2:
        raise ValueError(f"scores must be [n, V] or [V], got shape {tuple(scores.shape)}")

    if params.temperature != 1.0:  # TemperatureLogitsWarper
        scores = scores / params.temperature
    if params.top_k > 0:  # TopKLogitsWarper: drop everything strictly below the k-th largest
        top_k = min(params.top_k, scores.size(-1))
        kth = torch.topk(scores, top_k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if params.top_p < 1.0:  # TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_to_remove = cumulative_probs <= (1 - params.top_p)
        sorted_to_remove[..., -1:] = False  # min_tokens_to_keep = 1
        to_remove = sorted_to_remove.scatter(1, sorted_indices, sorted_to_remove)
        scores = scores.masked_fill(to_remove, -float("inf"))
    return scores


def probs_from_scores(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim in float32 ([n, V] -> [n, V]); -inf scores get probability 0."""
    return torch.softmax(scores.float(), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row without a host sync: argmax(probs / E), E ~ Exponential(1) i.i.d.

    P(argmax = v) = probs[v] / sum(probs) (an exponential race), so rows need not be normalised.
    probs: [n, V] non-negative weights, each row with positive mass
    returns [n] int64 on probs' device. Consumes exactly n * V exponential draws from `generator`.
    """
    e = torch.empty(probs.shape, dtype=torch.float32, device=probs.device)
    e.exponential_(1.0, generator=generator)
    e.clamp_(min=torch.finfo(torch.float32).tiny)  # a draw of exactly 0 would make 0/0 = nan
    return torch.argmax(probs.float() / e, dim=-1)
