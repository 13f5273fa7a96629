"""One decoder layer of the lean loop (hf/lean.py), bound once from the model's own weight tensors, per
architecture form: Llama's (Llama, Mistral, Qwen2), with RMSNorms over each head's q and k (Qwen3), and
Gemma 3's (those q/k norms, sandwich norms, (1 + w) norms, a RoPE table per layer type). Also the small ops
that reproduce HF's modules bit for bit (RMSNorm in either form, RoPE in four ops), which the compiled
step's graphs and the feature heads share.

Shapes: x, hidden states [n, H]; q and k [..., heads, D] or [1, heads, n, D]; cos and signed sin broadcast
to them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..quantize import QuantizedLinear, joined
from .linear import bound_linear, short_blocks_linear
from .packed import FROM_ROWS, PackedJoined, PackedLinear, PackedQuantizedLinear, can_join, can_pack, can_pack_quantized


@dataclass(frozen=True)
class LayerForm:
    """What an architecture's decoder layer does beyond Llama's: RMSNorms over each head's q and k before
    RoPE (Qwen3, Gemma 3); Gemma's sandwich norms (the attention's and the MLP's outputs normed before their
    residual adds, the MLP's input by its own pre-feedforward norm); Gemma's norms scaling by (1 + w) in
    float32 before rounding to the model's dtype; RoPE tables per layer type (Gemma 3's local and global
    bases)."""

    qk_norms: bool = False
    sandwich: bool = False
    offset_norms: bool = False
    rope_per_layer_type: bool = False


LLAMA = LayerForm()
# architecture -> its layer form: the architectures hf/lean.py runs
FORMS = {"LlamaForCausalLM": LLAMA, "MistralForCausalLM": LLAMA, "Qwen2ForCausalLM": LLAMA,
         "Qwen3ForCausalLM": LayerForm(qk_norms=True),
         "Gemma3ForCausalLM": LayerForm(qk_norms=True, sandwich=True, offset_norms=True, rope_per_layer_type=True)}


def bound_module_linear(m: nn.Module, short_blocks: bool, packed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """A linear's forward without the module call: x [n, in] -> [n, out]. Holds references to the module's
    weights (plus a packed copy where hf/packed.py's path is on). short_blocks: multiply short blocks
    through the row kernel or weight-first (hf/linear.py); packed: blocks past hf/packed.py's row count through the weight
    packed for oneDNN. Both False: F.linear throughout, as HF's modules do."""
    if isinstance(m, QuantizedLinear):
        return PackedQuantizedLinear(m) if packed and can_pack_quantized(m) else m.bound_forward()
    if type(m) is not nn.Linear:
        raise TypeError(f"unsupported linear {type(m).__name__}")
    plain = short_blocks_linear(m.weight, m.bias) if short_blocks else bound_linear(m.weight, m.bias)
    if packed and can_pack(m.weight):
        return PackedLinear(m, plain)
    return plain


class LeanLayer:
    """One decoder layer's forwards, bound once. q/k/v and gate/up as one product each where they join: a
    quantized draft's under fused (quantize.joined; fused also takes torch's RMSNorm), or packed weights
    (packed, hf/packed.py PackedJoined; for float32 only blocks of long_from rows or more, in qkv_long and
    gate_up_long, shorter ones through q, k, v, gate and up): qkv [n, H] -> [n, (Hq + 2 Hkv) * D]
    and gate_up [n, H] -> [n, 2 I] (gate's I columns first), with q, k, v, gate and up None; else qkv and
    gate_up are None."""

    def __init__(self, layer, short_blocks: bool, packed: bool, fused: bool = False, form: LayerForm = LLAMA,
                 rope_key: str = "default"):
        attn, mlp = layer.self_attn, layer.mlp
        lin = lambda m: None if m is None else bound_module_linear(m, short_blocks, packed)  # noqa: E731
        qkv, gate_up = (joined([attn.q_proj, attn.k_proj, attn.v_proj]) if fused else None,
                        joined([mlp.gate_proj, mlp.up_proj]) if fused else None)
        self.qkv, self.gate_up = lin(qkv), lin(gate_up)
        # packed weights: q/k/v and gate/up joined (PackedJoined) for every block where every block is packed
        # (bfloat16), else for blocks of long_from rows or more, shorter ones part by part off the packed path
        qkv_parts, gate_up_parts = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
        self.qkv_long = self.gate_up_long = None
        self.long_from = 0
        if packed and qkv is None and gate_up is None and can_join(qkv_parts) and can_join(gate_up_parts):
            self.long_from = FROM_ROWS[attn.q_proj.weight.dtype]
            both = PackedJoined(qkv_parts), PackedJoined(gate_up_parts)
            if self.long_from == 1:
                self.qkv, self.gate_up = both
            else:
                self.qkv_long, self.gate_up_long = both
        short = (lambda m: bound_module_linear(m, short_blocks, False)) if self.qkv_long is not None else lin  # noqa: E731
        self.q, self.k, self.v = (None, None, None) if self.qkv is not None else (short(m) for m in qkv_parts)
        self.gate, self.up = (None, None) if self.gate_up is not None else (short(m) for m in gate_up_parts)
        self.inter = mlp.gate_proj.out_features
        self.o, self.down = lin(attn.o_proj), lin(mlp.down_proj)
        self.act = mlp.act_fn.forward  # the module's own forward, without the module call
        norm = (lambda m: norm_forward(m, fused, form.offset_norms))  # noqa: E731
        # norm1 before attention, norm2 before the MLP; Gemma's sandwich also norms each one's output
        self.norm1 = norm(layer.input_layernorm)
        self.norm2 = norm(layer.pre_feedforward_layernorm if form.sandwich else layer.post_attention_layernorm)
        self.attn_out_norm, self.mlp_out_norm = ((norm(layer.post_attention_layernorm),
                                                  norm(layer.post_feedforward_layernorm)) if form.sandwich else (None, None))
        self.q_norm, self.k_norm = (norm(attn.q_norm), norm(attn.k_norm)) if form.qk_norms else (None, None)
        self.rope_key = rope_key  # which of the runner's RoPE tables this layer's positions take
        self.scaling = attn.scaling
        # Qwen2 sets it per layer on the module; Mistral passes its config's to the attention function
        self.sliding_window = (attn.sliding_window if hasattr(attn, "sliding_window")
                               else getattr(attn.config, "sliding_window", None))

    def joined(self, n: int) -> tuple:
        """(qkv, gate_up) for a block of n rows: each joined product where it serves n rows, else None."""
        long = n >= self.long_from
        return (self.qkv if self.qkv is not None else self.qkv_long if long else None,
                self.gate_up if self.gate_up is not None else self.gate_up_long if long else None)


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm, bit for bit: weight * (h * rsqrt(mean(h ** 2) + eps)) with h = x in
    float32, in five ops instead of seven (h * h is pow(h, 2)'s own kernel; the sum and the scale in place
    where no copy is shared; weight * h == h * weight exactly)."""
    h = x.float()
    h = h * torch.rsqrt(torch.mean(h * h, -1, keepdim=True).add_(norm.variance_epsilon))
    h = h.to(x.dtype)
    return h.mul_(norm.weight) if norm.weight.dtype == h.dtype else norm.weight * h


def offset_rms_norm(scale: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    """transformers' Gemma3RMSNorm, bit for bit, with scale = 1 + weight in float32 computed once: the norm
    in float32, times scale, then rounded to x's dtype (Llama rounds before the weight)."""
    h = x.float()
    h = h * torch.rsqrt(torch.mean(h * h, -1, keepdim=True).add_(eps))
    return (h * scale).to(x.dtype)


def norm_forward(norm: nn.Module, fused: bool, offset: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [..., H] -> [..., H]: HF's RMSNorm op for op (rms_norm), or fused: torch's F.rms_norm with the weight
    and epsilon looked up once (other rounding: drafts only). offset: Gemma's (1 + w) norm (offset_rms_norm),
    fused or not."""
    if offset:
        scale, eps = 1.0 + norm.weight.float(), norm.eps
        return lambda x: offset_rms_norm(scale, eps, x)
    if not fused:
        return lambda x: rms_norm(norm, x)
    weight, eps = norm.weight, norm.variance_epsilon
    return lambda x: F.rms_norm(x, weight.shape, weight, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin, bit for bit, in four ops instead of seven: rotate_half(x) * sin
    is roll(x) * sin with sin's first half negated ((-a) * b == a * (-b) exactly)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
