"""Tiny random models built from configs, one per architecture family the core must support."""
from __future__ import annotations

import os

# Triton kernels run on the CPU through Triton's interpreter; it must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from accelerate import dispatch_model

VOCAB = 61


def _cfgs():
    from transformers import (Gemma2Config, Gemma3TextConfig, GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config)

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {
        "llama": ("LlamaForCausalLM", LlamaConfig(**common)),
        "mistral": ("MistralForCausalLM", MistralConfig(**common, sliding_window=9)),
        "qwen2": ("Qwen2ForCausalLM", Qwen2Config(**common, use_sliding_window=True, sliding_window=7,
                                                   max_window_layers=1)),
        "qwen3": ("Qwen3ForCausalLM", Qwen3Config(**common, head_dim=8)),
        "gemma2": ("Gemma2ForCausalLM", Gemma2Config(**common, head_dim=8, sliding_window=6,
                                                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
        # Gemma 3: sliding and global layers with their own RoPE bases, q/k norms, query_pre_attn_scalar
        "gemma3": ("Gemma3ForCausalLM", Gemma3TextConfig(**common, head_dim=8, sliding_window=6,
                                                          sliding_window_pattern=2, query_pre_attn_scalar=16,
                                                          final_logit_softcapping=None)),
        "phi3": ("Phi3ForCausalLM", Phi3Config(**common)),
        "gpt2": ("GPT2LMHeadModel", GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                               bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    }


ARCHS = list(_cfgs())


def build(arch: str, seed: int = 0, layers: int | None = None, scale: float | None = None):
    """A random-weight model of `arch` (seeded). `scale` multiplies every weight: a larger scale gives
    peakier logits (fewer argmax near-ties, more decisive greedy runs)."""
    import transformers

    cls_name, cfg = _cfgs()[arch]
    if layers is not None:  # rebuild the config so derived fields (layer_types, ...) follow the depth
        key = "n_layer" if hasattr(cfg, "n_layer") else "num_hidden_layers"
        d = {k: v for k, v in cfg.to_dict().items() if k != "layer_types"}
        cfg = type(cfg)(**{**d, key: layers})
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg).eval()
    if scale is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(scale)
    return model


def tiny_vocab_model(vocab: int, seed: int, scale: float):
    """A 1-layer Llama over a tiny vocabulary (for exact goodness-of-fit tests), weights scaled by `scale`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(scale)
    return model


def offloaded(model, folder, on_disk_from: int):
    """Layers >= on_disk_from, the final norm and the LM head on disk; the rest in CPU memory."""
    n = model.config.num_hidden_layers
    dmap = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "disk", "lm_head": "disk"}
    dmap.update({f"model.layers.{i}": ("cpu" if i < on_disk_from else "disk") for i in range(n)})
    return dispatch_model(model, dmap, offload_dir=str(folder))


def hf_greedy(model, ids, max_new_tokens, **kw):
    """The reference: HF's own greedy generate (explicit attention_mask: no pad-token guessing)."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          **kw)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)
