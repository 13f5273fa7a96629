"""Weight-only int8 drafts: a draft's forward reads a quarter of the bytes of its float32 weights.

On a CPU (and for small drafts on any device) a draft step is bound by reading its weights, not by
arithmetic: draft-wide's float32 layer and LM head are 12 MB per token. A draft only proposes, so
its precision can change acceptance but never the output (the target verifies every token); that
makes the draft the one place a lossless runtime may quantize. `int8_draft(model)` returns a copy of
the model whose nn.Linear layers (LM head included) hold int8 weights with one scale per output row
and whose other parameters (embeddings, norms) are cast to the activation dtype; the caller's model
is untouched. Where the fused int8 kernel (`torch._weight_int8pack_mm`) is missing the layer
dequantizes on the fly: same numbers, slower.

Shapes: Int8Linear.forward x [..., in_features] -> [..., out_features] (in the activation dtype).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


FUSED_IN_MULTIPLE = 16  # in_features the fused kernel handles (see Int8Linear)


def _fused_kernel_works(device: torch.device, dtype: torch.dtype) -> bool:
    op = getattr(torch, "_weight_int8pack_mm", None)
    if op is None:
        return False
    try:  # shapes like a small draft's: a kernel may support some dtype/device pairs only
        x = torch.ones(2, 64, dtype=dtype, device=device)
        w = torch.ones(32, 64, dtype=torch.int8, device=device)
        s = torch.full((32,), 0.5, dtype=dtype, device=device)
        return bool(torch.allclose(op(x, w, s).float(), torch.full((2, 32), 32.0, device=device)))
    except (RuntimeError, NotImplementedError):
        return False


class Int8Linear(nn.Module):
    """y = x @ (q * scale[:, None]).T + bias, with q int8 [out, in] and scale [out] (symmetric, per row)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, fused: bool):
        super().__init__()
        w = linear.weight.detach().float()
        amax = w.abs().amax(dim=1).clamp_min(1e-12)
        # the scale is stored in `dtype`: round it there first (never below amax / 127, so no weight clips)
        scale = (amax / 127.0).to(dtype).float()
        scale = torch.where(scale * 127.0 < amax, scale * (1 + 2.0 ** -7), scale).to(dtype).float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))
        # the CPU kernel gives wrong sums (and can crash) unless in_features is a multiple of 16 (torch 2.13,
        # measured: 8, 24, 40, 56, 72 wrong; 16, 32, 48, 64, 96 right): such layers dequantize instead
        self.fused = fused and self.in_features % FUSED_IN_MULTIPLE == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_2d(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, in_features] -> [n, out_features], in the activation dtype."""
        x = x.to(self.scale.dtype)
        if self.fused:
            y = torch._weight_int8pack_mm(x, self.qweight, self.scale)
        else:
            y = F.linear(x, self.qweight.to(x.dtype) * self.scale[:, None])
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused={self.fused}"


def int8_draft(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A copy of `model` for drafting: int8 weight-only linears, everything else in `dtype`.

    dtype: the activation dtype (bfloat16 or float16; the fused CPU kernel needs one of them). The
    copy's logits come out in `dtype`; specdec casts them to float32 before any softmax.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int8 drafts compute in bfloat16 or float16, got {dtype}")
    device = next(model.parameters()).device
    fused = _fused_kernel_works(device, dtype)
    out = copy.deepcopy(model)
    # untie first: a tied LM head is the embedding matrix, which must stay a float lookup table
    out.config.tie_word_embeddings = False
    if hasattr(out.config, "get_text_config"):
        out.config.get_text_config().tie_word_embeddings = False
    out.to(dtype)
    linears = [(name, mod) for name, mod in out.named_modules() if isinstance(mod, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers to quantize")
    for name, mod in linears:
        parent_name, _, child = name.rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        setattr(parent, child, Int8Linear(mod, dtype, fused))
    return out.eval()
