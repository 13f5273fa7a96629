"""Linears through oneDNN with each weight packed once: on an Intel CPU, verifying a block of 4 to 8
tokens costs far less than MKL makes it cost, and a bfloat16 model's every forward gets cheaper.

Measured on an Intel Xeon (Sapphire Rapids, 2 threads; benchmarks/results/linear_rows*.md):
- float32: `F.linear` multiplies with MKL, which streams the weights at full bandwidth for 1 to 3 rows
  and reads them again for every further block of 3 rows: a Qwen2.5-Coder-1.5B forward over 4 tokens
  cost 1.9x one token, over 8 tokens 2.7x (SmolLM2-135M: 1.5x, 1.8x). oneDNN's matmul over a weight
  reordered once into its blocked layout reads it once for any short block: Qwen's 4 tokens then cost
  1.2x one, 8 tokens 1.45x (SmolLM2, whose small weights stay in cache: 1.35x, 1.6x). For 1 to 3 rows
  oneDNN is ~7% slower than MKL, so those stay on `F.linear`: packed from `FROM_ROWS[float32]` rows.
- bfloat16: `F.linear` already runs oneDNN, but reorders the weight on every call; packed once, the
  same kernel gives the same numbers (bit for bit, measured) in ~0.6x the time, for every row count
  (a whole Qwen forward, attention and norms included: 145 ms against 181 ms, for 1 to 8 tokens alike).
- an int8 draft (specdec/quantize.py): `torch._weight_int8pack_mm` converts every weight to bfloat16 as it
  multiplies, so its time grows with the rows (SmolLM2-135M: 20 ms for 1 token, 35 for 8, 48 for 16,
  191 ms for a 115-token prompt), where bfloat16 packed weights cost 27-31 ms for 1 to 16 rows and 60 ms
  for that prompt. A draft runs long blocks when it prefills the prompt and when it catches up on text it
  did not draft (after prompt lookup served a few steps, or a rejection): from `FROM_ROWS_INT8` rows those
  go through the weight dequantized once to bfloat16 and packed (a draft's numbers move only its
  acceptance; the copy holds the draft's weights once more, in bfloat16). An int4 draft's kernel stays
  ahead for longer: SmolLM2-135M 13.6 ms for 1 token, 16.8 for 4, 22.7 for 8, 28.7 for 12, 35.2 for 13
  against 27-31 ms packed, so from `FROM_ROWS_INT4` rows.

The cost is memory: a packed copy of every weight that takes this path, beside the model's own (which
HF's modules keep using), so the target's linear weights are held twice. `SPECDEC_PACKED_WEIGHTS=0`
turns the path off, `=1` forces it on for any CPU where torch has oneDNN. The rule is fixed per
machine: on for Intel CPUs (measured), off elsewhere (an AMD CPU's short float32 blocks go weight-first,
hf/linear.py; packing is not measured there).

Each weight is packed once: a cache keyed by the nn.Linear, checked against the weight's storage, shape
and version counter, so a runner per generation repacks nothing and a weight changed in place (or
replaced) is packed again. float32 results differ from `F.linear`'s in the last bits (the same sums in
another order), the same kind of difference as between HF's one-token and k-token forwards: the lean
loop's probe (hf/lean.py) certifies its operation order with this path off, and the target's greedy
output is checked against HF's own by the tests.

Shapes: x [n, in] (the weight's dtype), weight [out, in], bias [out] or None -> [n, out]; an int8 or
int4 linear: x [n, in] -> [n, out] in bfloat16.
"""
from __future__ import annotations

import contextlib
import functools
import os
import weakref
from typing import Callable

import torch
import torch.nn as nn

from ..quantize import Int4Linear, Int8Linear, QuantizedLinear
from ..kernels.cpu_info import cpu_vendor
from .mapped_offload import is_mapped_tensor

# the fewest rows a block needs to take the packed path, by weight dtype (other dtypes: never)
FROM_ROWS = {torch.float32: 4, torch.bfloat16: 1}
# the same for a quantized draft's linears (below it, the int8 / int4 kernel reads a quarter / an eighth of
# the bytes), by its class
FROM_ROWS_INT8 = 5
FROM_ROWS_INT4 = 13
FROM_ROWS_QUANTIZED = {Int8Linear: FROM_ROWS_INT8, Int4Linear: FROM_ROWS_INT4}


def packed_rule(vendor: str, onednn: bool, override: str | None = None) -> bool:
    """Does this machine multiply through packed weights? override: SPECDEC_PACKED_WEIGHTS's value
    ('1' on, '0' off, None or '' the rule)."""
    if override not in (None, "", "0", "1"):
        raise ValueError(f"SPECDEC_PACKED_WEIGHTS must be 0 or 1, got {override!r}")
    if not onednn:
        return False
    if override:
        return override == "1"
    return vendor == "GenuineIntel"


PACKED = packed_rule(cpu_vendor(), torch.backends.mkldnn.is_available(), os.environ.get("SPECDEC_PACKED_WEIGHTS"))


@contextlib.contextmanager
def packed_weights(on: bool = True):
    """Runners made inside take (on) or skip the packed path whatever the machine's rule: a process-wide
    switch for work that knows its blocks, as the head trainer's answer batches (64 rows a step: oneDNN's
    packed product against MKL's GEMM on an AMD CPU, where the rule is off). Not for concurrent generations."""
    global PACKED
    before, PACKED = PACKED, on and torch.backends.mkldnn.is_available()
    try:
        yield
    finally:
        PACKED = before


def describe() -> str:
    """For benchmark headers."""
    if not PACKED:
        return "packed weights off"
    return ("packed weights: " + ", ".join(f"{str(d).removeprefix('torch.')} from {n} rows" for d, n in FROM_ROWS.items())
            + f", int8 drafts from {FROM_ROWS_INT8} rows, int4 drafts from {FROM_ROWS_INT4} rows")


def _onednn_can_hold(weight: torch.Tensor) -> bool:
    """A 2-D weight on a CPU, with torch built with oneDNN: what packing needs besides the dtype."""
    return weight.device.type == "cpu" and weight.dim() == 2 and torch.backends.mkldnn.is_available()


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Does this CPU's oneDNN pack weights of `dtype`? bfloat16 needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT:
    on a CPU without them (an AMD EPYC with AVX2 only, seen here) the reorder raises; asked once, on a
    tiny weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def can_pack(weight: torch.Tensor) -> bool:
    """Can this weight take the packed path (float32 or bfloat16, 2-D, on a CPU, torch built with oneDNN,
    whose oneDNN packs that dtype on this CPU)? Not a disk-offloaded weight read in place
    (hf/mapped_offload.py): a packed copy would hold in memory what the user put on disk."""
    return (weight.dtype in FROM_ROWS and _onednn_can_hold(weight) and onednn_packs(weight.dtype)
            and not is_mapped_tensor(weight))


# nn.Linear or QuantizedLinear -> (what the weight was when packed, the packed weight); _joined: the first of
# a set of joined linears (PackedJoined) -> the same for their weights side by side
_packed: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, torch.Tensor]]" = weakref.WeakKeyDictionary()
_joined: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, torch.Tensor]]" = weakref.WeakKeyDictionary()


def _cached(module: nn.Module, tensors: tuple[torch.Tensor, ...], pack: Callable[[], torch.Tensor],
            cache=_packed) -> torch.Tensor:
    """module's packed weight: pack() once, again whenever one of `tensors` moved, changed shape or version."""
    key = tuple((t.data_ptr(), t._version, t.dtype, tuple(t.shape)) for t in tensors)
    hit = cache.get(module)
    if hit is not None and hit[0] == key:
        return hit[1]
    p = pack()
    cache[module] = (key, p)
    return p


def packed_weight(linear: nn.Linear) -> torch.Tensor:
    """linear.weight in oneDNN's blocked layout, packed once and reused while the weight is unchanged."""
    w = linear.weight
    if not can_pack(w):
        raise ValueError(f"only float32 or bfloat16 2-D weights on a CPU with oneDNN are packed, got {w.dtype} "
                         f"{tuple(w.shape)} on {w.device}")
    return _cached(linear, (w,), lambda: torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))


def can_pack_quantized(linear: QuantizedLinear) -> bool:
    """Can this quantized linear's weight, dequantized to its activation dtype, take the packed path?"""
    return (type(linear) in FROM_ROWS_QUANTIZED and linear.act_dtype == torch.bfloat16
            and _onednn_can_hold(linear.qweight) and onednn_packs(torch.bfloat16))


def packed_dequantized(linear: QuantizedLinear) -> torch.Tensor:
    """A quantized linear's weight, dequantized once to bfloat16 and packed; reused while its quantized
    tensors are unchanged."""
    if not can_pack_quantized(linear):
        raise ValueError(f"only int8 / int4 linears computing in bfloat16 on a CPU with oneDNN are packed, got "
                         f"{type(linear).__name__} in {linear.act_dtype} on {linear.qweight.device}")
    return _cached(linear, linear.weight_state(),
                   lambda: torch.ops.mkldnn._reorder_linear_weight(linear.dequantized(), None))


class PackedLinear:
    """x [n, in] -> [n, out]: blocks of FROM_ROWS[dtype] rows or more through the packed weight, shorter
    ones through `short` (x -> F.linear(x, weight, bias), or the weight-first product)."""

    def __init__(self, linear: nn.Linear, short: Callable[[torch.Tensor], torch.Tensor]):
        self.bias, self.short = linear.bias, short
        self.packed = packed_weight(linear)
        self.from_rows = FROM_ROWS[linear.weight.dtype]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.from_rows:
            return self.short(x)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def can_join(linears: list[nn.Linear]) -> bool:
    """Can these linears (reading one input) multiply as one packed product (PackedJoined)? nn.Linear all,
    packable, one dtype, one input width, a bias on all or none."""
    first = linears[0]
    return all(type(m) is nn.Linear and can_pack(m.weight) and m.weight.dtype == first.weight.dtype
               and m.in_features == first.in_features and (m.bias is None) == (first.bias is None)
               for m in linears)


class PackedJoined:
    """Linears reading the same input (q, k and v; gate and up) as one product over their weights side by
    side, packed once: x [n, in] -> [n, sum of out_features], each part's columns in order. One call instead
    of three (two), and RoPE then runs on q and k together: a bfloat16 SmolLM2 step's q/k/v and gate/up
    products 16.0 -> 14.0 ms on 2 threads, the whole one-token step 30.7 -> 28.0 ms (same process,
    alternating; Intel Xeon). oneDNN computes each column as the part's own packed product does for blocks
    up to 64 rows (bit for bit, measured in bfloat16 on SmolLM2's shapes); a 200-token prefill's q/k/v
    differ in the last bits (another blocking of the wider product): the same kind of difference as
    between any two valid kernels, kept to the promise of the target's greedy output and exact sampling of
    the logits the step computes (tests). The side-by-side weight is packed from a temporary copy, so it
    holds what the parts' packed weights would. It multiplies any block it is given: the lean loop gives it
    every block of a bfloat16 model, and a float32 model's blocks of FROM_ROWS rows or more (its shorter
    blocks stay on each part's own MKL product, as PackedLinear's do)."""

    def __init__(self, linears: list[nn.Linear]):
        if not can_join(linears):
            raise ValueError("only packable nn.Linear layers of one dtype and input width, with a bias on all or "
                             "none, join")
        weights = tuple(m.weight for m in linears)
        self.packed = _cached(linears[0], weights, lambda: torch.ops.mkldnn._reorder_linear_weight(
            torch.cat([w.detach() for w in weights]), None), _joined)
        self.bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


class PackedQuantizedLinear:
    """A quantized draft's linear, x [n, in] -> [n, out] in bfloat16: blocks shorter than its class's
    FROM_ROWS_QUANTIZED rows through its own int8 / int4 kernel, longer ones through its weight
    dequantized and packed."""

    def __init__(self, linear: QuantizedLinear):
        self.linear, self.short = linear, linear.bound_forward()
        self.packed = packed_dequantized(linear)
        self.from_rows = FROM_ROWS_QUANTIZED[type(linear)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.from_rows:
            return self.short(x)
        x = x.to(torch.bfloat16).contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.linear.bias, "none", [], "")
