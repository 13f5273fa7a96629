"""Drafters: who proposes the tokens the target verifies.

- ModelDrafter: a small HF causal LM with the target's vocabulary (pass the model as `drafter=`).
- PromptLookup: n-gram lookup over the context, no second model (`drafter="ngram"`).
- EarlyExit: the target's own first layers (self-speculation).
- FeatureHead: a small trained head on the target's own features (EAGLE family).
- CrossTokenizerDrafter: a draft model with its own tokenizer (token-level intersection or text).
- LookupFirst: prompt lookup where the context repeats, any of the above elsewhere (`drafter="ngram+..."`
  on the command line).
Any object following the `Drafter` protocol (base.py) plugs in the same way.
"""
from .base import (BatchDrafter, CheckedDrafter, Draft, DraftContext, Drafter, DraftRows, DraftSetup, FeatureDrafter,
                   ModelBackedDrafter, RowDrafter, SwitchingDrafter, TreeDrafter)
from .cross_tokenizer import CrossTokenizerDrafter
from .early_exit import EarlyExit
from .feature_head import FeatureHead
from .lookup_first import LookupFirst
from .model import ModelDrafter
from .ngram import NgramIndex, PromptLookup

__all__ = ["Draft", "DraftContext", "Drafter", "ModelDrafter", "PromptLookup", "NgramIndex", "EarlyExit", "FeatureHead", "FeatureDrafter",
           "TreeDrafter", "DraftSetup", "CrossTokenizerDrafter", "LookupFirst", "SwitchingDrafter",
           "CheckedDrafter", "ModelBackedDrafter", "RowDrafter", "BatchDrafter", "DraftRows"]
