"""Views of a decoder-only HF model that run a contiguous slice of its layers (no weight is copied).

first_layers(model, E): embeddings, layers [0, E), final norm, LM head. The early-exit drafter. Its
    final norm is wrapped in a `HiddenTap` that keeps the norm's input: the residual stream after layer
    E - 1, the hidden state the target's layer E would receive.
last_layers(model, E): layers [E, L), final norm, LM head, entered through `inputs_embeds` with those
    hidden states. The target's verification when a self-speculative drafter already ran layers < E.

Every decoder layer keeps its own `layer_idx`, so a view's cache writes land in the pages of the
original model's layer. Entering at layer E through `inputs_embeds` is exact only when the decoder's
forward hands `inputs_embeds` to its first layer untouched (true of Llama, Mistral, Qwen2/3, Phi-3
and, since the scaling moved into the embedding module, Gemma-2 in transformers 5; not of a model
that adds or scales anything in between). `enters_hidden_exactly` checks it on the model itself.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

def decoder_of(model):
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        raise ValueError(f"a layer view needs a decoder with `model.layers` (Llama, Mistral, Qwen, Gemma, Phi-3 ...); "
                         f"{type(model).__name__} has none")
    return inner


@torch.no_grad()
def enters_hidden_exactly(model, exit_layer: int, probe_tokens: int = 8) -> bool:
    """Whether last_layers(model, E) fed first_layers(model, E)'s hidden states is the full model, bit for
    bit, on a short probe sequence (one full forward and one split forward of `probe_tokens` tokens)."""
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    ids = (torch.arange(probe_tokens, device=device)[None] * 7 + 3) % vocab
    full = model(input_ids=ids, use_cache=False).logits
    head = first_layers(model, exit_layer)
    head.model.norm.recording = True
    head(input_ids=ids, use_cache=False)
    tail = last_layers(model, exit_layer)(inputs_embeds=head.model.norm.captured[0], use_cache=False).logits
    return torch.equal(full, tail)


class HiddenTap(nn.Module):
    """Wraps the final norm; `captured` collects its inputs ([1, n, H] each) while `recording`."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm
        self.recording = False
        self.captured: list[torch.Tensor] = []

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.recording:
            self.captured.append(hidden)
        return self.norm(hidden)


def _slice(model, layers: slice):
    inner = decoder_of(model)
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view_inner = copy.copy(inner)
    view_inner._modules = dict(inner._modules)
    view_inner.layers = nn.ModuleList(list(inner.layers)[layers])
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(view_inner.layers)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[layers]
    view_inner.config = config
    view.config = config
    view._modules["model"] = view_inner
    return view


def _check_split(model, exit_layer: int) -> None:
    total = len(decoder_of(model).layers)
    if not 1 <= exit_layer < total:
        raise ValueError(f"exit_layer must be in [1, {total - 1}] for a {total}-layer target, got {exit_layer}")


def first_layers(model, exit_layer: int):
    """The model's first `exit_layer` layers, then its final norm (tapped, see HiddenTap) and LM head."""
    _check_split(model, exit_layer)
    view = _slice(model, slice(0, exit_layer))
    view.model.norm = HiddenTap(decoder_of(model).norm)
    return view


def last_layers(model, start_layer: int):
    """The model's layers [start_layer, L), final norm and LM head; call it with inputs_embeds=hidden."""
    _check_split(model, start_layer)
    return _slice(model, slice(start_layer, None))
