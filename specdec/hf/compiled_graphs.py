"""What the compiled step's graphs compute (hf/compiled.py compiles them, per bucket): a Llama-family layer's
arithmetic between attentions, each weight product in the form this machine multiplies short blocks best.

`_pre` (input norm, q/k/v, RoPE), `_post` (o projection, residual, norm, MLP, residual), `_mid` (a layer's
_post fused with the next layer's _pre) and `_last` (the last layer's _post, the final norm, the LM head);
`make_graphs` compiles one set. The same layer runs as one C++ call in kernels/cpu_layer.py where that
kernel runs (hf/compiled.py's layer_kernel_takes); `kernel_layer_args` gathers a layer's tensors for it,
in any of hf/lean_layer.py's forms (the graphs cover Llama's alone: Qwen3 and Gemma 3 only through the
kernel), and `unsupported_reason` says what neither covers.

Shapes: x, the hidden states [B, H] (B the bucket); q [B, Hq, D], k and v [B, Hkv, D]; att [B, Hq * D];
cos, sin [B, 1, D]; logits [B, V] float32; p, a layer's 12 tensors (_layer_params).
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels import cpu_layer, cpu_rows
from . import linear
from .lean_layer import FORMS, LLAMA, LayerForm, rope

# how a block's products multiply, by its rows: (most rows through specdec's row kernel, most rows as
# inductor reductions, most rows weight-first). Where MKL's own short-block products are slow (the
# weight-first rule's machines, hf/linear.py) and the row kernel builds (kernels/cpu_rows.py), it takes
# every bucket up to its 16 rows, float32 or bfloat16. Without it, a float32 block there (measured: AMD
# EPYC, 2 threads, a whole SmolLM2 step): 1 row 34 ms as reductions against 73 through F.linear; 2 rows 53
# against 60 weight-first; 4 rows 67 weight-first against 97 as reductions or F.linear; 8 rows 104 against
# 154 (F.linear) and 184 (reductions); 16 rows 104 against 149: WEIGHT_FIRST_FORM.
# NO_FORM: every product through F.linear (inductor calls the BLAS), as elsewhere.
NO_FORM = (0, 0, 0)
WEIGHT_FIRST_FORM = (0, 2, 16) if linear.WEIGHT_FIRST_MAX_ROWS > 0 else NO_FORM


def product_form(weight: torch.Tensor) -> tuple:
    """The form (above) of a model whose weights are like this one (its LM head's)."""
    if linear.row_kernel_takes(weight):
        return (linear.kernel_rows(weight), 0, 0)
    return WEIGHT_FIRST_FORM if weight.device.type == "cpu" and weight.dtype == torch.float32 else NO_FORM


ACTIVATIONS = {"silu": F.silu}


def _product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, form: tuple) -> torch.Tensor:
    """x [B, in] @ w [out, in]ᵀ (+ bias) -> [B, out], in the form product_form gives for B rows: the row
    kernel, one reduction per row (inductor fuses them into one loop over w), weight-first (w @ xᵀ), or
    F.linear."""
    kernel_rows, gemv_rows, weight_first_rows = form
    if x.shape[0] <= kernel_rows:
        return cpu_rows.rows_linear(x, w, bias)
    if x.shape[0] <= gemv_rows:
        y = torch.stack([(x[j] * w).sum(-1) for j in range(x.shape[0])])
    elif x.shape[0] <= weight_first_rows:
        y = torch.mm(w, x.t()).t()
    else:
        return F.linear(x, w, bias)
    return y if bias is None else y + bias


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _pre(x, p, cos, sin, dims, g):
    """Input norm, q/k/v and RoPE of one layer: x [B, H] -> q [B, Hq, D], k, v [B, Hkv, D]."""
    Hq, Hkv, D, eps = dims
    h = _rms(x, p[0], eps)
    q = _product(h, p[1], p[2], g).view(-1, Hq, D)
    k = _product(h, p[3], p[4], g).view(-1, Hkv, D)
    v = _product(h, p[5], p[6], g).view(-1, Hkv, D)
    return rope(q, cos, sin), rope(k, cos, sin), v


def _post(att, x, p, eps, act, g):
    """o projection, residual, norm, MLP, residual: att [B, Hq * D], x [B, H] -> x [B, H]."""
    x = x + _product(att, p[7], None, g)
    h = _rms(x, p[8], eps)
    return x + _product(ACTIVATIONS[act](_product(h, p[9], None, g)) * _product(h, p[10], None, g), p[11], None, g)


def _mid(att, x, p, p_next, cos, sin, dims, act, g):
    x = _post(att, x, p, dims[3], act, g)
    return (x, *_pre(x, p_next, cos, sin, dims, g))


def _last(att, x, p, final_norm, head, eps, act, g):
    """The last layer's _post, the final norm and the LM head: -> x [B, H], normed [B, H], logits [B, V]."""
    x = _post(att, x, p, eps, act, g)
    normed = _rms(x, final_norm, eps)
    return x, normed, _product(normed, head, None, g).float()


def _layer_params(layer) -> tuple:
    """The 12 tensors of one Llama-family decoder layer, in _pre/_post's order (biases may be None)."""
    a, m = layer.self_attn, layer.mlp
    return (layer.input_layernorm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias,
            a.v_proj.weight, a.v_proj.bias, a.o_proj.weight, layer.post_attention_layernorm.weight,
            m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)


def make_graphs(tag: int) -> dict:
    """'pre', 'mid', 'last' compiled, each from a code object of its own (named with `tag`). Dynamo keeps one
    cache per code object and refuses to compile past its recompile limit (8; a setting that, in this
    torch, holds only for the thread that sets it): with the module's functions shared, a process that runs
    a few models' buckets would exhaust it. One model and dtype needs at most len(BUCKETS) entries each.
    Inductor's on-disk cache serves the same graphs to the next process whatever the name."""
    graphs = {}
    for name, fn in (("pre", _pre), ("mid", _mid), ("last", _last)):
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
        fresh = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        graphs[name] = torch.compile(fresh, dynamic=False, fullgraph=True)
    return graphs


def activation_of(cfg) -> str | None:
    """The MLP's activation name (Gemma's configs call it hidden_activation)."""
    return getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None)


def norm_eps(norm: nn.Module, form: LayerForm) -> float:
    """An RMSNorm's epsilon: Gemma's norms keep it as eps, Llama's as variance_epsilon."""
    return norm.eps if form.offset_norms else norm.variance_epsilon


def _norms(layer, form: LayerForm) -> list:
    """Every RMSNorm of a decoder layer of this form."""
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if form.qk_norms:
        norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    if form.sandwich:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    return norms


def unsupported_reason(model) -> str | None:
    """Why the compiled step cannot run this model (None: it can). hf/lean.py decides the architecture; a
    form other than Llama's runs only where the layer kernel does (hf/compiled.py checks that)."""
    form = FORMS.get(type(model).__name__, LLAMA)
    cfg = model.config.get_text_config()
    act = activation_of(cfg)
    if act not in (ACTIVATIONS if form == LLAMA else cpu_layer.ACTIVATIONS):
        return f"activation {act!r}"
    inner = model.model
    eps = {norm_eps(inner.norm, form)} | {norm_eps(n, form) for layer in inner.layers for n in _norms(layer, form)}
    if len(eps) != 1:
        return "norms with different epsilons"
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        if any(type(l) is not nn.Linear for l in linears) or any(l.bias is not None for l in linears[3:]):
            return "a linear that is not a plain nn.Linear (quantized?), or a bias on o/MLP projections"
    if type(model.lm_head) is not nn.Linear or model.lm_head.bias is not None:
        return "an LM head that is not a plain bias-free nn.Linear"
    if next(model.parameters()).dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {next(model.parameters()).dtype}"
    return None


def kernel_layer_args(layer, form: LayerForm, activation: str) -> tuple[tuple, tuple, dict]:
    """A decoder layer's tensors as kernels/cpu_layer.py's decoder_layer takes them: its 9 weights (the MLP's
    input norm: Gemma's pre-feedforward norm, else the post-attention one), its q/k/v biases (None where
    absent) and the keyword arguments of its form (q/k norms, sandwich norms, (1 + w) norms, activation)."""
    a, m = layer.self_attn, layer.mlp
    mlp_norm = layer.pre_feedforward_layernorm if form.sandwich else layer.post_attention_layernorm
    weights = (layer.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
               mlp_norm.weight, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)
    extras: dict = {}
    if form.qk_norms:
        extras.update(q_norm=a.q_norm.weight, k_norm=a.k_norm.weight)
    if form.sandwich:
        extras.update(attn_out_norm=layer.post_attention_layernorm.weight,
                      mlp_out_norm=layer.post_feedforward_layernorm.weight)
    if form != LLAMA:
        extras.update(offset_norms=form.offset_norms, activation=activation)
    return weights, (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias), extras
