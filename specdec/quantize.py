"""Weight-only int8 and int4 drafts: a draft's forward reads a quarter (an eighth) of the bytes of its
float32 weights.

On a CPU (and for small drafts on any device) a draft step is bound by reading its weights, not by
arithmetic: draft-wide's float32 layer and LM head are 12 MB per token. A draft only proposes, so
its precision can change acceptance but never the output (the target verifies every token); that
makes the draft the one place a lossless runtime may quantize. `int8_draft(model)` returns a copy of
the model whose nn.Linear layers (LM head included) hold int8 weights with one scale per output row
and whose other parameters (embeddings, norms) are cast to the activation dtype; the caller's model
is untouched. Where the fused int8 kernel (`torch._weight_int8pack_mm`) is missing the layer
dequantizes on the fly: same numbers, slower.

`int4_draft(model)` does the same with 4-bit weights in groups of `group_size` inputs (a scale and a
zero per group and output row, rounded to nearest) through `torch._weight_int4pack_mm_for_cpu`. Both
kernels stream a cold weight at about the same bytes per second on this project's Xeon (11.6 and 11.7
GB/s, 2 threads), so int4 halves the products' time: a SmolLM2-135M draft token 25 -> 18 ms in text
mode across tokenizers, at 2-3 % lower acceptance (README: int4 drafts). Layers whose inputs do not
split into whole groups, or where the kernel is missing or gives other sums than the dequantized
weight (checked per layer when it is built), keep int8.

Shapes: QuantizedLinear.forward x [..., in_features] -> [..., out_features] (in the activation dtype).
"""
from __future__ import annotations

import copy
import weakref
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


FUSED_IN_MULTIPLE = 16  # in_features the fused kernel handles (see Int8Linear)
INT4_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes the CPU int4 kernel takes


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


class QuantizedLinear(nn.Module):
    """A weight-only quantized linear (int8 or int4 weights, activations in a float dtype).

    forward_2d(x [n, in]) -> [n, out] in act_dtype; dequantized() -> the weight [out, in] in act_dtype, the
    numbers forward_2d multiplies by; weight_state() -> the tensors whose change makes a new weight (what
    hf/packed.py keys its cached copy on)."""

    in_features: int
    out_features: int
    fused: bool

    @property
    def act_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_2d(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def bound_forward(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """forward_2d with this layer's tensors looked up now, not per call (a module attribute lookup costs
        about a microsecond; a draft token makes hundreds): for a runner built per generation."""
        return self.forward_2d

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    def weight_state(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused={self.fused}"


class Int8Linear(QuantizedLinear):
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

    @property
    def act_dtype(self) -> torch.dtype:
        return self.scale.dtype

    def forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, in_features] -> [n, out_features], in the activation dtype."""
        x = x.to(self.scale.dtype)
        if self.fused:
            y = torch._weight_int8pack_mm(x, self.qweight, self.scale)
        else:
            y = F.linear(x, self.qweight.to(x.dtype) * self.scale[:, None])
        return y if self.bias is None else y + self.bias

    def bound_forward(self) -> Callable[[torch.Tensor], torch.Tensor]:
        if not self.fused:
            return self.forward_2d
        w, scale, bias, mm = self.qweight, self.scale, self.bias, torch._weight_int8pack_mm
        if bias is None:
            return lambda x: mm(x.to(scale.dtype), w, scale)
        return lambda x: mm(x.to(scale.dtype), w, scale) + bias

    def dequantized(self) -> torch.Tensor:
        return (self.qweight.float() * self.scale.float()[:, None]).to(self.act_dtype)

    def weight_state(self) -> tuple[torch.Tensor, ...]:
        return self.qweight, self.scale

    @classmethod
    def _join(cls, parts: list["Int8Linear"]) -> "Int8Linear":
        m = _bare(cls, parts)
        m.register_buffer("qweight", torch.cat([p.qweight for p in parts]))
        m.register_buffer("scale", torch.cat([p.scale for p in parts]))
        return m


class Int4Linear(QuantizedLinear):
    """y = x @ W.T + bias with W[o, i] = q[o, i] * scale[g, o] + low[g, o] for the group g = i // group_size:
    q in 0..15 (two per byte in `qweight` [out, in / 2], the even input in the low nibble), scale and low
    (the group's minimum) in bfloat16, rounded to nearest. The kernel's own layout of the same weights
    (`torch._convert_weight_to_int4pack_for_cpu`) is built at load and not saved."""

    def __init__(self, linear: nn.Linear, group_size: int):
        super().__init__()
        w = linear.weight.detach().float()
        out_f, in_f = w.shape
        if type(group_size) is not int or group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES} (the int4 kernel's), got {group_size!r}")
        if in_f % group_size:
            raise ValueError(f"int4 groups of {group_size} inputs do not split in_features={in_f}")
        self.in_features, self.out_features, self.group_size = in_f, out_f, group_size
        groups = w.reshape(out_f, in_f // group_size, group_size)
        low = groups.amin(-1).to(torch.bfloat16).float()  # [out, G]
        scale = ((groups.amax(-1) - low).clamp_min(1e-8) / 15).to(torch.bfloat16).float()
        q = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8).reshape(out_f, in_f)
        self.register_buffer("qweight", q[:, 0::2] | (q[:, 1::2] << 4))
        self.register_buffer("scale", scale.t().contiguous().to(torch.bfloat16))  # [G, out]
        self.register_buffer("low", low.t().contiguous().to(torch.bfloat16))  # [G, out]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))
        self.fused = False
        self.register_buffer("kernel_weight", None, persistent=False)
        self.register_buffer("kernel_scales", None, persistent=False)
        self._try_kernel(q.to(torch.int32))

    def _try_kernel(self, q: torch.Tensor) -> None:
        """Use the fused kernel if it exists here and gives this layer the dequantized weight's sums."""
        if self.qweight.device.type != "cpu" or getattr(torch, "_weight_int4pack_mm_for_cpu", None) is None:
            return
        try:
            packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
            # the kernel computes (q - 8) * scale + zero: zero = low + 8 * scale
            zeros = self.low.float() + 8 * self.scale.float()
            scales = torch.stack((self.scale, zeros.to(torch.bfloat16)), -1).contiguous()  # [G, out, 2]
            x = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            got = torch._weight_int4pack_mm_for_cpu(x, packed, self.group_size, scales).float()
        except (RuntimeError, NotImplementedError):
            return
        want = x.float() @ self.dequantized().float().t()
        if got.shape == want.shape and torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-3):
            self.kernel_weight, self.kernel_scales, self.fused = packed, scales, True

    @property
    def act_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, in_features] -> [n, out_features] in bfloat16."""
        x = x.to(torch.bfloat16)
        if self.fused:
            y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.kernel_weight, self.group_size, self.kernel_scales)
        else:
            y = F.linear(x, self.dequantized())
        return y if self.bias is None else y + self.bias

    def bound_forward(self) -> Callable[[torch.Tensor], torch.Tensor]:
        if not self.fused:
            return self.forward_2d
        w, scales, size, bias = self.kernel_weight, self.kernel_scales, self.group_size, self.bias
        mm, bf16 = torch._weight_int4pack_mm_for_cpu, torch.bfloat16
        if bias is None:
            return lambda x: mm(x.to(bf16).contiguous(), w, size, scales)
        return lambda x: mm(x.to(bf16).contiguous(), w, size, scales) + bias

    def dequantized(self) -> torch.Tensor:
        q = torch.stack((self.qweight & 15, self.qweight >> 4), -1).reshape(self.out_features, -1).float()
        groups = q.reshape(self.out_features, -1, self.group_size)
        w = groups * self.scale.t().float()[..., None] + self.low.t().float()[..., None]
        return w.reshape(self.out_features, self.in_features).to(torch.bfloat16)

    def weight_state(self) -> tuple[torch.Tensor, ...]:
        return self.qweight, self.scale, self.low

    @classmethod
    def _join(cls, parts: list["Int4Linear"]) -> "Int4Linear":
        m = _bare(cls, parts)
        m.group_size = parts[0].group_size
        m.register_buffer("qweight", torch.cat([p.qweight for p in parts]))
        for name in ("scale", "low"):  # [G, out]
            m.register_buffer(name, torch.cat([getattr(p, name) for p in parts], 1).contiguous())
        # the kernel's layout blocks output rows (concatenating parts of 32 rows misplaces them): packed anew
        q = torch.stack((m.qweight & 15, m.qweight >> 4), -1).reshape(m.out_features, m.in_features)
        m.register_buffer("kernel_weight", torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1),
                          persistent=False)
        m.register_buffer("kernel_scales", torch.cat([p.kernel_scales for p in parts], 1).contiguous(),
                          persistent=False)  # [G, out, 2]
        return m


def _bare(cls, parts: list[QuantizedLinear]) -> QuantizedLinear:
    """An empty `cls` shaped like `parts` side by side, with their bias; the caller adds the weights."""
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    m.in_features, m.out_features, m.fused = parts[0].in_features, sum(p.out_features for p in parts), True
    m.register_buffer("bias", None if parts[0].bias is None else torch.cat([p.bias for p in parts]))
    return m


# first part -> (the parts and their weights' identity when joined, the joined linear)
_joined: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, QuantizedLinear]]" = weakref.WeakKeyDictionary()


def joined(parts: list[nn.Module]) -> QuantizedLinear | None:
    """One quantized linear whose outputs are the parts' outputs side by side: x [n, in] -> [n, sum of the
    parts' out_features], each column the sums its part computes, in one kernel call instead of len(parts).
    A draft's q, k and v (and gate and up) projections read the same input: a SmolLM2-135M int4 draft
    token makes 90 fewer calls. None where the parts cannot join: not all fused Int4Linear with one group
    size, or all fused Int8Linear in one dtype, or a bias on some parts only. Built once per set of parts
    (the weights are copied side by side: the parts' bytes once more), again if a part's weights change."""
    first = parts[0]
    kind = type(first)
    if kind not in (Int4Linear, Int8Linear) or any(
            type(p) is not kind or not p.fused or p.in_features != first.in_features
            or (p.bias is None) != (first.bias is None) or p.act_dtype != first.act_dtype
            or getattr(p, "group_size", None) != getattr(first, "group_size", None) for p in parts):
        return None
    key = tuple((id(p),) + tuple((t.data_ptr(), t._version) for t in p.weight_state()) for p in parts)
    hit = _joined.get(first)
    if hit is None or hit[0] != key:
        hit = _joined[first] = (key, kind._join(parts))
    return hit[1]


def _quantized_copy(model: nn.Module, dtype: torch.dtype, quantize) -> nn.Module:
    """A copy of `model` in `dtype` whose nn.Linear layers are replaced by quantize(linear)."""
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
        setattr(parent, child, quantize(mod))
    return out.eval()


def int8_draft(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A copy of `model` for drafting: int8 weight-only linears, everything else in `dtype`.

    dtype: the activation dtype (bfloat16 or float16; the fused CPU kernel needs one of them). The
    copy's logits come out in `dtype`; specdec casts them to float32 before any softmax.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int8 drafts compute in bfloat16 or float16, got {dtype}")
    fused = _fused_kernel_works(next(model.parameters()).device, dtype)
    return _quantized_copy(model, dtype, lambda linear: Int8Linear(linear, dtype, fused))


def int4_draft(model: nn.Module, group_size: int = 32) -> nn.Module:
    """A copy of `model` for drafting: int4 weight-only linears in groups of `group_size` inputs, computing
    in bfloat16 (the CPU kernel's dtype), everything else in bfloat16. A linear whose in_features is not
    a multiple of group_size, or that the int4 kernel cannot take (it needs out_features a multiple of
    16) or gets wrong, or on a device without it, is int8 instead (Int8Linear).
    """
    if type(group_size) is not int or group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES} (inputs per int4 scale; the kernel's), got "
                         f"{group_size!r}")
    fused8 = _fused_kernel_works(next(model.parameters()).device, torch.bfloat16)

    def quantize(linear: nn.Linear) -> QuantizedLinear:
        if linear.in_features % group_size == 0:
            q4 = Int4Linear(linear, group_size)
            if q4.fused:
                return q4
        return Int8Linear(linear, torch.bfloat16, fused8)

    return _quantized_copy(model, torch.bfloat16, quantize)
