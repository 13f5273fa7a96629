"""Greedy verification: keep the draft while it equals the target's argmax.

The emitted tokens are exactly what the target's own greedy decoding would emit (argmax ties are
broken as torch.argmax breaks them: the lowest token id), so greedy speculation is lossless.
"""
from __future__ import annotations

import torch

from .result import VerifyResult
from .tree import children_of, check_tree


def greedy_chain(
    # [k] int64
    draft_tokens: torch.Tensor,
    # [k+1, V] target scores (logits or probabilities); row i follows x_1..x_i
    target_scores: torch.Tensor,
) -> VerifyResult:
    """Accept while x_{i+1} == argmax row i; emit argmax at the first mismatch, else the bonus argmax row k.

    beta: [k] floats, 1.0 where the draft equals the argmax, else 0.0. One host sync (all of it in one read).
    """
    k = draft_tokens.numel()
    if target_scores.dim() != 2 or target_scores.size(0) != k + 1:
        raise ValueError(
            f"target_scores must be [k+1, V] = [{k + 1}, V] for {k} draft tokens, "
            f"got {tuple(target_scores.shape)}"
        )
    best = target_scores.argmax(dim=-1)  # [k+1]
    flat = torch.cat([best, draft_tokens.reshape(k).to(best.device)]).tolist()  # the one read: argmaxes, draft
    beta = [1.0 if flat[k + 1 + i] == flat[i] else 0.0 for i in range(k)]
    n = beta.index(0.0) if 0.0 in beta else k
    return VerifyResult(list(range(n)), flat[n], beta)


def greedy_tree(
    # [n] int64, topological order
    tokens: torch.Tensor,
    # [n] int64, parent index, -1 = child of the root
    parents: torch.Tensor,
    # [n+1, V] target scores; row 0 = the root's, row i+1 = node i's
    target_scores: torch.Tensor,
) -> VerifyResult:
    """From the root, descend to the first child (in proposal order) whose token is the argmax.

    beta: [depths tried] float32, 1.0 where a child matched. One host sync.
    """
    n = check_tree(tokens, parents, target_scores, None)
    best = target_scores.argmax(dim=-1)
    flat = torch.cat([tokens.reshape(n).to(best.device), parents.reshape(n).to(best.device), best]).tolist()
    toks, kids = flat[:n], children_of(flat[n : 2 * n])
    best = flat[2 * n :]

    path: list[int] = []
    hits: list[float] = []
    node = -1
    while kids[node + 1]:
        want = best[node + 1]
        hit = next((c for c in kids[node + 1] if toks[c] == want), None)
        hits.append(0.0 if hit is None else 1.0)
        if hit is None:
            break
        path.append(hit)
        node = hit
    return VerifyResult(path, best[node + 1], hits)
