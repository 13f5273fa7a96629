"""Self-speculation: the target's own first E layers, plus its final norm and LM head, draft for it.

`EarlyExit(target, exit_layer=E)` builds a *view* of the target (no weights copied: the first E decoder
layers, the embeddings, the final norm and the LM head are the target's own modules) and drafts with it
like any model drafter, over its own page tensors on the shared block table.

Exactness: the drafter's KV for layers < E is computed from the same weights and the same inputs as the
target's, so it is bit-for-bit what the target writes for those layers *when both run the same tokens*;
specdec still keeps the two sets of pages apart (the target re-computes its own), which costs E/L of a
draft's KV writes but never trades correctness. Sharing them (writing once) is a planned optimisation.
Greedy output is always the target's: the drafter only proposes, the target verifies.
"""
from __future__ import annotations

import copy

import torch.nn as nn

from .model import ModelDrafter


def _decoder(model):
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        raise ValueError(f"EarlyExit needs a decoder with `model.layers` (Llama, Mistral, Qwen, Gemma, Phi-3 ...); "
                         f"{type(model).__name__} has none")
    return inner


def early_exit_view(target, exit_layer: int):
    """A model object that runs the target's first `exit_layer` layers then its norm and LM head."""
    inner = _decoder(target)
    total = len(inner.layers)
    if not 1 <= exit_layer < total:
        raise ValueError(f"exit_layer must be in [1, {total - 1}] for a {total}-layer target, got {exit_layer}")
    view = copy.copy(target)
    view._modules = dict(target._modules)
    view_inner = copy.copy(inner)
    view_inner._modules = dict(inner._modules)
    view_inner.layers = nn.ModuleList(list(inner.layers)[:exit_layer])
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = exit_layer
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:exit_layer]
    view_inner.config = config
    view.config = config
    view._modules["model"] = view_inner
    return view


class EarlyExit(ModelDrafter):
    """Draft with the target's first `exit_layer` layers (self-speculation; no second model)."""

    def __init__(self, target, exit_layer: int):
        super().__init__(early_exit_view(target, exit_layer))
        self.exit_layer = exit_layer
