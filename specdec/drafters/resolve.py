"""What the `drafter=` argument of generate / wrap names, as a Drafter: None, 'ngram', a draft model (of
the target's tokenizer, or of its own with assistant_tokenizer=), or a Drafter; prompt lookup put in front
where lookup_first asks. Kept out of api.py, which only maps HF's keywords."""
from __future__ import annotations

from .base import CheckedDrafter, Drafter
from .cross_tokenizer import CrossTokenizerDrafter
from .lookup_first import LookupFirst
from .model import ModelDrafter
from .ngram import PromptLookup


def same_vocabulary(a, b) -> bool:
    return a is b or a.get_vocab() == b.get_vocab()


def resolve_drafter(target, drafter, tokenizer=None, assistant_tokenizer=None, cross_tokenizer="auto",
                    lookup_first="auto"):
    """The drafter argument -> a Drafter. A draft model with assistant_tokenizer= (HF's keyword) whose
    vocabulary differs from tokenizer='s drafts across tokenizers (drafters/cross_tokenizer.py).

    lookup_first: True puts prompt lookup in front of the drafter (drafters/lookup_first.py: an n-gram
    match where the context repeats itself, the drafter elsewhere); "auto" does so for a draft with its
    own tokenizer, the best mode measured there (README: drafts with another tokenizer); False never."""
    from transformers import PreTrainedModel

    if lookup_first not in (True, False, "auto"):
        raise ValueError(f"lookup_first must be True, False or 'auto', got {lookup_first!r}")
    across = False
    if drafter is None or isinstance(drafter, Drafter):
        out = drafter
    elif isinstance(drafter, str):
        if drafter != "ngram":
            raise ValueError(f"unknown drafter {drafter!r}: pass a PreTrainedModel, a specdec.drafters.Drafter, or 'ngram'")
        out = PromptLookup()
    elif isinstance(drafter, PreTrainedModel) and assistant_tokenizer is not None:
        if tokenizer is None:
            raise ValueError("assistant_tokenizer= (the draft's tokenizer) needs tokenizer= (the target's) as well")
        if same_vocabulary(tokenizer, assistant_tokenizer):
            out = ModelDrafter(drafter)
        else:
            out = CrossTokenizerDrafter(drafter, assistant_tokenizer, tokenizer, mode=cross_tokenizer)
            across = True
    elif isinstance(drafter, PreTrainedModel):
        out = ModelDrafter(drafter)
    else:
        raise ValueError(f"drafter must be a PreTrainedModel, a specdec.drafters.Drafter or 'ngram', got "
                         f"{type(drafter).__name__}")
    if lookup_first is True:
        if out is None or isinstance(drafter, str):
            raise ValueError("lookup_first=True puts prompt lookup in front of a drafter: pass one (a draft model, a "
                             "FeatureHead, ...); for prompt lookup alone pass drafter='ngram'")
        if not isinstance(out, LookupFirst):
            out = LookupFirst(out)
    elif lookup_first == "auto" and across:
        out = LookupFirst(out)
    if isinstance(out, CheckedDrafter):
        out.check_compatible(target)
    return out
