"""Which tokens two tokenizers share: the map that token-level intersection (TLI) drafts through.

Two tokenizers spell their tokens differently (byte-level BPE writes a leading space as 'Ġ', SentencePiece
as '▁'), so tokens are compared by the text they add: token i's text is decode([anchor, i]) minus
decode([anchor]), with `anchor` a plain letter, which keeps each convention's leading space. Special
tokens, tokens that decode to nothing, and byte pieces that are not whole UTF-8 text ('\\ufffd') are not
shared. Where several ids of one vocabulary have the same text, the lowest id stands for it, so the map
is one-to-one: a draft token and the target token it proposes spell the same text.

Exactness does not depend on the map's quality: the target verifies every proposal against the draft's q
restricted to the shared tokens (and renormalised), which is a proper distribution over target ids.
"""
from __future__ import annotations

import torch


def token_texts(tokenizer, size: int) -> list[str | None]:
    """The text each id in [0, size) adds after a plain letter; None where it is not plain text."""
    anchor = tokenizer.encode("a", add_special_tokens=False)
    if not anchor:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} encodes 'a' to nothing: cannot compare its tokens")
    base = tokenizer.decode(anchor, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    decoded = tokenizer.batch_decode([anchor + [i] for i in range(size)], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
    special = set(tokenizer.all_special_ids)
    out: list[str | None] = []
    for i, text in enumerate(decoded):
        piece = text[len(base):] if text.startswith(base) else None
        out.append(None if i in special or not piece or "\ufffd" in piece else piece)
    return out


def span_agreement(draft_tokenizer, target_tokenizer, text: str) -> float | None:
    """The fraction of the target's tokens of `text` that the draft's tokenizer also cuts as one token
    (the same character span): how often a draft restricted to shared tokens can propose the target's own
    token. None when a tokenizer gives no character offsets (not a fast tokenizer) or the text is empty."""
    try:
        target = target_tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
        draft = draft_tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    except (NotImplementedError, TypeError, ValueError, KeyError):
        return None
    if not target:
        return None
    spans = {tuple(s) for s in draft}
    return sum(tuple(s) in spans for s in target) / len(target)


class VocabMap:
    """A one-to-one map between the draft's and the target's shared tokens.

    draft_ids, target_ids: [M] int64, the shared pairs (draft_ids[j] spells what target_ids[j] spells)
    to_target: [V_draft] int64, the target id of each draft id, -1 where not shared
    to_draft:  [V_target] int64, the draft id of each target id, -1 where not shared
    """

    def __init__(self, draft_tokenizer, target_tokenizer, draft_vocab: int, target_vocab: int):
        draft_texts = token_texts(draft_tokenizer, min(draft_vocab, len(draft_tokenizer)))
        target_texts = token_texts(target_tokenizer, min(target_vocab, len(target_tokenizer)))
        first_target: dict[str, int] = {}
        for i, t in enumerate(target_texts):
            if t is not None:
                first_target.setdefault(t, i)
        pairs, seen = [], set()
        for i, t in enumerate(draft_texts):
            if t is not None and t in first_target and t not in seen:
                seen.add(t)
                pairs.append((i, first_target[t]))
        self.size = len(pairs)
        self.draft_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)
        self.target_ids = torch.tensor([t for _, t in pairs], dtype=torch.long)
        self.to_target = torch.full((draft_vocab,), -1, dtype=torch.long)
        self.to_target[self.draft_ids] = self.target_ids
        self.to_draft = torch.full((target_vocab,), -1, dtype=torch.long)
        self.to_draft[self.target_ids] = self.draft_ids

    def target_scores(self, draft_scores: torch.Tensor, target_vocab: int) -> torch.Tensor:
        """draft_scores [r, V_draft] -> [r, V_target]: the shared tokens' scores at their target ids, -inf
        elsewhere (softmax then renormalises over the shared tokens)."""
        out = draft_scores.new_full((draft_scores.shape[0], target_vocab), float("-inf"))
        device = draft_scores.device
        out[:, self.target_ids.to(device)] = draft_scores[:, self.draft_ids.to(device)]
        return out
