"""Medusa's typical acceptance: fast, and LOSSY. Used only with acceptance="typical".

Cai et al. 2024 (FasterDecoding/Medusa, `evaluate_posterior`): a drafted token x is accepted when the
target finds it "typical enough" at its parent,

    p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))),     H = entropy of the parent's p,

with no coin and no residual. The emitted text is NOT distributed as the target's samples (it leans
towards high-probability drafts; at temperature -> 0 it reduces to greedy). Here the entropy is exact
(Medusa adds 1e-5 inside the log) and the walk takes, at each depth, the FIRST accepted child in proposal
order (Medusa instead keeps the longest accepted candidate path). The final token is sampled from p at
the last accepted node.
"""
from __future__ import annotations

import torch

from .result import VerifyResult
from .sampling import sample
from .tree import check_tree, children_of


def typical_tree(
    # [n] int64, topological order
    tokens: torch.Tensor,
    # [n] int64, parent index, -1 = child of the root
    parents: torch.Tensor,
    # [n+1, V] target probabilities; row 0 = the root's, row i+1 = node i's
    p: torch.Tensor,
    generator: torch.Generator | None = None,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> VerifyResult:
    """Walk the tree taking the first typical child per depth; sample the last token from p there.

    Two host syncs. beta is None (the rule is not a probability of preserving anything).
    """
    n = check_tree(tokens, parents, p, None)
    p = p.float()
    entropy = -torch.special.xlogy(p, p).sum(-1)  # [n+1]
    cutoff = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)  # [n+1]
    tokens = tokens.reshape(n).to(device=p.device, dtype=torch.long)
    parent_rows = parents.reshape(n).to(device=p.device, dtype=torch.long) + 1
    typical = p[parent_rows, tokens] > cutoff[parent_rows]  # [n]

    flat = torch.cat([parent_rows - 1, typical.long()]).tolist()
    kids, ok = children_of(flat[:n]), flat[n:]
    path: list[int] = []
    node = -1
    while True:
        hit = next((c for c in kids[node + 1] if ok[c]), None)
        if hit is None:
            break
        path.append(hit)
        node = hit
    token = sample(p[node + 1].unsqueeze(0), generator)
    return VerifyResult(path, int(token.item()), None)
