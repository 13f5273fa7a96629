"""Prompt lookup: draft by copying what followed an earlier occurrence of the context's last n tokens.

No model, no probabilities: if the context ends in an n-gram that appeared before, guess that what came
after it then comes after it now. It pays on inputs that repeat themselves (code edits, summaries that
quote, extraction, greedy loops) and costs almost nothing when it misses.

The index is incremental. The context only grows (the engine commits tokens and never takes committed
ones back), so each `extend` indexes just the n-grams that END in the new tokens: O(new tokens * max_n)
dict updates, never a rescan of the whole context.

Words: an n-gram's *end* is the position one past its last token, so the tokens that followed it start
at tokens[end]. The *suffix* is the context's last n tokens (end == len(context)); a *match* is an
EARLIER occurrence of the suffix (end < len(context)), and its *continuation* is tokens[end:end + k].

Worked examples (min_n=1, max_n=3, tokens written as letters):

    context "x y z"          no n-gram of the suffix occurred before            lookup(4) -> []
    context "a b c d a b"    "a b" ended at 2 before (no earlier "d a b")         lookup(4) -> [c d a b]
    context "a a a a"        longest n = 3: "a a a" ended at 3 before; the continuation runs into the
                             suffix itself, and the context ends after 1 token     lookup(4) -> [a]
    context "a b c a b d a b"   "a b" ended at 2 and 5: the most recent wins       lookup(2) -> [d a]
    context "b c x c y b c"  "b c" (n=2) beats the more recent "c" (n=1)          lookup(1) -> [x]
    context "p q p"          match at the very end: "p" ended at 1                 lookup(9) -> [q p]

    lookup_tree on "a b c a b d a b", k=5, max_branches=2: matches of "a b" (n=2), most recent first,
    continue with [d a b] and [c a b d a b]; distinct first tokens d, c -> two branches, filled level
    by level: tokens [d a b c a], parents [-1 0 1 -1 3].
"""
from __future__ import annotations

import torch

from .base import Draft, DraftContext, DraftSetup


class NgramIndex:
    """Incremental map from every n-gram (min_n <= n <= max_n) of a growing token list to its ends.

    Per n, a dict maps the n-gram tuple to the ends of its most recent occurrences (ascending, at most
    max_matches + 1 of them: the suffix's own occurrence is always the newest, so max_matches earlier
    ones remain for lookups).

    `ops` counts n-gram insertions (one per n per indexed token): tests use it to show that extend
    touches only the new tokens.
    """

    def __init__(self, min_n: int = 1, max_n: int = 3, max_matches: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        self.min_n, self.max_n, self.max_matches = min_n, max_n, max_matches
        self.tokens: list[int] = []
        self._ends: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_n, max_n + 1)}
        self.ops = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens) -> None:
        """Append tokens (any iterable of ints) and index the n-grams that end in them."""
        toks = self.tokens
        keep = self.max_matches + 1
        for t in new_tokens:
            toks.append(int(t))
            end = len(toks)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends = self._ends[n].setdefault(tuple(toks[end - n:end]), [])
                ends.append(end)
                if len(ends) > keep:
                    del ends[0]
                self.ops += 1

    def match(self) -> tuple[int, list[int]]:
        """(n, earlier ends, most recent first) for the longest suffix n-gram seen before; (0, []) if none."""
        T = len(self.tokens)
        for n in range(min(self.max_n, T - 1), self.min_n - 1, -1):
            ends = self._ends[n].get(tuple(self.tokens[T - n:]))
            # ends[-1] == T is the suffix itself; anything before it is an earlier occurrence
            if ends is not None and len(ends) > 1:
                return n, [e for e in reversed(ends) if e < T]
        return 0, []

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        if k <= 0:
            return []
        _, ends = self.match()
        return self.tokens[ends[0]:ends[0] + k] if ends else []

    def lookup_after(self, extra: list[int], k: int, min_n: int) -> list[int]:
        """Up to k tokens that followed the most recent occurrence of the longest suffix n-gram (n >= min_n)
        of the context followed by `extra` (tokens not indexed, e.g. a draft's own), or [] if none. The
        suffix ends in `extra`, so every indexed occurrence is an earlier one; the continuation may run
        on into `extra`. Worked example (min_n=2): context "a b c d", extra [a b] -> [c d a b] (k=4)."""
        if not extra:  # the suffix is the context's own: match() (its own occurrence left out)
            n, ends = self.match()
            return self.tokens[ends[0]:ends[0] + k] if n >= min_n and ends else []
        extra, T = list(extra), len(self.tokens)
        tail = self.tokens[max(0, T - self.max_n):] + extra  # the suffix's tokens only: O(max_n + len(extra))
        for n in range(min(self.max_n, T + len(extra) - 1), max(min_n, self.min_n) - 1, -1):
            ends = self._ends[n].get(tuple(tail[len(tail) - n:]))
            if ends:
                end = ends[-1]  # <= T: the continuation starts in the context and may run on into extra
                return (self.tokens[end:end + k] + extra)[:k] if end + k > T else self.tokens[end:end + k]
        return []

    def lookup_tree(self, k: int, max_branches: int) -> tuple[list[int], list[int]]:
        """A token tree of at most k nodes: one branch per distinct continuation of the longest match.

        Branches come from the recent matches of the longest matching n, most recent first, one per
        distinct first token (up to max_branches); the first branch is a prefix of lookup(k). The
        budget is filled level by level (every branch's 1st token, then every 2nd, ...), so the
        alternatives at the first position, where the branches differ, are kept first.
        Returns (tokens, parents), topological order, parent -1 = child of the root; ([], []) if none.
        """
        if k <= 0 or max_branches <= 0:
            return [], []
        _, ends = self.match()
        branches: list[list[int]] = []
        seen: set[int] = set()
        for e in ends:
            if self.tokens[e] not in seen:
                seen.add(self.tokens[e])
                branches.append(self.tokens[e:e + k])
                if len(branches) == max_branches:
                    break
        # level-by-level allocation of the k nodes
        lengths = [0] * len(branches)
        used, depth = 0, 0
        while used < k:
            grew = False
            for b, branch in enumerate(branches):
                if used < k and len(branch) > depth:
                    lengths[b] += 1
                    used += 1
                    grew = True
            if not grew:
                break
            depth += 1
        tokens: list[int] = []
        parents: list[int] = []
        for branch, m in zip(branches, lengths):
            for i in range(m):
                parents.append(-1 if i == 0 else len(tokens) - 1)
                tokens.append(branch[i])
        return tokens, parents


class PromptLookup:
    """Drafter: prompt lookup decoding over an incremental n-gram index of the committed context.

    Deterministic (q is one-hot on each proposed token). Each propose() indexes only the tokens committed
    since the last one (one device-to-host copy of those tokens), so a step costs O(new tokens), not
    O(context).
    """

    def __init__(self, min_n: int = 1, max_n: int = 3, max_matches: int = 4):
        NgramIndex(min_n, max_n, max_matches)  # validate arguments now, not at the first propose
        self.min_n, self.max_n, self.max_matches = min_n, max_n, max_matches
        self.index: NgramIndex | None = None
        self.num_context_tokens = 0

    def for_row(self) -> "PromptLookup":
        return PromptLookup(self.min_n, self.max_n, self.max_matches)

    def begin(self, setup: DraftSetup | None = None) -> None:
        self.index = NgramIndex(self.min_n, self.max_n, self.max_matches)
        self.num_context_tokens = 0
        if setup is not None and setup.prompt is not None:  # index the prompt now: prefill, not drafting
            self.index_of(setup.prompt)

    def index_of(self, tokens: torch.Tensor) -> NgramIndex:
        """The index, after indexing the context tokens [T] int64 past what it already holds."""
        if self.index is None:
            self.index = NgramIndex(self.min_n, self.max_n, self.max_matches)
        index = self.index
        T, done = int(tokens.numel()), len(index)
        if T < done:
            raise ValueError(
                f"PromptLookup: the context has {T} tokens but {done} are already indexed; the context "
                "only grows within a generation (call begin() before each new generation)"
            )
        if T > done:
            # one copy of the new tokens, plus the last indexed one to catch a context that was swapped
            fresh = tokens[max(done - 1, 0):].tolist()
            if done > 0:
                if fresh[0] != index.tokens[-1]:
                    raise ValueError(
                        f"PromptLookup: context token {done - 1} differs from the one indexed; the "
                        "context changed under the drafter (call begin() before each new generation)"
                    )
                fresh = fresh[1:]
            index.extend(fresh)
        return index

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        """A chain of up to `budget` tokens copied from the context, or Draft.empty() if nothing matches."""
        device = ctx.tokens.device
        if budget <= 0:
            return Draft.empty(device)  # plain decoding this step: the index catches up next time
        draft = self.index_of(ctx.tokens).lookup(budget)
        if not draft:
            return Draft.empty(device)
        return Draft.from_lists(draft, None, device)

    def propose_tree(self, ctx: DraftContext, spec, budget: int) -> Draft:
        """The protocol's tree call: as many branches as the spec's root width, up to `budget` nodes.

        Branches are not cut to the spec's depth here; the engine prunes what runs deeper."""
        return self.propose_branches(ctx, budget, spec.width(0))

    def propose_branches(self, ctx: DraftContext, budget: int, max_branches: int) -> Draft:
        """A tree of up to `budget` nodes, one branch per distinct continuation (see NgramIndex.lookup_tree)."""
        device = ctx.tokens.device
        if budget <= 0 or max_branches <= 0:
            return Draft.empty(device)
        tokens, parents = self.index_of(ctx.tokens).lookup_tree(budget, max_branches)
        if not tokens:
            return Draft.empty(device)
        return Draft.from_lists(tokens, parents, device)

    def accept(self, num_context_tokens: int) -> None:
        # Nothing to roll back: drafts never enter the index, only committed context does.
        if self.index is not None and num_context_tokens < len(self.index):
            raise ValueError(
                f"PromptLookup.accept({num_context_tokens}): {len(self.index)} tokens are already "
                "indexed, and committed tokens are never taken back"
            )
        self.num_context_tokens = num_context_tokens

    def end(self) -> None:
        self.index = None
        self.num_context_tokens = 0
