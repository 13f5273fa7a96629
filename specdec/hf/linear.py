"""Linear layers for short blocks on a CPU: multiply weight-first, W @ xᵀ, instead of x @ Wᵀ.

Speculative decoding lives on blocks of 1 to 6 rows (a decode step, a draft step, a chain of k + 1
tokens to verify), and on a CPU those are the shapes the float32 BLAS handles worst: `F.linear`
sends one row to a matrix-vector product that reads the weights at about half the memory bandwidth,
and two to five rows to a GEMM that packs the whole weight matrix per call, so verifying 3 tokens
cost 2.1x decoding one on SmolLM2-135M (benchmarks/results/block_cost.md) and 3x on
Qwen2.5-Coder-1.5B. Asking the same library for the transposed product, W [out, in] @ xᵀ [in, n]
with xᵀ a view of a contiguous x, streams the weights once; a single row is doubled to two (the
one-row kernel is the slow one). Measured on this project's 2-core CPU (benchmarks/linear_rows.py),
a SmolLM2 forward over 1-6 tokens then costs about what a one-token forward through `F.linear` did
(results/linear_rows.md), and a Qwen2.5-Coder one-token forward 0.61x HF's.

It is the same sum of the same products in another order, so its results differ from `F.linear`'s in
the last bits, the same kind of difference as between HF's own one-token and k-token forwards: the
lean loop's operation order is still certified bit for bit against HF's modules (hf/lean.py probes
with weight-first off), and the target's greedy output is checked against HF's own by the tests. Only
float32 weights on the CPU take this path (bfloat16 GEMMs go through oneDNN, which does not need it,
and a GPU's BLAS has no such cliff); set `WEIGHT_FIRST_MAX_ROWS = 0` to turn it off.

Shapes: x [..., in] (the weight's dtype), weight [out, in], bias [out] or None -> [..., out]; n is the
number of rows, x.numel() / in.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

WEIGHT_FIRST_MAX_ROWS = 6  # measured crossover: F.linear catches up at 8 rows on SmolLM2's shapes


def weight_first(weight: torch.Tensor) -> bool:
    """Does this weight take the weight-first path for short blocks (float32, on a CPU)?"""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and WEIGHT_FIRST_MAX_ROWS > 0


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), weight-first when x has 1..WEIGHT_FIRST_MAX_ROWS rows and the weight
    qualifies (weight_first)."""
    n = x.numel() // max(x.shape[-1], 1)
    if not (0 < n <= WEIGHT_FIRST_MAX_ROWS and weight_first(weight)):
        return F.linear(x, weight, bias)
    rows = x.reshape(n, -1)
    rows = rows.repeat(2, 1) if n == 1 else rows.contiguous()  # xᵀ must be a transposed view of contiguous rows
    y = torch.mm(weight, rows.t()).t()[:n]
    if bias is not None:
        y = y + bias
    return y.contiguous().view(*x.shape[:-1], weight.shape[0])
