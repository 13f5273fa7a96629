"""One Llama-family decoder layer of a decode or verification step (1 to 32 tokens) in one call, on x86 CPUs
with AVX2 and FMA (cpu_layer.cpp): norm, q/k/v, RoPE, the KV page write and attention, o, residual, norm,
SwiGLU MLP, residual; with the parts Qwen3 and Gemma 3 add where asked (per-head q/k norms, Gemma's sandwich
and (1 + w) norms, GELU (tanh)).

Why: with the step's products at the memory's pace (cpu_rows.py) and its attention one call
(cpu_attention.py), the compiled step (hf/compiled.py) still paid per layer for the machinery around them:
an inductor graph's guards, its wrapper and the Python calls of the ops inside it. The kernel runs the layer
from one call, the products through the row kernel's code, the attention through the attention kernel's,
the small ops in between as 8-lane loops. Values are rounded to the model's dtype where the graphs and HF's
modules store them (decoder_layer_ref is the same layer in torch). On an AMD EPYC (2 threads,
benchmarks/results/compiled_step_amd_epyc.md) a float32 SmolLM2 token took 19.6 ms against 29.8 through the
graphs (its weights alone: 17.4), a bfloat16 one 14.1 against 21.1.

Built and loaded with the other CPU kernels (kernels/cpu_library.py: call its `load()` first). The op is
`torch.ops.specdec_cpu.decoder_layer`; it mutates the page tensors it is given (declared in its schema).

Shapes: x [n, H] float32 or bfloat16; weights (9, x's dtype, contiguous): input norm [H], q [Hq * D, K],
k, v [Hkv * D, K], o [H, Hq * D], post-attention norm [H], gate, up [I, H], down [H, I]; qkv_bias: three
of [out] or None; cos, sin [n, D] (hf/lean.py's table: sin's first half negated); k_pages, v_pages
[S, Hkv, D]; write_slots [n], read_slots [T] int64; mask [n, T] bool or None; qkv_input [n, K] or None
(what q, k, v multiply instead of the input norm of x: EAGLE-3's midlayer, K = 2H); q_norm, k_norm [D] or
None (both or neither); attn_out_norm, mlp_out_norm [H] or None (both or neither: Gemma's sandwich, the
post-attention weight then the pre-feedforward norm); offset_norms (Gemma's (1 + w) norms); activation
"silu" or "gelu_pytorch_tanh" -> [n, H].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_attention, cpu_rows

# the most tokens a call takes: the compiled step's largest bucket (a 16-node tree's 17-token verification and
# any forward up to 32 tokens); longer ones (prefill) take the graphs or the lean loop. Its products run the row
# kernel's code at any row count (8- and 4-row chunks past 8 and 6 rows: cpu_rows.h); past 16 rows a product
# alone can be slower than the BLAS's (bfloat16 on oneDNN with AVX512-BF16: 0.8-1.35x at 32 rows), but the whole
# layer is not: a SmolLM2 forward (AMD EPYC Zen 4, 2 threads, in-process A/B) over 17 tokens took 27 ms in
# bfloat16 against 53 through the graphs, 43 against 68 in float32; 32 tokens 45 against 56 and 67 against 70
MAX_ROWS = 32


def decoder_layer(x, weights, qkv_bias, cos, sin, k_pages, v_pages, write_slots, read_slots, mask, scale: float,
                  eps: float, heads: int, kv_heads: int, qkv_input=None, q_norm=None, k_norm=None,
                  attn_out_norm=None, mlp_out_norm=None, offset_norms: bool = False,
                  activation: str = "silu") -> torch.Tensor:
    """The layer (module docstring; call cpu_library.load() first)."""
    return torch.ops.specdec_cpu.decoder_layer(x, weights, qkv_bias, cos, sin, k_pages, v_pages, write_slots,
                                               read_slots, mask, scale, eps, heads, kv_heads, qkv_input, q_norm,
                                               k_norm, attn_out_norm, mlp_out_norm, offset_norms, activation)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, offset_norms: bool = False) -> torch.Tensor:
    """x [n, H] -> each row's RMS norm times weight [H] (offset_norms: Gemma's (1 + w)), in x's dtype: the layer
    kernel's own norm as one op (the compiled step's final norm); reference: _rms."""
    return torch.ops.specdec_cpu.rms_norm_rows(x, weight, eps, offset_norms)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).to(x.dtype) if offset else w * h.to(x.dtype)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}


def decoder_layer_ref(x, weights, qkv_bias, cos, sin, k_pages, v_pages, write_slots, read_slots, mask, scale,
                      eps, heads, kv_heads, qkv_input=None, q_norm=None, k_norm=None, attn_out_norm=None,
                      mlp_out_norm=None, offset_norms: bool = False, activation: str = "silu") -> torch.Tensor:
    """The kernel's reference in torch, HF's modules' arithmetic (the attention: cpu_attention's reference)."""
    n_in, wq, wk, wv, wo, n_post, wg, wu, wd = weights
    D = k_pages.shape[2]
    h = _rms(x, n_in, eps, offset_norms) if qkv_input is None else qkv_input
    q, k, v = (F.linear(h, w, b).view(x.shape[0], -1, D) for w, b in zip((wq, wk, wv), qkv_bias))
    if q_norm is not None:
        q, k = _rms(q, q_norm, eps, offset_norms), _rms(k, k_norm, eps, offset_norms)
    c, s = cos[:, None], sin[:, None]
    q, k = (t * c + t.roll(D // 2, -1) * s for t in (q, k))
    att = cpu_attention.attend_pages_ref(q, k, v, k_pages, v_pages, write_slots, read_slots, mask, scale)
    out = F.linear(att, wo)
    x = x + (out if attn_out_norm is None else _rms(out, attn_out_norm, eps, offset_norms))
    h = _rms(x, n_post, eps, offset_norms)
    out = F.linear(ACTIVATIONS[activation](F.linear(h, wg)) * F.linear(h, wu), wd)
    return x + (out if mlp_out_norm is None else _rms(out, mlp_out_norm, eps, offset_norms))
