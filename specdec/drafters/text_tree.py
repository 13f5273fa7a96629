"""Text mode's token trees: a tree grown in the draft's vocabulary, handed to the target as a tree of its
own tokens.

A draft with another tokenizer drafts text (drafters/cross_tokenizer.py). Its chain is the draft's
greedy text; where the draft's first choice is wrong, its second often is (SmolLM2 drafting for
Qwen2.5-Coder: 8 of 28 first-position misses), and in bfloat16 the target verifies 16 tokens at about
the cost of one. So text mode grows the draft's tree as a draft of the target's vocabulary would (EAGLE-2:
expand by path probability, keep the best nodes; drafters/model.py grow_tree, in the draft's vocabulary
and with the draft's own softmax), then re-encodes the text of each leaf's path with the target's
tokenizer (exactly as a chain is re-encoded) and merges the target-token sequences into one trie:
paths that re-encode alike share their nodes. A trie node scores the best path probability of the
leaves through it, so a parent never scores below its child and the best `budget` nodes stay
ancestor-closed. The proposals are one-hot (q None): exact for greedy and sampled decoding alike.

The draft's tree has the target tree's spec and node budget: draft tokens often re-encode to fewer
target tokens, so the trie may keep fewer nodes than the budget; growing twice the budget in the draft's
vocabulary raised tau (a 24/8/3 tree: 4.10 -> 4.52) but not tokens/s (12/6/2: 15.04 against 15.30 tok/s
for the plain budget; bf16 Qwen2.5-Coder, 4 prompts), since each further depth costs a draft forward.
"""
from __future__ import annotations

from typing import Callable

from ..tree import path_to, subtree_parents, top_nodes


def leaf_paths(tokens: list[int], parents: list[int], scores: list[float]) -> list[tuple[list[int], float]]:
    """(token path from the root's child, path score) of each leaf of a tree in topological order."""
    inner = {p for p in parents if p >= 0}
    return [([tokens[a] for a in path_to(parents, leaf)], scores[leaf])
            for leaf in range(len(tokens)) if leaf not in inner]


def merged_trie(paths: list[tuple[list[int], float]], encode: Callable[[list[int]], list[int]], max_depth: int,
                budget: int) -> tuple[list[int], list[int], list[float]]:
    """The target-token trie of draft paths: encode(draft path) -> its target tokens ([] drops the path),
    cut to max_depth; a node scores the best path score through it; the `budget` best nodes kept.
    Returns (tokens, parents, scores), topological, parent -1 = child of the root."""
    tokens: list[int] = []
    parents: list[int] = []
    best: list[float] = []
    child: dict[tuple[int, int], int] = {}
    for path, score in paths:
        node = -1
        for t in encode(path)[:max_depth]:
            nxt = child.get((node, t))
            if nxt is None:
                nxt = child[(node, t)] = len(tokens)
                tokens.append(t)
                parents.append(node)
                best.append(score)
            else:
                best[nxt] = max(best[nxt], score)
            node = nxt
    keep = top_nodes(parents, best, budget)
    return [tokens[i] for i in keep], subtree_parents(parents, keep), [best[i] for i in keep]
