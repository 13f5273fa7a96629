"""Token trees in one place: their geometry (depth, positions, the ancestor mask from a parent array),
their shape (`TreeSpec`, the `tree=` option) and how a drafter grows one (`TreeGrower`).

Nodes are in topological order (a parent before its children); parent -1 means "child of the root".
The root itself (the pending token) is not part of a draft's node list.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .transfer import to_device


def _host(parents) -> list[int]:
    """A parent array as a Python list: a list as is, a tensor read once (a sync on a device)."""
    return parents if isinstance(parents, list) else parents.tolist()


def is_chain(parents) -> bool:
    """parents: [n] int64 tensor or list."""
    par = _host(parents)
    return all(p == i - 1 for i, p in enumerate(par))


def depth_list(parents) -> list[int]:
    """Depth of each node (children of the root: 1) as a list; parents: [n] int64 tensor or list."""
    d: list[int] = []
    for i, p in enumerate(_host(parents)):
        if p >= i:
            raise ValueError(f"tree nodes must be in topological order: node {i} has parent {p}")
        d.append(1 if p < 0 else d[p] + 1)
    return d


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[n] int64 depth of each node (children of the root have depth 1), on the parents' device."""
    return torch.tensor(depth_list(parents), dtype=torch.long, device=parents.device)


def ancestor_mask_with_root(parents, device=None) -> torch.Tensor:
    """[n+1, n+1] bool over [root, node_0, ..., node_{n-1}]: True where column is ancestor-or-self of row.
    parents: [n] int64 tensor (the mask goes to its device) or list (to `device`)."""
    if device is None:
        device = parents.device
    par = _host(parents)
    n = len(par)
    if is_chain(par):
        return torch.ones(n + 1, n + 1, dtype=torch.bool, device=device).tril_()
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    mask[0, 0] = True
    for i, p in enumerate(par):
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return to_device(mask, torch.bool, device)


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices from the root's child down to `node` (inclusive); [] for the root (-1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def subtree_parents(parents: list[int], keep: list[int]) -> list[int]:
    """Parent array of the sub-tree made of the nodes `keep` (ascending, ancestor-closed), re-indexed."""
    index = {old: new for new, old in enumerate(keep)}
    out = []
    for old in keep:
        p = parents[old]
        if p >= 0 and p not in index:
            raise ValueError(f"node {old} is kept but its parent {p} is not: the kept nodes must be ancestor-closed")
        out.append(-1 if p < 0 else index[p])
    return out


def top_nodes(parents: list[int], scores: list[float], budget: int) -> list[int]:
    """The `budget` best-scoring nodes, ancestor-closed, as ascending indices (a topological order).

    Nodes are taken in descending score (ties: lower index first); a node whose parent was not taken is
    skipped. With path-product scores (a child never outscores its parent) nothing is ever skipped, so
    this is exactly the top-`budget` set.
    """
    taken: set[int] = set()
    for i in sorted(range(len(parents)), key=lambda i: (-scores[i], i)):
        if len(taken) == budget:
            break
        if parents[i] < 0 or parents[i] in taken:
            taken.add(i)
    return sorted(taken)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TreeSpec: {name} must be an int >= 1, got {value!r}")
    return value


def _static_size(branching: tuple) -> int:
    """Validate a static branching list; return its node count (sum of the running products)."""
    if not branching:
        raise ValueError("TreeSpec.static: branching must be a non-empty list of ints >= 1, e.g. [4, 2, 2, 1]")
    total, width = 0, 1
    for b in branching:
        width *= _positive_int("each branching factor", b)
        total += width
    return total


@dataclass(frozen=True)
class TreeSpec:
    """The shape of the token tree drafted each step (`tree=` of specdec.generate / wrap).

    Two kinds; build them with the constructors, which validate:

    TreeSpec.static([4, 2, 2, 1])
        Fixed branching per depth: the root gets 4 children (the draft's top 4 tokens), each of them 2,
        each of those 2, then 1. Node budget = the total, 4 + 8 + 16 + 16 = 44; depth = 4.
    TreeSpec.dynamic(nodes=16, depth=5, topk=4)
        EAGLE-2 (Li et al. 2024). A node's score is the draft probability of its path (the product of
        the draft probabilities along it). At each depth every frontier node proposes its top-`topk`
        children; the `topk` best-scoring of those children form the next frontier. At the end the
        `nodes` best-scoring nodes of everything proposed are kept (ancestor-closed, since a child
        never outscores its parent), in topological order.

    Either way a node's children are the draft's top tokens, a deterministic choice: the verifier uses
    the one-hot rule (q = None), which is lossless for greedy and sampled decoding alike.

    kind: "static" | "dynamic"; nodes: node budget; depth: levels below the root;
    branching: children per node at each depth (static); topk: children per node and frontier width (dynamic).
    """

    kind: str
    nodes: int
    depth: int
    branching: tuple[int, ...] = ()
    topk: int = 0

    def __post_init__(self):
        if self.kind == "static":
            total = _static_size(self.branching)
            if (self.nodes, self.depth) != (total, len(self.branching)):
                raise ValueError(f"TreeSpec.static{list(self.branching)} has {total} nodes and depth "
                                 f"{len(self.branching)}, got nodes={self.nodes}, depth={self.depth}")
        elif self.kind == "dynamic":
            _positive_int("nodes", self.nodes)
            _positive_int("depth", self.depth)
            _positive_int("topk", self.topk)
            most = self.topk + (self.depth - 1) * self.topk * self.topk
            if self.nodes > most:
                raise ValueError(f"TreeSpec.dynamic: nodes={self.nodes} is more than a tree of depth={self.depth} "
                                 f"and topk={self.topk} can propose ({most}); lower nodes or raise depth/topk")
        else:
            raise ValueError(f"TreeSpec kind must be 'static' or 'dynamic', got {self.kind!r}")

    @staticmethod
    def static(branching) -> "TreeSpec":
        """Fixed branching per depth, e.g. [4, 2, 2, 1]; every node of the full tree is drafted."""
        if isinstance(branching, (str, bytes)) or not hasattr(branching, "__iter__"):
            raise ValueError(f"TreeSpec.static: branching must be a list of ints >= 1, e.g. [4, 2, 2, 1]; "
                             f"got {branching!r}")
        branching = tuple(branching)
        return TreeSpec("static", _static_size(branching), len(branching), branching)

    @staticmethod
    def dynamic(nodes: int = 16, depth: int = 5, topk: int = 4) -> "TreeSpec":
        """EAGLE-2 expansion by path probability: at most `nodes` nodes, `depth` levels, `topk` wide."""
        return TreeSpec("dynamic", nodes, depth, (), topk)

    def width(self, level: int) -> int:
        """Children proposed per expanded node at `level` (0 = the root)."""
        return self.branching[level] if self.kind == "static" else self.topk

    @property
    def frontier(self) -> int | None:
        """How many of a depth's nodes are expanded further: all (None, static) or the best topk (dynamic)."""
        return None if self.kind == "static" else self.topk

    @property
    def max_slots(self) -> int:
        """The most tree nodes one step writes to the KV cache: the drafter's expanded nodes or the
        target's verified nodes, whichever is more."""
        if self.kind == "static":
            return self.nodes
        return max(self.nodes, self.topk * (self.depth - 1))

    def limited(self, max_depth: int) -> "TreeSpec":
        """The same spec cut to at most `max_depth` >= 1 levels (a tree of depth d emits at most d + 1 tokens)."""
        if max_depth >= self.depth:
            return self
        max_depth = _positive_int("max_depth", max_depth)
        if self.kind == "static":
            return TreeSpec.static(self.branching[:max_depth])
        most = self.topk + (max_depth - 1) * self.topk * self.topk
        return TreeSpec.dynamic(min(self.nodes, most), max_depth, self.topk)

    def __repr__(self) -> str:
        if self.kind == "static":
            return f"TreeSpec.static({list(self.branching)})"
        return f"TreeSpec.dynamic(nodes={self.nodes}, depth={self.depth}, topk={self.topk})"


class TreeGrower:
    """Grows the tree of a TreeSpec one depth at a time from draft distributions; no model here.

    The caller (a model drafter) runs the frontier, hands its next-token probabilities to `expand`, and
    gets the next frontier back; `result` makes the final selection. Candidate ids are creation order,
    so a parent's id is always below its children's. The frontier leaves out nodes whose children could
    not be kept within the budget, so a small budget costs few forwards (budget 1: none past the root).

        grower = TreeGrower(spec, budget)
        frontier = grower.expand(q_root[None])         # q: [len(frontier), V], the root first
        while frontier and grower.level < spec.depth:
            q = run the frontier nodes ...             # [len(frontier), V]
            frontier = grower.expand(q)
        tokens, parents = grower.result()
    """

    def __init__(self, spec: TreeSpec, budget: int):
        self.spec = spec
        self.budget = min(budget, spec.nodes)
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.depth: list[int] = []
        self.level = 0  # depth of the current frontier (0: the root)
        self._frontier: list[int] = [-1]

    def path(self, node: int) -> list[int]:
        """Ids from the root's child down to `node` (inclusive)."""
        return path_to(self.parents, node)

    def frontier_block(self, frontier: list[int], written: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
        """What the forward over `frontier` needs: mask [f, m + f] bool over the tree block (the m = len(written)
        nodes earlier forwards wrote, in block order, then the frontier itself), row r seeing node r's
        ancestors and itself; and each frontier node's token path from the root. Appends the frontier to
        `written` (its nodes now have KV in the block)."""
        m, f = len(written), len(frontier)
        slot = {a: j for j, a in enumerate(written)}
        mask = torch.zeros(f, m + f, dtype=torch.bool)
        paths = []
        for r, node in enumerate(frontier):
            path = self.path(node)
            mask[r, [slot[a] for a in path[:-1]]] = True
            mask[r, m + r] = True
            paths.append([self.tokens[a] for a in path])
        written.extend(frontier)
        return mask, paths

    def expand(self, q: torch.Tensor) -> list[int]:
        """q: [len(frontier), V] probabilities of the frontier nodes' next token. Adds each frontier
        node's top-`width` children (zero-probability tokens are never proposed) and returns the next
        frontier's ids."""
        if q.shape[0] != len(self._frontier):
            raise ValueError(f"expand needs one row per frontier node ({len(self._frontier)}), got {q.shape[0]}")
        k = min(self.spec.width(self.level), q.shape[-1])
        top_q, top_x = q.float().topk(k, dim=-1)
        top_q, top_x = top_q.tolist(), top_x.tolist()  # one host sync per depth
        new: list[int] = []
        for row, parent in enumerate(self._frontier):
            base = 1.0 if parent < 0 else self.scores[parent]
            for qx, x in zip(top_q[row], top_x[row]):
                if qx <= 0.0:
                    break
                new.append(len(self.tokens))
                self.tokens.append(x)
                self.parents.append(parent)
                self.scores.append(base * qx)
                self.depth.append(self.level + 1)
        keep = self.spec.frontier
        if keep is not None and len(new) > keep:
            best = sorted(new, key=self._rank_key)[:keep]
            new = sorted(best)
        self.level += 1
        self._frontier = self._worth_expanding(new)
        return self._frontier

    def restrict(self, keep: list[int]) -> list[int]:
        """Expand only `keep` (a subset of the current frontier) next: the rest become leaves. A drafter
        uses it for nodes it knows end the text (a draft's EOS). Returns the new frontier."""
        kept = set(keep)
        if not kept <= set(self._frontier):
            raise ValueError(f"restrict keeps only frontier nodes; {sorted(kept - set(self._frontier))} are not")
        self._frontier = [a for a in self._frontier if a in kept]
        return self._frontier

    def _worth_expanding(self, nodes: list[int]) -> list[int]:
        """The nodes whose children can still be among the `budget` kept: rank (by (-score, id), as
        top_nodes orders) at most budget - 2. A child ranks after its parent and after everything ranked
        before it, and ranks only grow as nodes are added, so the rest can never have a kept child:
        expanding them would cost a forward row (and with a small budget a whole forward per depth) for
        nothing. The kept set is the one a full expansion gives."""
        if self.budget < 2 or not nodes:
            return []
        if len(self.scores) < self.budget:
            return nodes  # every node is among the budget best so far: any child may be kept
        cutoff = self._rank_key(sorted(range(len(self.scores)), key=self._rank_key)[self.budget - 2])
        return [a for a in nodes if self._rank_key(a) <= cutoff]

    def _rank_key(self, node: int) -> tuple[float, int]:
        """Best first: higher path probability, then lower id (top_nodes' order)."""
        return -self.scores[node], node

    def result(self) -> tuple[list[int], list[int]]:
        """(tokens, parents) of the kept nodes: the best `budget` by path probability, ancestor-closed, in
        topological order (parent -1 = child of the root)."""
        keep = top_nodes(self.parents, self.scores, self.budget)
        self.kept_scores = [self.scores[i] for i in keep]  # path probabilities of the kept nodes, same order
        return [self.tokens[i] for i in keep], subtree_parents(self.parents, keep)
