"""Lossless verification of a drafted token tree: multi-step / recursive rejection sampling.

A tree of n draft nodes in topological order; parents[i] < i is node i's parent (-1 = the root). The
target scored the root and every node in one forward: p row 0 is the root's next-token distribution,
row i+1 is node i's. q row i is the distribution node i was drawn FROM, i.e. its parent's draft
distribution (siblings share it).

The walk (SpecInfer's multi-step speculative sampling, Miao et al. 2024; recursive rejection sampling
for siblings drawn without replacement, Jeon et al. 2024 and Sequoia):

    node <- root, P <- p[node]
    for each child x of node, in proposal order, with Q the distribution x was drawn from:
        accept x with probability min(1, P(x) / Q(x))           -> descend: node <- x, P <- p[x]
        else  P <- norm(max(P - Q, 0))                          (unchanged if that mass is 0)
              if siblings were drawn WITHOUT replacement: Q <- norm(Q with x zeroed)
    no child accepted: emit a recovered token ~ P (the residual)
    a leaf reached:    emit a bonus token ~ p[leaf]

Why it is exact. Claim: if the next child is drawn from Q_i (independently of how the previous siblings
were judged, given Q_i), the remaining procedure emits y with probability P_i(y). One step emits y either
by accepting it, min(P_i, Q_i)(y), or by rejecting (probability 1 - beta_i, beta_i = sum min(P_i, Q_i))
and then, by induction, emitting from P_{i+1} = (P_i - Q_i)_+ / (1 - beta_i):
min(P_i, Q_i)(y) + (P_i - Q_i)_+(y) = P_i(y). P_{i+1} does not depend on which x was rejected, so the
induction holds whatever Q_{i+1} is: i.i.d. siblings (Q_{i+1} = Q_i, or each child's own q row when the
children come from different drafters) and siblings drawn without replacement (Q_{i+1} = Q_i minus x_i)
are both exact, provided the verifier is told which one happened. The base case (no child left) samples
P directly. Descending into an accepted child and repeating gives the target's joint distribution.

Deterministic children (q is None; top-k or lookup drafts): each child's proposal is one-hot on its
token, so accept x with probability P(x); on rejection P <- P with x zeroed, renormalised.
"""
from __future__ import annotations

import torch

from .result import VerifyResult
from .sampling import sample


def children_of(parents: list[int]) -> list[list[int]]:
    """kids[0] = the root's children, kids[i+1] = node i's, each in proposal (index) order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"parents must satisfy -1 <= parents[i] < i (topological order); parents[{i}] = {parent}")
        kids[parent + 1].append(i)
    return kids


def check_tree(tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> int:
    """Shape checks shared by the tree verifiers (no host sync); returns n."""
    n = tokens.numel()
    if parents.numel() != n:
        raise ValueError(f"tokens and parents must both be [n]; got {tokens.numel()} and {parents.numel()}")
    if p.dim() != 2 or p.size(0) != n + 1:
        raise ValueError(f"target rows must be [n+1, V] = [{n + 1}, V] for {n} nodes, got {tuple(p.shape)}")
    if q is not None and tuple(q.shape) != (n, p.size(1)):
        raise ValueError(f"q must be [n, V] = [{n}, {p.size(1)}] or None, got {tuple(q.shape)}")
    return n


def _normalize(r: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    mass = r.sum()
    return torch.where(mass > 0, r / mass, fallback)


def _try_children(P, children, toks, q, u, with_replacement):
    """Judge a node's children in order as if each earlier one were rejected (that sequence of P is fixed
    by the tokens, so it can run on the device without a sync).

    Returns accepted [m] bool, a [m] acceptance probabilities, and the residual P after all m rejections.
    """
    accepted, a = [], []
    Q = None
    for c in children:
        x = toks[c]
        P_x = P[x]
        if q is None:  # one-hot proposal: max(P - onehot(x), 0) = P with x zeroed
            accepted.append(u[c] < P_x)
            a.append(P_x)
            zeroed = P.clone()
            zeroed[x] = 0
            P = _normalize(zeroed, P)
            continue
        if Q is None or with_replacement:
            Q = q[c]
        Q_x = Q[x]
        accepted.append(u[c] * Q_x < P_x)  # u < P(x)/Q(x) without dividing (Q(x) = 0 cannot be drawn)
        a.append(torch.where(Q_x > 0, (P_x / Q_x).clamp(max=1), (P_x > 0).float()))
        P = _normalize((P - Q).clamp_min(0), P)
        if not with_replacement:
            removed = Q.clone()
            removed[x] = 0
            Q = _normalize(removed, removed)
    return torch.stack(accepted), torch.stack(a), P


def sample_tree(
    # [n] int64, topological order
    tokens: torch.Tensor,
    # [n] int64, parent index, -1 = child of the root
    parents: torch.Tensor,
    # [n+1, V] target probabilities; row 0 = the root's, row i+1 = node i's
    p: torch.Tensor,
    # [n, V] row i = the distribution node i was drawn from (its parent's draft distribution); None = one-hot
    q: torch.Tensor | None,
    generator: torch.Generator | None,
    with_replacement: bool,
) -> VerifyResult:
    """Verify a token tree by multi-step rejection sampling (see the module docstring for the math).

    with_replacement: True if each sibling was an independent draw from its q row (SpecInfer), False if
        siblings were drawn without replacement from one shared distribution (then only the first
        sibling's q row is read). Telling the verifier the wrong one is NOT lossless. Ignored when q is None.
    Random draws: n uniforms (one coin per node), then V exponentials. Host syncs: one per depth tried.
    beta: [depths tried], probability that some child at that depth is accepted given the drafted children.
    """
    n = check_tree(tokens, parents, p, q)
    p = p.float()
    q = None if q is None else q.float()
    flat = torch.cat([tokens.reshape(n), parents.reshape(n)]).tolist()
    toks, kids = flat[:n], children_of(flat[n:])
    u = torch.rand(n, generator=generator, device=p.device)

    path: list[int] = []
    betas: list[torch.Tensor] = []
    node, P = -1, p[0]
    while kids[node + 1]:
        accepted, a, residual = _try_children(P, kids[node + 1], toks, q, u, with_replacement)
        betas.append(1 - torch.prod(1 - a))
        first = next((i for i, ok in enumerate(accepted.tolist()) if ok), None)
        if first is None:  # every child rejected: recover from the residual
            P = residual
            break
        node = kids[node + 1][first]
        path.append(node)
        P = p[node + 1]
    token = sample(P.unsqueeze(0), generator)
    flat = torch.cat([token.double().reshape(1)] + [b.double().reshape(1) for b in betas]).tolist()
    return VerifyResult(path, int(flat[0]), flat[1:])
