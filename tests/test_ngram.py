"""Prompt lookup: worked examples, incremental index == naive full rescan, tree shape, incremental cost."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specdec.drafters.base import Draft, DraftContext, Drafter
from specdec.drafters.ngram import NgramIndex, PromptLookup

A, B, C, D, P, Q, X, Y, Z = range(9)  # letters of the docstring examples


def index_of(tokens, **kw) -> NgramIndex:
    idx = NgramIndex(**kw)
    idx.extend(tokens)
    return idx


# --- naive reference: rescans the whole context on every call -------------------------------------

def ref_matches(toks, min_n, max_n):
    """Earlier ends (most recent first) of the longest suffix n-gram that occurred before."""
    T = len(toks)
    for n in range(max_n, min_n - 1, -1):
        if n > T - 1:
            continue
        suffix = toks[T - n:]
        ends = [e for e in range(T - 1, n - 1, -1) if toks[e - n:e] == suffix]
        if ends:
            return ends
    return []


def ref_lookup(toks, k, min_n=1, max_n=3):
    ends = ref_matches(toks, min_n, max_n)
    return toks[ends[0]:ends[0] + k] if ends and k > 0 else []


def ref_lookup_tree(toks, k, max_branches, min_n=1, max_n=3, max_matches=4):
    ends = ref_matches(toks, min_n, max_n)[:max_matches]
    branches, firsts = [], []
    for e in ends:
        if toks[e] not in firsts and len(branches) < max_branches:
            firsts.append(toks[e])
            branches.append(toks[e:e + k])
    # level by level: node (branch b, depth d) is taken in order of (d, b) while budget lasts
    order = sorted((d, b) for b, br in enumerate(branches) for d in range(len(br)))[:max(k, 0)]
    lengths = [sum(1 for d, bb in order if bb == b) for b in range(len(branches))]
    tokens, parents = [], []
    for br, m in zip(branches, lengths):
        for i in range(m):
            parents.append(-1 if i == 0 else len(tokens) - 1)
            tokens.append(br[i])
    return tokens, parents


# --- worked examples (the module docstring's) ----------------------------------------------------

def test_no_match():
    assert index_of([X, Y, Z]).lookup(4) == []
    assert index_of([]).lookup(4) == []
    assert index_of([X]).lookup(4) == []
    assert index_of([X, Y, Z]).lookup_tree(4, 3) == ([], [])


def test_match_in_middle():
    assert index_of([A, B, C, D, A, B]).lookup(4) == [C, D, A, B]


def test_overlapping_matches_run_into_suffix():
    # "a a a a": n=3 matches at end 3; only one token follows before the context ends
    assert index_of([A, A, A, A]).lookup(4) == [A]
    # with a longer run the most recent earlier occurrence still only has one token after it
    assert index_of([A] * 10).lookup(4) == [A]
    # min_n=max_n=1 on "a a": the earlier "a" is followed by the suffix "a" itself
    assert index_of([A, A], min_n=1, max_n=1).lookup(3) == [A]


def test_match_at_very_end():
    assert index_of([P, Q, P]).lookup(9) == [Q, P]


def test_most_recent_wins():
    assert index_of([A, B, C, A, B, D, A, B]).lookup(2) == [D, A]


def test_longest_n_wins():
    # "b c" (n=2) ended at 2 -> x; the more recent "c" (n=1) ended at 4 -> y
    assert index_of([B, C, X, C, Y, B, C]).lookup(1) == [X]
    assert index_of([B, C, X, C, Y, B, C], max_n=1).lookup(1) == [Y]
    # below min_n nothing counts
    assert index_of([B, C, X, C, Y, Z, C], min_n=2).lookup(1) == []


def test_k_truncates_and_zero():
    idx = index_of([A, B, C, D, A, B])
    assert idx.lookup(1) == [C]
    assert idx.lookup(0) == []
    assert idx.lookup_tree(0, 4) == ([], [])


def test_tree_worked_example():
    assert index_of([A, B, C, A, B, D, A, B]).lookup_tree(5, 2) == ([D, A, B, C, A], [-1, 0, 1, -1, 3])


def test_tree_dedupes_by_first_token():
    # "a" followed by b, c, b, c: two distinct continuations although four matches
    toks, parents = index_of([A, B, A, C, A, B, A, C, A], max_n=1).lookup_tree(8, 4)
    roots = [t for t, p in zip(toks, parents) if p == -1]
    assert sorted(roots) == [B, C] and roots[0] == C  # the most recent continuation comes first


def test_bad_arguments():
    for kw in (dict(min_n=0), dict(min_n=3, max_n=2), dict(max_matches=0)):
        with pytest.raises(ValueError):
            NgramIndex(**kw)
        with pytest.raises(ValueError):
            PromptLookup(**kw)


# --- incremental == from scratch (property) ------------------------------------------------------

@st.composite
def chunked_tokens(draw):
    alphabet = draw(st.integers(1, 4))
    toks = draw(st.lists(st.integers(0, alphabet - 1), max_size=60))
    cuts = sorted(draw(st.lists(st.integers(0, len(toks)), max_size=8)))
    bounds = [0, *cuts, len(toks)]
    return toks, [toks[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=150, deadline=None)
@given(chunked_tokens(), st.integers(1, 3), st.integers(0, 2), st.integers(1, 3),
       st.integers(0, 8), st.integers(1, 4))
def test_incremental_equals_rescan(data, min_n, extra_n, max_matches, k, max_branches):
    toks, chunks = data
    max_n = min_n + extra_n
    idx = NgramIndex(min_n, max_n, max_matches)
    seen = []
    for chunk in chunks:
        idx.extend(chunk)
        seen += chunk
        assert idx.lookup(k) == ref_lookup(seen, k, min_n, max_n)
        assert idx.lookup_tree(k, max_branches) == ref_lookup_tree(seen, k, max_branches, min_n, max_n, max_matches)
    assert idx.tokens == toks


@settings(max_examples=100, deadline=None)
@given(chunked_tokens(), st.integers(0, 8), st.integers(1, 4))
def test_tree_shape(data, k, max_branches):
    toks, _ = data
    idx = index_of(toks)
    tree, parents = idx.lookup_tree(k, max_branches)
    assert len(tree) == len(parents) <= k
    roots = [t for t, p in zip(tree, parents) if p == -1]
    assert len(roots) == len(set(roots)) <= max_branches  # branches are distinct
    assert all(-1 <= p < i for i, p in enumerate(parents))  # topological order
    chain = idx.lookup(k)
    assert (tree == []) == (chain == [])
    if tree:  # the first branch is a prefix of the chain draft
        first = tree[:next((i for i, p in enumerate(parents[1:], 1) if p == -1), len(tree))]
        assert chain[:len(first)] == first


# --- cost: extend touches only the new tokens ----------------------------------------------------

def test_extend_is_incremental():
    g = torch.Generator().manual_seed(0)
    idx = NgramIndex(1, 3)
    idx.extend(torch.randint(0, 50, (50_000,), generator=g).tolist())
    assert idx.ops == 3 * 50_000 - 3  # one insertion per n per token (the first two lack 3-/2-grams)
    before = idx.ops
    for t in range(100):
        idx.extend([t % 50])
        idx.lookup(8)
        assert idx.ops - before == 3 * (t + 1)  # exactly 3 n-grams per new token, nothing rescanned
    assert len(idx) == 50_100


def test_occurrence_lists_stay_bounded():
    idx = index_of([A] * 1000, max_matches=2)
    assert all(len(ends) <= 3 for d in idx._ends.values() for ends in d.values())


# --- the drafter --------------------------------------------------------------------------------

def ctx(tokens) -> DraftContext:
    return DraftContext(torch.tensor(tokens, dtype=torch.long), sampling=None)


def test_prompt_lookup_protocol_and_chain():
    d = PromptLookup()
    assert isinstance(d, Drafter)
    d.begin()
    prompt = [A, B, C, D, A, B]
    draft = d.propose(ctx(prompt), 3)
    assert draft.tokens.tolist() == [C, D, A] and draft.parents.tolist() == [-1, 0, 1]
    assert draft.tokens.dtype == torch.long and draft.q_probs is None
    d.accept(8)  # target accepted c, bonus d
    draft = d.propose(ctx(prompt + [C, D]), 4)
    assert draft.tokens.tolist() == ref_lookup(prompt + [C, D], 4) == [A, B, C, D]
    assert len(d.index) == 8
    d.end()
    assert d.index is None


def test_prompt_lookup_empty_cases():
    d = PromptLookup()
    d.begin()
    assert len(d.propose(ctx([X, Y, Z]), 4)) == 0
    assert len(d.propose(ctx([X, Y, Z, X]), 0)) == 0  # budget 0: no draft
    draft = d.propose(ctx([X, Y, Z, X]), 4)  # index catches up after a budget-0 step
    assert draft.tokens.tolist() == [Y, Z, X]
    assert len(d.propose_branches(ctx([X, Y, Z, X]), 0, 2)) == 0


def test_prompt_lookup_budget_respected():
    d = PromptLookup()
    d.begin()
    toks = [A, B, C, D, X, Y, Z, P, Q, A, B]
    for budget in range(0, 12):
        assert len(d.propose(ctx(toks), budget)) == min(budget, 9)
        assert len(d.propose_branches(ctx(toks), budget, 3)) <= budget


def test_prompt_lookup_tree():
    d = PromptLookup()
    d.begin()
    draft = d.propose_branches(ctx([A, B, C, A, B, D, A, B]), 5, 2)
    assert draft.tokens.tolist() == [D, A, B, C, A]
    assert draft.parents.tolist() == [-1, 0, 1, -1, 3]
    assert draft.q_probs is None and isinstance(draft, Draft)


def test_prompt_lookup_rejects_stale_context():
    d = PromptLookup()
    d.begin()
    d.propose(ctx([A, B, C, A]), 2)
    with pytest.raises(ValueError, match="begin"):
        d.propose(ctx([A, B]), 2)  # shorter: a new generation without begin()
    with pytest.raises(ValueError, match="begin"):
        d.propose(ctx([D, D, D, D, D]), 2)  # swapped context
    with pytest.raises(ValueError):
        d.accept(2)
    d.begin()  # begin() resets
    assert d.propose(ctx([D, D, D]), 2).tokens.tolist() == [D]


def test_prompt_lookup_incremental_cost():
    d = PromptLookup()
    d.begin()
    toks = torch.randint(0, 50, (20_000,), generator=torch.Generator().manual_seed(1))
    d.propose(DraftContext(toks, None), 4)
    before = d.index.ops
    for t in range(1, 51):
        d.propose(DraftContext(torch.cat([toks, torch.full((t,), 7)]), None), 4)
    assert d.index.ops - before == 3 * 50


def test_lookup_after_continues_text_that_is_not_indexed():
    """lookup_after: the suffix of context + extra (a draft's chain, never indexed) matched against the
    context; the continuation may run on into extra; below min_n nothing."""
    idx = NgramIndex(min_n=1, max_n=4)
    idx.extend([1, 2, 3, 4])
    assert idx.lookup_after([1, 2], 4, min_n=2) == [3, 4, 1, 2]  # "1 2" ended at 2: what followed, then extra
    assert idx.lookup_after([3], 3, min_n=1) == [4, 3]  # "3" ended at 3
    assert idx.lookup_after([4], 3, min_n=2) == []  # "4 4" never occurred, "4" alone is below min_n
    assert idx.lookup_after([9, 9], 4, min_n=1) == []
    assert idx.lookup_after([], 2, min_n=1) == idx.lookup(2)
    assert len(idx) == 4  # nothing of extra was indexed
