"""Lossless verification of a drafted chain by speculative (modified rejection) sampling.

Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2. With p_i the target's distribution
after the prefix and x_1..x_i, and q_i the distribution the drafter drew x_{i+1} from:

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i))
    at the first rejection emit a recovered token  ~ norm(max(p_i - q_i, 0))   (p_i if that mass is 0)
    if all k are accepted emit a bonus token       ~ p_k

Per position P(emit y) = min(p, q)(y) + (1 - beta) * (p - q)_+(y) / (1 - beta) = p(y), where
beta = sum_v min(p(v), q(v)) is the exact acceptance probability. So the emitted tokens follow the
target's distribution exactly, whatever q is.

A deterministic drafter (argmax, n-gram lookup) proposes x with probability 1: its q is one-hot on x.
Then the rule reads: accept with probability p(x); on rejection sample p with x zeroed. Putting the
drafter's softmax in the ratio instead is NOT lossless.
"""
from __future__ import annotations

import torch

from .result import VerifyResult
from .sampling import sample


def sample_chain(
    # [k] int64, the drafted tokens x_1..x_k
    draft_tokens: torch.Tensor,
    # [k+1, V] target probabilities; row i = p(. | prefix, x_1..x_i), row k gives the bonus
    p: torch.Tensor,
    # [k, V] draft probabilities; row i = the distribution x_{i+1} was drawn from; None = one-hot
    q: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Verify a chain by rejection sampling; returns the accepted prefix and the recovered/bonus token.

    Random draws: k uniforms, then V exponentials (always the same count, so seeding is reproducible).
    One host sync, at the end. beta: [k], sum_v min(p_i, q_i) (one-hot q: p_i(x_i)).
    """
    k = draft_tokens.numel()
    if p.dim() != 2 or p.size(0) != k + 1:
        raise ValueError(f"p must be [k+1, V] = [{k + 1}, V] for {k} draft tokens, got {tuple(p.shape)}")
    V = p.size(1)
    if q is not None and tuple(q.shape) != (k, V):
        raise ValueError(f"q must be [k, V] = [{k}, {V}] or None, got {tuple(q.shape)}")
    p = p.float()
    if k == 0:
        token = sample(p, generator)
        return VerifyResult([], int(token.item()), [])

    x = draft_tokens.reshape(k, 1).to(device=p.device, dtype=torch.long)
    p_x = p[:k].gather(1, x).squeeze(1)  # [k]
    if q is None:
        q_x = torch.ones_like(p_x)
        beta = p_x
    else:
        q = q.float()
        q_x = q.gather(1, x).squeeze(1)  # [k]
        beta = torch.minimum(p[:k], q).sum(-1).clamp_(0.0, 1.0)  # q = p can sum to 1 + 1 ulp

    # accept iff u < p(x)/q(x), written without the division: q(x) = 0 (x could not have been drawn)
    # then accepts iff p(x) > 0, and p(x) >= q(x) always accepts since u < 1
    u = torch.rand(k, generator=generator, device=p.device)
    accepted = u * q_x < p_x
    n = accepted.long().cumprod(0).sum().reshape(1)  # [1], number of accepted drafts

    # the last token's distribution: residual at row n, or p_k (q treated as 0 there) when n == k
    p_n = p.index_select(0, n)  # [1, V]
    row = n.clamp(max=k - 1)
    still_drafting = (n < k).float().unsqueeze(1)  # [1, 1]
    if q is None:
        q_n = torch.zeros_like(p_n).scatter_(1, x.index_select(0, row), still_drafting)
    else:
        q_n = q.index_select(0, row) * still_drafting
    residual = (p_n - q_n).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
    token = sample(residual, generator)  # sample() normalises implicitly

    flat = torch.cat([n.double(), token.double(), beta.double()]).tolist()  # the step's one read
    return VerifyResult(list(range(int(flat[0]))), int(flat[1]), flat[2:])
