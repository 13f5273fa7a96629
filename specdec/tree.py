"""Token-tree geometry in one place: depth, positions and the ancestor mask from a parent array.

Nodes are in topological order (a parent before its children); parent -1 means "child of the root".
The root itself (the pending token) is not part of a draft's node list.
"""
from __future__ import annotations

import torch


def is_chain(parents: torch.Tensor) -> bool:
    n = parents.numel()
    return n == 0 or bool(torch.equal(parents.cpu(), torch.arange(-1, n - 1)))


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[n] int64 depth of each node; children of the root have depth 1."""
    par = parents.tolist()
    d = [0] * len(par)
    for i, p in enumerate(par):
        if p >= i:
            raise ValueError(f"tree nodes must be in topological order: node {i} has parent {p}")
        d[i] = 1 if p < 0 else d[p] + 1
    return torch.tensor(d, dtype=torch.long, device=parents.device)


def ancestor_mask_with_root(parents: torch.Tensor) -> torch.Tensor:
    """[n+1, n+1] bool over [root, node_0, ..., node_{n-1}]: True where column is ancestor-or-self of row."""
    n = parents.numel()
    if is_chain(parents):
        return torch.ones(n + 1, n + 1, dtype=torch.bool, device=parents.device).tril_()
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    mask[0, 0] = True
    for i, p in enumerate(parents.tolist()):
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return mask.to(parents.device)


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices from the root's child down to `node` (inclusive); [] for the root (-1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
