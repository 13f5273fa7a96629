"""A draft model with its own tokenizer: any small model drafts for any target.

The draft proposes in the target's ids one of two ways (`mode`):
- "intersection" (token-level intersection, TLI): the draft drafts over the tokens both vocabularies
  share (vocab_map.py); its logits move to the target's ids (-inf elsewhere) and are processed like the
  target's rows, so q is a distribution over target ids and rejection sampling stays exact, greedy or
  sampled, exactly as for a draft model of the target's own vocabulary.
- "text" (universal assisted decoding, UAD): the draft drafts greedily in its own vocabulary; its text is
  encoded with the target's tokenizer after a look-behind window of committed target tokens, and the
  target tokens past the window are the proposal, one-hot (deterministic: exact for greedy and sampling).
  A proposal whose window does not come back unchanged (a merge across the boundary) is dropped. With
  `lookahead` the draft drafts that many tokens past its budget, and only the target tokens that stay
  the same when that text follows are proposed: the text's last target token is often a piece of a
  longer one. Off by default: on Qwen2.5-Coder with SmolLM2 (benchmarks/results/
  real_cross_tokenizer_lookahead.md) one look-ahead token lifted the last position's acceptance from
  0.60-0.67 to 0.89-0.94 but cost a draft forward per step, and every mode ran 2-8 % slower.
  With `tree=` text mode grows the draft's tree in its own vocabulary (EAGLE-2 by path probability) and
  proposes the trie of its leaves' re-encoded text (drafters/text_tree.py); one-hot siblings, exact.
- "auto" (default): intersection when sampling and the two tokenizers cut the prompt's text alike (at
  least `min_agreement` of the target's tokens are also one draft token, vocab_map.span_agreement) with
  at least `min_shared` shared tokens; text otherwise. Greedy decoding always takes text: a restricted
  draft can only lose proposals there (its argmax may be a token the target lacks, or a shorter piece of
  the target's longer one), while under sampling the intersection's q accepts with sum min(p, q) where a
  one-hot proposal accepts with p(x) only. Measured on code (SmolLM2 drafting, k=4, greedy): Gemma 3
  270M acceptance 0.21 (intersection) / 0.65 (text), Qwen2.5-Coder-1.5B 0.18 / 0.39; their span
  agreement on code prompts is 0.73 and 0.69, on chat prose 0.99 and 0.90.

The draft keeps its KV in its own token positions (its own page pool and block table). Each step the
committed target tokens are decoded to text and encoded with the draft's tokenizer; the draft's KV is
rolled back to the longest common prefix with the ids it holds and catches up on the rest. The draft's
history is therefore always the committed text, however the two tokenizers split it, and the drafted
tokens it ran are simply rolled back next step where the target chose otherwise.
"""
from __future__ import annotations

import copy
import weakref

import torch

from ..cache.pool import BlockTable, PagePool, common_prefix
from ..hf.runner import ModelRunner, max_positions_of
from ..tree import TreeGrower, TreeSpec
from .base import Draft, DraftContext, DraftSetup
from .model import draft_chain, grow_tree, model_runner, vocab_size_of
from .text_tree import leaf_paths, merged_trie
from .vocab_map import VocabMap, span_agreement

MODES = ("auto", "intersection", "text")
_maps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # draft tokenizer -> {key: VocabMap}


def shared_vocab(draft_tokenizer, target_tokenizer, draft_vocab: int, target_vocab: int) -> VocabMap:
    """The VocabMap of two tokenizers, built once per pair (a 262K vocabulary takes a few seconds)."""
    per_draft = _maps.setdefault(draft_tokenizer, {})
    key = (id(target_tokenizer), draft_vocab, target_vocab)
    if key not in per_draft:
        per_draft[key] = VocabMap(draft_tokenizer, target_tokenizer, draft_vocab, target_vocab)
    return per_draft[key]


def _check_text_tokenizer(tok, role: str) -> None:
    try:
        ids = tok.encode("Hello world", add_special_tokens=False)
        text = tok.decode(ids)
    except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
        raise ValueError(f"the {role} ({type(tok).__name__}) cannot encode and decode text, which drafting across "
                         f"tokenizers needs: {e}") from e
    if not ids or not isinstance(text, str):
        raise ValueError(f"the {role} ({type(tok).__name__}) does not turn text into ids and back "
                         f"('Hello world' -> {ids!r} -> {text!r})")


class CrossTokenizerDrafter:
    """model: the draft (a HF causal LM); draft_tokenizer: its tokenizer; target_tokenizer: the target's.
    mode: 'auto', 'intersection' or 'text' (module docstring). lookbehind: committed target tokens
    re-encoded with a text-mode proposal. lookahead: draft tokens drafted past a text-mode proposal so
    that its last target token is known to be complete (0: propose whatever the text ends with)."""

    def __init__(self, model, draft_tokenizer, target_tokenizer, mode: str = "auto", min_shared: int = 256,
                 min_agreement: float = 0.9, lookbehind: int = 8, lookahead: int = 0, lean: bool = True,
                 page_size: int = 16):
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        if mode not in MODES:
            raise ValueError(f"cross-tokenizer mode must be one of {MODES}, got {mode!r}")
        if draft_tokenizer is None or target_tokenizer is None:
            raise ValueError("drafting with another tokenizer needs both: tokenizer= (the target's) and "
                             "assistant_tokenizer= (the draft's)")
        _check_text_tokenizer(draft_tokenizer, "draft tokenizer (assistant_tokenizer)")
        _check_text_tokenizer(target_tokenizer, "target tokenizer (tokenizer)")
        self.model = model.eval()
        self.draft_tok, self.target_tok = draft_tokenizer, target_tokenizer
        self.mode, self.min_shared, self.min_agreement = mode, min_shared, min_agreement
        self._agreement: float | None = None  # auto: the prompt's span agreement, read at the first propose
        self.lookbehind, self.lookahead, self.lean, self.page_size = lookbehind, int(lookahead), lean, page_size
        self.vocab: VocabMap | None = None
        self.active = "intersection" if mode == "intersection" else "text"  # auto decides per generation
        self.runner: ModelRunner | None = None
        self.ids: list[int] = []  # the draft ids whose KV the runner holds, in order
        bos = draft_tokenizer.bos_token_id
        adds_bos = bos is not None and draft_tokenizer("a")["input_ids"][:1] == [bos]
        self._draft_prefix = [bos] if adds_bos else []
        self._target_bos = target_tokenizer.bos_token_id

    def check_compatible(self, target) -> None:
        tv, dv = vocab_size_of(target), vocab_size_of(self.model)
        for tok, size, role in ((self.target_tok, tv, "tokenizer= (the target's)"),
                                (self.draft_tok, dv, "assistant_tokenizer= (the draft's)")):
            top = max(tok.get_vocab().values())
            if top >= size:
                raise ValueError(f"{role} has token id {top}, past its model's vocabulary of {size}: it is not that "
                                 "model's tokenizer")
        self.target_vocab = tv
        if self.mode != "text":
            self.vocab = shared_vocab(self.draft_tok, self.target_tok, dv, tv)
            if self.vocab.size < self.min_shared:
                if self.mode == "intersection":
                    raise ValueError(f"the two vocabularies share only {self.vocab.size} tokens (fewer than "
                                     f"min_shared={self.min_shared}): too few to draft by intersection; use "
                                     "cross_tokenizer='text'")
                self.active = "text"

    def for_batch(self, pool):
        """Every row of a batch drafted together (drafters/cross_rows.py); `pool` is the target's: the
        draft's positions are its own, so its pages come from a pool of its own."""
        from .cross_rows import CrossTokenizerRows

        return CrossTokenizerRows(self)

    def for_row(self) -> "CrossTokenizerDrafter":
        """A drafter for one row of a batch (specdec/batch.py): the same model, tokenizers and vocabulary
        map (and what check_compatible decided), its own pages and draft history."""
        row = copy.copy(self)
        row.runner, row.ids = None, []
        return row

    # -- the Drafter protocol --------------------------------------------------------------------
    def begin(self, setup: DraftSetup) -> None:
        if self.runner is None:
            device = next(self.model.parameters()).device
            pages = -(-(max_positions_of(self.model) or 8192) // self.page_size) + 1
            self.table = BlockTable(PagePool(pages, self.page_size), device)
            self.runner = model_runner(self.model, self.table, setup.kernel, self.lean)
            self.ids = []
        if setup.prompt is None:
            return
        prompt = setup.prompt.tolist()
        if self.mode == "auto":
            self._agreement = self.usable_agreement(prompt)
            self.active = None  # decided at the first propose, which knows whether this generation samples
        self._sync(prompt)  # the draft's prefill of the prompt's text: timed as prefill, not drafting

    def _decide(self, ctx: DraftContext) -> None:
        """auto: the mode for this generation, at its first proposal (see the module doc)."""
        if self.active is None:
            self.active = self.mode_for(ctx, self._agreement)

    def usable_agreement(self, prompt: list[int]) -> float | None:
        """auto: how alike the two tokenizers cut the prompt's text (None: too few shared tokens)."""
        usable = self.vocab is not None and self.vocab.size >= self.min_shared
        return span_agreement(self.draft_tok, self.target_tok, self._text(prompt)) if usable else None

    def mode_for(self, ctx: DraftContext, agreement: float | None) -> str:
        """auto's choice for a generation (see the module doc)."""
        shared = ctx.sampling.do_sample and (agreement or 0.0) >= self.min_agreement
        return "intersection" if shared else "text"

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        self._decide(ctx)
        committed = ctx.tokens.tolist()
        logits = self._sync(committed)  # [1, V_draft]: the draft's next-token logits after the committed text
        if self.active == "intersection":
            return self._propose_shared(ctx, budget, logits)
        return self._propose_text(ctx, budget, committed, logits)

    def propose_tree(self, ctx: DraftContext, spec: TreeSpec, budget: int) -> Draft:
        """A token tree of at most min(budget, spec.nodes) target tokens and spec.depth levels: one catch-up,
        then one forward per depth over the frontier (the nodes' draft KV scratch past the committed ids).
        Intersection mode grows it over the shared tokens, as ModelDrafter does (a shared token is one draft
        token, so a node's depth is the same in both vocabularies): its children are the processed
        target-id distribution's top tokens. Text mode grows it in the draft's vocabulary by the draft's
        path probability and re-encodes each leaf's text into target tokens, merged into one trie
        (drafters/text_tree.py). Deterministic either way: lossless greedy or sampled."""
        self._decide(ctx)
        device = ctx.tokens.device
        grower = TreeGrower(spec, budget)
        if grower.budget <= 0:
            return Draft.empty(device)
        committed = ctx.tokens.tolist()
        logits = self._sync(committed)
        if self.active == "intersection":
            vocab, tv = self.vocab, self.target_vocab
            grow_tree(self.runner, grower, ctx, logits, self.table.device,
                      scores=lambda logits: vocab.target_scores(logits, tv),
                      model_ids=lambda ids: vocab.to_draft[torch.tensor(ids, dtype=torch.long)].tolist())
            toks, parents = grower.result()
            return Draft.from_lists(toks, parents, device, scores=grower.kept_scores)
        anchor = self.ids[-1]
        grow_tree(self.runner, grower, ctx, logits, self.table.device, processed=False,
                  final_token=self.draft_tok.eos_token_id)
        return self.text_tree(committed, grower, anchor, device)

    def text_tree(self, committed: list[int], grower: TreeGrower, anchor: int, device) -> Draft:
        """Text mode's tree from a grown draft-token tree: each kept leaf's text after the committed target
        tokens re-encoded into target tokens (as a chain is; anchor: the committed text's last draft id),
        merged into one trie of at most the grower's budget and its spec's depth (drafters/text_tree.py)."""
        toks, parents = grower.result()
        depth = grower.spec.depth
        toks, parents, scores = merged_trie(
            leaf_paths(toks, parents, grower.kept_scores),
            lambda path: self._retokenized(committed, path, depth, anchor), depth, grower.budget)
        return Draft.from_lists(toks, parents, device, scores=scores)

    def accept(self, num_context_tokens: int) -> None:
        pass  # the next _sync rolls the draft back to the committed text, whatever was accepted

    def end(self) -> None:
        if self.runner is not None:
            self.table.release()
        self.runner, self.ids = None, []

    # -- internals -------------------------------------------------------------------------------
    def _plain(self, target_tokens: list[int]) -> list[int]:
        return target_tokens[1:] if target_tokens[:1] == [self._target_bos] else target_tokens

    def _text(self, target_tokens: list[int]) -> str:
        text = self.target_tok.decode(self._plain(target_tokens), skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)
        return text.rstrip("\ufffd")  # a character split across target tokens: the rest is still to come

    def _draft_ids(self, target_tokens: list[int]) -> list[int]:
        """The committed target text in draft ids (the target's BOS becomes the draft's own convention)."""
        ids = self._draft_prefix + self.draft_tok.encode(self._text(target_tokens), add_special_tokens=False)
        return ids or [self.draft_tok.eos_token_id or 0]

    def _sync(self, target_tokens: list[int]) -> torch.Tensor:
        """Roll the draft's KV back to what still matches the committed text, run the rest; returns the
        logits [1, V_draft] for the draft token after it."""
        want = self._draft_ids(target_tokens)
        keep = min(common_prefix(self.ids, want), len(want) - 1)
        self.runner.rollback(keep)
        self.table.truncate(keep)
        self.ids = want
        new = torch.tensor(want[keep:], dtype=torch.long, device=self.table.device)
        return self.runner.forward(new, logits_rows=1)

    def _step(self, draft_id: int) -> torch.Tensor:
        """Run one drafted draft id; its next-token logits [1, V_draft]."""
        out = self.runner.forward(torch.tensor([draft_id], dtype=torch.long, device=self.table.device), logits_rows=1)
        self.ids.append(draft_id)
        return out

    def _propose_shared(self, ctx: DraftContext, budget: int, logits: torch.Tensor) -> Draft:
        vocab, tv = self.vocab, self.target_vocab

        def advance(target_id: int, i: int) -> torch.Tensor:
            return vocab.target_scores(self._step(int(vocab.to_draft[target_id])), tv)

        return draft_chain(ctx, budget, vocab.target_scores(logits, tv), advance)

    def _propose_text(self, ctx: DraftContext, budget: int, committed: list[int], logits: torch.Tensor) -> Draft:
        drafted: list[int] = []
        anchor = self.ids[-1]  # the committed text's last draft token
        while True:
            drafted.append(int(logits[0].argmax()))
            proposal = self.text_proposal(committed, drafted, budget, anchor)
            if proposal is not None:
                return Draft.from_lists(proposal, None, ctx.tokens.device)
            logits = self._step(drafted[-1])

    def text_proposal(self, committed: list[int], drafted: list[int], budget: int,
                      anchor: int | None) -> list[int] | None:
        """Text mode after `drafted` (draft ids): the proposal (_retokenized), or None to draft on. Done at
        the draft's EOS; else once at least budget + lookahead draft tokens are drafted and their text gives
        `budget` target tokens, or none (a merge across the boundary), or 2 x budget + lookahead were
        drafted. Draft tokens often re-encode to fewer target tokens ('calc' + 'ulate' -> ' calculate');
        stopping at `budget` draft tokens then proposed fewer than planned (k used 1.6-1.8 at k = 2 with
        SmolLM2 drafting for Qwen2.5-Coder)."""
        ended = drafted[-1:] == [self.draft_tok.eos_token_id]
        if not ended and len(drafted) < budget + self.lookahead:
            return None
        proposal = self._retokenized(committed, drafted, budget, anchor)
        if ended or len(drafted) >= 2 * budget + self.lookahead or not proposal or len(proposal) >= budget:
            return proposal
        return None

    def _draft_text(self, drafted: list[int], anchor: int | None) -> str:
        """The text of drafted draft ids as it continues the committed text: decoded after `anchor` (the
        committed text's last draft id) and cut from it, since a SentencePiece-style decoder drops the
        leading space of a first token ('▁time' alone decodes to 'time')."""
        def decode(ids: list[int]) -> str:
            return self.draft_tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        if anchor is None:
            return decode(drafted)
        lead, both = decode([anchor]), decode([anchor] + drafted)
        return both[len(lead):] if both.startswith(lead) else decode(drafted)

    def _retokenized(self, committed: list[int], drafted: list[int], budget: int, anchor: int | None) -> list[int]:
        """Text mode's proposal: draft ids -> at most `budget` target ids after the committed text, or []
        where the look-behind window does not come back unchanged (a merge across the boundary). anchor:
        the committed text's last draft id (see _draft_text).

        With `lookahead` (the last `lookahead` drafted ids are look-ahead, unless the draft ended with
        its EOS) only target tokens that stay the same when the look-ahead text follows are proposed: the
        text's last target token is often a piece of a longer one (the draft wrote "calc" of "calculate"),
        which the target then rejects."""
        window = self._plain(committed)[-self.lookbehind:]
        head = self.target_tok.decode(window, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        def encode(ids: list[int]) -> list[int]:
            return self.target_tok.encode(head + self._draft_text(ids, anchor), add_special_tokens=False)

        encoded = encode(drafted)
        if encoded[:len(window)] != window:
            return []
        ended = drafted[-1:] == [self.draft_tok.eos_token_id]
        if self.lookahead and not ended and len(drafted) > self.lookahead:
            stable = encode(drafted[:-self.lookahead])
            encoded = encoded[:common_prefix(encoded, stable)]
        return encoded[len(window):len(window) + budget]
