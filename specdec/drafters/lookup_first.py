"""`LookupFirst`: prompt lookup where the context repeats itself, another drafter everywhere else.

An n-gram lookup and a model-like drafter (a draft model, a feature head, a draft with another
tokenizer) are good at different text. Where the answer copies (code edits, quoted names, a list that
repeats its pattern) a long suffix match predicts many tokens for free; elsewhere the lookup has
nothing or only a 1-token match, while the model drafts at a price. SAM-Decoding (Hu et al. 2024)
combines a retrieval draft with an auxiliary drafter the same way: use the retrieval when its match is
long, the drafter otherwise.

Per step: if the committed context ends in an n-gram of at least `min_match` tokens that occurred
before, the proposal is the lookup's continuation (one-hot q, no draft forward); else the wrapped
drafter proposes. Both are exact, and a step's verification only sees the draft it got, so the mix is
exact too. The wrapped drafter is told every accepted length (accept) either way and catches up on the
tokens it skipped in its next proposal, as after any step (every built-in drafter does: a draft model
and a head run their catch-up forward over whatever was committed since).

Where the wrapped drafter proposed a deterministic chain and the text it ends in matches an n-gram of at
least `min_match` tokens seen before, the lookup can continue the chain (`extend=True`; off by default):
free tokens past the step's plan, up to the engine's room (DraftContext.room, Draft.free_from). A code
edit often returns to copied text within the drafter's chain, which the next step's lookup would only
propose after a verification; in bf16, where Qwen2.5-Coder verifies 16 tokens at the cost of one, it
comes in the same verification. Measured (bf16 Qwen2.5-Coder, SmolLM2 in text mode, 6 code prompts):
tau up in every run, tokens/s +5 %, +4 %, -6 % and +3 % in four runs (bf16 outputs move with block
lengths, so the runs do not decode the same text); float32 level. Not a clear win, so not the default.

The wrapped drafter's capabilities pass through: its draft model (the engine switches that model's
attention), the target features a head reads, its compatibility check, its per-row copies for batches.
Trees: the lookup's branches where it matches, the drafter's tree elsewhere (a drafter without trees
proposes its chain, a tree of one branch).
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..tree import is_chain
from .base import (BatchDrafter, CheckedDrafter, Draft, DraftContext, DraftRows, DraftSetup, Drafter, FeatureDrafter,
                   FeatureRows, ModelBackedDrafter, RowDrafter, TreeDrafter)
from .model import ModelDrafter
from .ngram import PromptLookup


class LookupFirst:
    """drafter: any Drafter (not a PromptLookup: that is the lookup already), or a draft model with the
    target's vocabulary (drafted with a ModelDrafter). min_match: the shortest suffix n-gram whose
    earlier occurrence is trusted (1 matches almost every token of a long answer, and a 1-token match
    predicts poorly). lookup: the PromptLookup to use (default: n-grams of min_match to 4 tokens).
    extend: continue the drafter's deterministic chains with the lookup where the chain's end matches
    (free tokens past the step's plan, up to the engine's room: `extended`; off by default)."""

    def __init__(self, drafter: Drafter, min_match: int = 2, lookup: PromptLookup | None = None, extend: bool = False):
        if isinstance(drafter, PreTrainedModel):
            drafter = ModelDrafter(drafter)
        if not isinstance(drafter, Drafter) or isinstance(drafter, (PromptLookup, LookupFirst)):
            raise ValueError(f"LookupFirst wraps a drafter other than a lookup (a draft model's ModelDrafter, a "
                             f"FeatureHead, a CrossTokenizerDrafter, ...), got {type(drafter).__name__}")
        if isinstance(min_match, bool) or not isinstance(min_match, int) or min_match < 1:
            raise ValueError(f"min_match must be an int >= 1 (tokens of the context's suffix), got {min_match!r}")
        lookup = lookup if lookup is not None else PromptLookup(min_n=min_match, max_n=max(4, min_match))
        if min_match > lookup.max_n:
            raise ValueError(f"min_match={min_match} is longer than the lookup's longest n-gram ({lookup.max_n}): "
                             "it would never match")
        self.drafter, self.lookup, self.min_match, self.extend = drafter, lookup, min_match, bool(extend)
        self.lookup_steps = self.drafter_steps = 0  # which of the two proposed, counted per propose call
        self.extensions = 0  # drafter chains the lookup continued (extend)

    # -- what the wrapped drafter brings ---------------------------------------------------------
    @property
    def model(self):
        """The wrapped drafter's draft model (ModelBackedDrafter), None if it runs none."""
        return self.drafter.model if isinstance(self.drafter, ModelBackedDrafter) else None

    @property
    def feature_layers(self) -> tuple:
        """The target layers the wrapped drafter reads (FeatureDrafter), () if it reads none."""
        return tuple(self.drafter.feature_layers) if isinstance(self.drafter, FeatureDrafter) else ()

    def attach(self, features) -> None:
        if isinstance(self.drafter, FeatureDrafter):
            self.drafter.attach(features)

    def check_compatible(self, target) -> None:
        if isinstance(self.drafter, CheckedDrafter):
            self.drafter.check_compatible(target)

    def for_batch(self, pool) -> "LookupFirstRows | None":
        """A batch's drafting (specdec/batch.py): each row's lookup first, the wrapped drafter's DraftRows
        for the other rows together (one forward per draft step); None when the drafter has none."""
        inner = self.drafter.for_batch(pool) if isinstance(self.drafter, BatchDrafter) else None
        return None if inner is None else LookupFirstRows(self, inner)

    def for_row(self) -> "LookupFirst | None":
        row = self.drafter.for_row() if isinstance(self.drafter, RowDrafter) else None
        return None if row is None else LookupFirst(row, self.min_match, self.lookup.for_row(), self.extend)

    # -- the Drafter protocol --------------------------------------------------------------------
    def begin(self, setup: DraftSetup) -> None:
        self.lookup.begin(setup)
        self.drafter.begin(setup)

    def source(self, tokens: torch.Tensor) -> str:
        """"lookup" when the context [T] int64 ends in an n-gram of at least min_match tokens that occurred
        before, else "drafter" (SwitchingDrafter: the engine plans each source's steps on its own)."""
        return self.source_with(self.lookup, tokens)

    def source_with(self, lookup: PromptLookup, tokens: torch.Tensor) -> str:
        """source() for the context [T] int64 of the sequence `lookup` indexes (a batch row's own)."""
        n, _ = lookup.index_of(tokens).match()
        return "lookup" if n >= self.min_match else "drafter"

    def lookup_serves(self, lookup: PromptLookup, tokens: torch.Tensor, budget: int) -> bool:
        """Whether `lookup` proposes the step for the context [T] int64: a budget to fill and a match."""
        return budget > 0 and self.source_with(lookup, tokens) == "lookup"

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        if self.lookup_serves(self.lookup, ctx.tokens, budget):
            self.lookup_steps += 1
            return self.lookup.propose(ctx, budget)
        self.drafter_steps += 1
        draft = self.drafter.propose(ctx, budget)
        return self.extended(ctx, draft) if self.extend else draft

    def extended(self, ctx: DraftContext, draft: Draft) -> Draft:
        """The drafter's chain continued by the lookup where the context followed by the chain ends in an
        n-gram of at least min_match tokens seen before: free tokens past the chain, up to ctx.room in all
        (Draft.free_from). Deterministic chains only (one-hot q, as the lookup's own tokens are): a draft
        that sampled its tokens keeps its q rows and is returned as it is."""
        n = len(draft)
        if n == 0 or ctx.room <= n or draft.q_probs is not None or draft.host is None:
            return draft
        chain = draft.host.tokens
        if not is_chain(draft.host.parents):
            return draft
        more = self.lookup.index_of(ctx.tokens).lookup_after(chain, ctx.room - n, self.min_match)
        if not more:
            return draft
        self.extensions += 1
        out = Draft.from_lists(chain + more, None, draft.tokens.device)
        out.free_from = n
        return out

    def propose_tree(self, ctx: DraftContext, spec, budget: int) -> Draft:
        if self.lookup_serves(self.lookup, ctx.tokens, budget):
            self.lookup_steps += 1
            return self.lookup.propose_tree(ctx, spec, budget)
        self.drafter_steps += 1
        if isinstance(self.drafter, TreeDrafter):
            return self.drafter.propose_tree(ctx, spec, budget)
        return self.drafter.propose(ctx, budget)  # a chain is a tree of one branch (the engine cuts what runs deeper)

    def accept(self, num_context_tokens: int) -> None:
        self.lookup.accept(num_context_tokens)
        self.drafter.accept(num_context_tokens)

    def end(self) -> None:
        try:
            self.drafter.end()
        finally:
            self.lookup.end()


class LookupFirstRows:
    """DraftRows for LookupFirst over a batch: a PromptLookup per row; the rows whose context has no
    match of min_match tokens go to the wrapped drafter's DraftRows together, which are told every row's
    accepted length and catch up on what a row skipped. Also FeatureRows when those are."""

    def __init__(self, first: LookupFirst, inner: DraftRows):
        self.first, self.inner = first, inner
        self.feature_layers = first.feature_layers
        self.lookups: list[PromptLookup] = []

    def attach(self, features: list) -> None:
        if isinstance(self.inner, FeatureRows):
            self.inner.attach(features)

    def begin(self, setups: list[DraftSetup]) -> None:
        self.lookups = [self.first.lookup.for_row() for _ in setups]
        for lookup, setup in zip(self.lookups, setups):
            lookup.begin(setup)
        self.inner.begin(setups)

    def _split(self, requests: list, budget_at: int) -> tuple[list[int], list[int]]:
        """Indices of the requests the lookup serves and of those the wrapped drafter serves."""
        mine, theirs = [], []
        for j, request in enumerate(requests):
            row, ctx, budget = request[0], request[1], request[budget_at]
            (mine if self.first.lookup_serves(self.lookups[row], ctx.tokens, budget) else theirs).append(j)
        return mine, theirs

    def _merge(self, requests, mine, theirs, own, inner) -> list[Draft]:
        out: list = [None] * len(requests)
        for j in mine:
            out[j] = own(requests[j])
        if theirs:
            for j, draft in zip(theirs, inner([requests[j] for j in theirs])):
                out[j] = draft
        self.first.lookup_steps += len(mine)
        self.first.drafter_steps += len(theirs)
        return out

    def propose(self, requests: list) -> list[Draft]:
        """requests: [(row, DraftContext, budget)] -> one chain Draft each, in order."""
        mine, theirs = self._split(requests, 2)
        return self._merge(requests, mine, theirs, lambda r: self.lookups[r[0]].propose(r[1], r[2]),
                           self.inner.propose)

    def propose_trees(self, requests: list) -> list[Draft]:
        """requests: [(row, DraftContext, TreeSpec, budget)] -> one tree Draft each, in order."""
        mine, theirs = self._split(requests, 3)
        return self._merge(requests, mine, theirs, lambda r: self.lookups[r[0]].propose_tree(r[1], r[2], r[3]),
                           self.inner.propose_trees)

    def accept(self, row: int, num_context_tokens: int) -> None:
        self.lookups[row].accept(num_context_tokens)
        self.inner.accept(row, num_context_tokens)

    def end(self) -> None:
        try:
            self.inner.end()
        finally:
            self.lookups = []
