"""The feature head's layers over entries of its paged KV (drafting, not training): one CPU layer-kernel call
a layer where the kernel runs, else the layers' torch modules.

Why: a draft token of SmolLM2's head read its ~34 MB of weights in about 2.7 ms on a 2-core AMD EPYC, half of
it in the torch ops between the products (norms, RoPE, the KV write and gather, SDPA, SiLU); the target's own
layers already run as one kernels/cpu_layer.py call each. The head's decoder layer is a Llama layer (eagle) or
EAGLE-3's midlayer, which the kernel takes with its q / k / v input given ([norm(embedding) | norm(hidden)],
2H wide) and the hidden as the residual. Its numbers differ from the torch path's in the last bits (another
summation order): a draft's numbers move only its acceptance, never the target's output.

Shapes: feats [n, H] (projected target features or predicted ones), tokens [n] int64, positions [n] int64;
write_slots [n], read_slots [R] int64 slots of `kv` (a cache.PagedKV); mask [n, R] bool or None (every read
slot visible) -> what the layers emit [n, H] (HeadNet.emit).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..kernels import cpu_layer, cpu_library
from .head_model import HeadNet


def layer_kernel_takes(net: HeadNet, x: torch.Tensor) -> bool:
    """Do the head's layers run as kernels/cpu_layer.py calls for this input x [n, H or 2H]? On a CPU, float32
    or bfloat16 weights of x's dtype, head dimension a multiple of 8, at most cpu_layer.MAX_ROWS entries, no
    gradient wanted, where the CPU kernels load; EAGLE-3 with its one midlayer. SPECDEC_HEAD_KERNEL=0 keeps the
    torch path."""
    c = net.config
    weight = net.layers[0].o_proj.weight
    if os.environ.get("SPECDEC_HEAD_KERNEL", "") == "0" or x.device.type != "cpu" or x.shape[0] > cpu_layer.MAX_ROWS:
        return False
    if weight.dtype not in (torch.float32, torch.bfloat16) or x.dtype != weight.dtype or c.head_dim % 8:
        return False
    if torch.is_grad_enabled() and weight.requires_grad or (net.eagle3 and len(net.layers) != 1):
        return False
    return cpu_library.load() is None


def run_head(net: HeadNet, kv, feats, tokens, positions, write_slots, read_slots, mask) -> torch.Tensor:
    """The head's layers over entries (module docstring). One sequence's entries, or a batch's packed with a
    block-diagonal mask (drafters/feature_head.py, drafters/head_rows.py)."""
    x = net.inputs(feats, tokens)  # [n, H] (eagle3: [n, 2H])
    cos, sin = net.rope(positions, x.dtype)  # [n, D]
    if layer_kernel_takes(net, x):
        return net.emit(_kernel_layers(net, kv, x, cos, sin, write_slots, read_slots, mask))
    x, cos, sin = x[None], cos[None, None], sin[None, None]
    attn_mask = None if mask is None else mask[None, None]
    for i, layer in enumerate(net.layers):
        q, k, v = layer.qkv(x, cos, sin)
        kv.write(i, write_slots, k, v)
        keys, vals = kv.gather(i, read_slots)
        att = F.scaled_dot_product_attention(q, keys, vals, attn_mask=attn_mask, enable_gqa=layer.hq != layer.hkv)
        x = layer.finish(x, att.transpose(1, 2).reshape(1, x.shape[1], -1))
    return net.emit(x[0])


def _kernel_layers(net: HeadNet, kv, x, cos, sin, write_slots, read_slots, mask) -> torch.Tensor:
    """x [n, H] (eagle3: [n, 2H]) through every layer, one decoder_layer call each -> [n, H]."""
    c = net.config
    half = c.head_dim // 2
    signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # hf/lean.py's table
    qkv_input = None
    if net.eagle3:  # the midlayer: q, k, v over [norm(embedding) | norm(hidden)], the hidden as the residual
        qkv_input = net.layers[0].qkv_input(x)
        x = x.chunk(2, dim=-1)[1]
    x = x.contiguous()
    for i, layer in enumerate(net.layers):
        weights = [layer.input_layernorm.weight, layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight,
                   layer.o_proj.weight, layer.post_attention_layernorm.weight, layer.gate_proj.weight,
                   layer.up_proj.weight, layer.down_proj.weight]
        k_pages, v_pages = kv.pages(i, layer.hkv, layer.d, x.dtype)
        x = cpu_layer.decoder_layer(x, weights, [None, None, None], cos, signed_sin, k_pages, v_pages, write_slots,
                                    read_slots, mask, layer.d ** -0.5, c.rms_eps, layer.hq, layer.hkv,
                                    qkv_input=qkv_input)
    return x
