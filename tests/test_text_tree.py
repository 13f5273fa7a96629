"""Text mode's token trees (drafters/text_tree.py): draft paths re-encoded into one target-token trie, and
the grower's restrict(), with which a drafter stops expanding nodes that end the text."""
import pytest
import torch

from specdec.drafters.text_tree import leaf_paths, merged_trie
from specdec.tree import TreeGrower, TreeSpec, depth_list


def test_leaf_paths_are_the_root_to_leaf_token_paths():
    #      root -> 10 -> 11 -> 12 ; root -> 10 -> 13 ; root -> 20
    tokens, parents, scores = [10, 20, 11, 13, 12], [-1, -1, 0, 0, 2], [0.9, 0.1, 0.5, 0.3, 0.4]
    assert leaf_paths(tokens, parents, scores) == [([20], 0.1), ([10, 13], 0.3), ([10, 11, 12], 0.4)]


def test_paths_that_encode_alike_share_nodes_and_each_node_scores_its_best_leaf():
    encodings = {(1, 2): [7, 8], (1, 3): [7, 9, 5], (4,): [6], (5,): []}  # draft path -> target tokens
    paths = [([1, 2], 0.5), ([1, 3], 0.3), ([4], 0.15), ([5], 0.05)]
    tokens, parents, scores = merged_trie(paths, lambda p: encodings[tuple(p)], max_depth=8, budget=10)
    nodes = {tuple(tokens[a] for a in _path(parents, i)): s for i, s in enumerate(scores)}
    # 7 is shared by the two paths starting with draft token 1, with the better one's score; [5] encoded
    # to nothing (a merge across the boundary) and is dropped
    assert nodes == {(7,): 0.5, (7, 8): 0.5, (7, 9): 0.3, (7, 9, 5): 0.3, (6,): 0.15}
    assert all(p < i for i, p in enumerate(parents))  # topological
    assert all(scores[i] <= scores[p] for i, p in enumerate(parents) if p >= 0)  # ancestor-closed by score


def test_the_trie_is_cut_to_the_depth_and_the_budgets_best_nodes():
    paths = [([1], 0.6), ([2], 0.3), ([3], 0.1)]
    encode = {1: [1, 2, 3, 4], 2: [5, 6], 3: [7]}.__getitem__
    tokens, parents, _ = merged_trie(paths, lambda p: encode(p[0]), max_depth=3, budget=10)
    assert max(depth_list(parents)) == 3 and len(tokens) == 3 + 2 + 1
    tokens, parents, scores = merged_trie(paths, lambda p: encode(p[0]), max_depth=3, budget=4)
    assert tokens == [1, 2, 3, 5] and parents == [-1, 0, 1, -1] and scores == [0.6, 0.6, 0.6, 0.3]


def test_restrict_keeps_only_the_named_frontier_nodes():
    grower = TreeGrower(TreeSpec.static([3, 2]), 9)
    frontier = grower.expand(torch.tensor([[0.5, 0.3, 0.2, 0.0]]))
    assert frontier == [0, 1, 2]
    assert grower.restrict([0, 2]) == [0, 2]
    with pytest.raises(ValueError, match="frontier"):
        grower.restrict([1])  # no longer on the frontier
    nxt = grower.expand(torch.tensor([[0.0, 0.0, 0.6, 0.4], [0.0, 0.0, 0.9, 0.1]]))  # one row per kept node
    assert [grower.parents[a] for a in nxt] == [0, 0, 2, 2]


def _path(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]
