"""A CPU kernel for the short blocks speculation lives on: y [n, out] = x [n, in] @ weight [out, in]ᵀ (+ bias)
for 1 to MAX_ROWS rows (more where hf/linear.kernel_rows says so), float32 or bfloat16 weights, on x86 CPUs
with AVX2 and FMA (cpu_rows.cpp).

Why: a decode, draft or verification step multiplies 1 to 16 rows by every weight, so its cost is the
speed the weights are read at. The BLAS torch calls is built for big blocks: on an AMD EPYC (MKL on its
generic code paths, 2 threads, a streaming line of about 29 GB/s) SmolLM2-135M's float32 layer weights
read at 13.5 GB/s for 1 row and 7-8 GB/s for 2-16 (the weight-first form of hf/linear.py: 11-12 GB/s
for 2-4), bfloat16 ones (oneDNN without AVX512 there) at 14 GB/s for 1 row down to 1 GB/s for 16. The
kernel reads each weight row once for all the rows of x, split between torch's intra-op threads: float32
at 20-22 GB/s for 1-6 rows, 9 GB/s for 16; bfloat16 (widened in registers, half the bytes) in 12-14 ms
for 1-4 rows where F.linear takes 15-52 ms, 4.4x faster at 16 rows
(benchmarks/results/cpu_rows_amd_epyc.md). Past 8 rows it is bound by arithmetic, not memory. Where the CPU
has AVX512-BF16, bfloat16 products take cpu_rows_bf16.h's dot-product path instead (cpu_library.py switches it
on): 0.64x the AVX2 path's time at 8-16 rows over SmolLM2's weights, level at 1-4, where memory sets the pace
(benchmarks/results/bf16_dot_amd_epyc_zen4.md has the step's figures).

Built and loaded with the other CPU kernels (kernels/cpu_library.py: call its `load()` first). The op is
`torch.ops.specdec_cpu.rows_linear`, opaque to torch.compile graphs (its fake implementation: `fake`).

Shapes: x [n, in] (the weight's dtype), weight [out, in] contiguous, bias [out] or None -> [n, out].
"""
from __future__ import annotations

import torch

# a short block's reach (the layer kernel's too): past 16 rows the kernel is bound by arithmetic (module doc's
# results file); hf/linear.kernel_rows sends longer products here where the BLAS is slower still (float32 up
# to 64 rows; bfloat16 of any length where oneDNN emulates bfloat16 in AVX2: 5-7x slower than this kernel)
MAX_ROWS = 16


def fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [n, in] through the kernel (call cpu_library.load() first; raises
    where it did not load)."""
    return torch.ops.specdec_cpu.rows_linear(x, weight, bias)


def rows_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's reference: the product in float32, rounded once to x's dtype (what the kernel computes,
    but for summation order)."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
