"""Linear layers for short blocks on a CPU: multiply weight-first, W @ xᵀ, instead of x @ Wᵀ, where
the machine's BLAS handles short blocks badly.

Speculative decoding lives on blocks of 1 to 6 rows (a decode step, a draft step, a chain of k + 1
tokens to verify). torch's CPU builds multiply float32 with Intel's MKL, and MKL runs its fast kernels
only on Intel CPUs: on others (AMD EPYC, measured) it falls back to generic code paths, where
`F.linear` sends one row to a matrix-vector product that reads the weights at about half the memory
bandwidth, and two to five rows to a GEMM that packs the whole weight matrix per call, so verifying 3
tokens cost 2.1x decoding one on SmolLM2-135M and 3x on Qwen2.5-Coder-1.5B. Asking the same library
for the transposed product, W [out, in] @ xᵀ [in, n] with xᵀ a view of a contiguous x, streams the
weights once; a single row is doubled to two (the one-row kernel is the slow one). On that EPYC a
SmolLM2 forward over 2-6 tokens then costs 0.54-0.75x what it does through `F.linear`; over one token
the doubled row has measured both ways (0.7x on 2026-12-01, 1.2x in the rerun that added the row
kernel's column: benchmarks/results/linear_rows_amd_epyc.md). On an Intel Xeon (Sapphire Rapids, measured) it is the
other way round: MKL's own kernels read the weights at full bandwidth for 1-3 rows and weight-first
halves it (results/linear_rows.md). Hence the rule: weight-first for 1-6 rows when torch multiplies
with MKL on a CPU that is not Intel's; `F.linear` everywhere else. The environment variable
`SPECDEC_WEIGHT_FIRST` (1: always, 0: never) overrides it; `WEIGHT_FIRST_MAX_ROWS` holds the outcome
(0: off). The rule is fixed per machine, not timed at run time, so a machine's outputs do not depend
on how busy it was when the model loaded.

It is the same sum of the same products in another order, so its results differ from `F.linear`'s in
the last bits, the same kind of difference as between HF's own one-token and k-token forwards: the
lean loop's operation order is still certified bit for bit against HF's modules (hf/lean.py probes
with weight-first off), and the target's greedy output is checked against HF's own by the tests. Only
float32 weights on the CPU take this path (bfloat16 GEMMs go through oneDNN, which does not need it,
and a GPU's BLAS has no such cliff).

Where the CPU has AVX2 and FMA and a C++ compiler is at hand, the same machines go further: short
blocks of up to 16 rows, float32 or bfloat16, through specdec's own kernel (kernels/cpu_rows.py: each
weight row read once for every row of x, on both threads). On the EPYC it reads float32 weights 1.7-3x
faster than MKL's product for 1-8 rows and bfloat16 ones 2-4.4x faster than oneDNN for 2-16
(results/cpu_rows_amd_epyc.md); a SmolLM2 forward over 1-16 tokens costs 37-70 ms where `F.linear`
takes 50-113 (float32) and 30-73 ms where it takes 30-280 (bfloat16; results/linear_rows_amd_epyc.md,
linear_rows_bf16_amd_epyc.md). `SPECDEC_ROW_KERNEL` (1: on wherever it builds, 0: off) overrides its
rule (on where weight-first is); where it does not build, one warning names why and weight-first serves.
Longer blocks (a prompt's prefill, the compiled step's 32-token bucket) take the kernel too where it beats
the BLAS: float32 up to FLOAT32_KERNEL_ROWS rows, bfloat16 of any length where the CPU has no bfloat16
instructions (`kernel_rows`; on the EPYC a 45-token bfloat16 SmolLM2 prompt's first token in 130 ms
instead of 551).

Shapes: x [..., in] (the weight's dtype), weight [out, in], bias [out] or None -> [..., out]; n is the
number of rows, x.numel() / in.
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels import cpu_library, cpu_rows
from ..kernels.cpu_info import cpu_name, cpu_vendor, cpuinfo, vector_extensions
from . import packed

SHORT_BLOCK_ROWS = 6  # measured crossover on the EPYC: F.linear catches up at 8 rows on SmolLM2's shapes


def machine() -> str:
    """One line for benchmark headers: the CPU, its vendor and vector instructions, the BLAS and what the rules
    chose."""
    blas = "MKL" if torch.backends.mkl.is_available() else "not MKL"
    bf16 = "any number" if LONG_BF16_BLOCKS else cpu_rows.MAX_ROWS
    dot = " (AVX512-BF16 dot products)" if row_kernel_ready() and cpu_library.bf16_dot_on() else ""
    short = (f"through specdec's row kernel up to {FLOAT32_KERNEL_ROWS} rows float32, {bf16} bfloat16{dot}"
             if row_kernel_ready() else
             f"weight-first up to {WEIGHT_FIRST_MAX_ROWS} rows (row kernel off: {row_kernel_reason()})")
    return (f"{cpu_name()} ({cpu_vendor() or 'vendor unknown'}, {vector_extensions(cpuinfo('flags'))}, {blas}): "
            f"short blocks {short}; {packed.describe()}")


def short_block_rows(vendor: str, blas_is_mkl: bool, override: str | None = None) -> int:
    """The most rows multiplied weight-first on this machine (0: never; see the module doc).
    override: SPECDEC_WEIGHT_FIRST's value ('1' on, '0' off, None or '' the rule)."""
    if override not in (None, "", "0", "1"):
        raise ValueError(f"SPECDEC_WEIGHT_FIRST must be 0 or 1, got {override!r}")
    if override:
        return SHORT_BLOCK_ROWS if override == "1" else 0
    return SHORT_BLOCK_ROWS if blas_is_mkl and vendor != "GenuineIntel" and vendor != "" else 0


WEIGHT_FIRST_MAX_ROWS = short_block_rows(cpu_vendor(), torch.backends.mkl.is_available(),
                                         os.environ.get("SPECDEC_WEIGHT_FIRST"))


ROW_KERNEL_OVERRIDE = os.environ.get("SPECDEC_ROW_KERNEL")
if ROW_KERNEL_OVERRIDE not in (None, "", "0", "1"):
    raise ValueError(f"SPECDEC_ROW_KERNEL must be 0 or 1, got {ROW_KERNEL_OVERRIDE!r}")


def row_kernel_reason() -> str | None:
    """Why short blocks do not go through kernels/cpu_rows.py's kernel here (None: they do). Builds and
    loads the kernel on the first call where the rule wants it; warns once when it cannot."""
    if ROW_KERNEL_OVERRIDE == "0":
        return "SPECDEC_ROW_KERNEL=0"
    if ROW_KERNEL_OVERRIDE != "1" and WEIGHT_FIRST_MAX_ROWS == 0:
        return "this machine's BLAS serves short blocks (the weight-first rule is off)"
    return _loaded()


@functools.cache
def _loaded() -> str | None:
    reason = cpu_library.load()
    if reason is not None:
        warnings.warn(f"specdec's row kernel is off, short blocks multiply weight-first: {reason}", stacklevel=3)
    return reason


def short_blocks_on() -> bool:
    """Do runners take the short-block path (short_blocks_linear) on this machine by default?"""
    return WEIGHT_FIRST_MAX_ROWS > 0 or ROW_KERNEL_OVERRIDE == "1"


def row_kernel_ready() -> bool:
    return row_kernel_reason() is None


def bf16_gemm_emulated(flags: str) -> bool:
    """Does torch's bfloat16 GEMM run here without the CPU's bfloat16 instructions (flags: /proc/cpuinfo's,
    neither avx512_bf16 nor amx_bf16)? Then oneDNN widens bfloat16 in AVX2 code that reaches about
    10 GMAC/s on the EPYC, where the row kernel reaches 60-70 (see kernel_rows)."""
    return not ({"avx512_bf16", "amx_bf16"} & set(flags.split()))


# long bfloat16 blocks (a prefill) through the row kernel too, where the BLAS has no bfloat16 instructions
LONG_BF16_BLOCKS = bf16_gemm_emulated(cpuinfo("flags"))


# the most rows of a float32 product through the row kernel: past it MKL's GEMM (on its generic code paths
# off Intel) catches up. AMD EPYC, 2 threads, kernel / F.linear time on SmolLM2's and Qwen2.5-Coder-1.5B's
# weights: 0.35-0.68 at 17 rows, 0.43-0.83 at 32, 0.62-1.06 at 64, 0.73-1.10 at 128, 0.88-1.22 at 256
FLOAT32_KERNEL_ROWS = 64


def kernel_rows(weight: torch.Tensor) -> int:
    """The most rows of x a product with this weight sends through the row kernel (where it takes the
    weight): FLOAT32_KERNEL_ROWS for float32; any number for bfloat16 where LONG_BF16_BLOCKS, whose F.linear
    is 5-7x slower than the kernel at every length measured (AMD EPYC, 2 threads, 45 to 1000 rows:
    SmolLM2's gate/up 9.6 -> 1.4 ms at 45 rows, 182 -> 25 ms at 1000; its 49 152-row LM head 600 -> 94 ms
    at 200; Qwen2.5-Coder-1.5B's 8960 x 1536 1332 -> 225 ms at 1000, about 70 GMAC/s, near the cores' AVX2
    peak; a 45-token SmolLM2 prompt's first token 551 -> 130 ms), else cpu_rows.MAX_ROWS."""
    if weight.dtype == torch.float32:
        return FLOAT32_KERNEL_ROWS
    return 1 << 62 if LONG_BF16_BLOCKS else cpu_rows.MAX_ROWS


def row_kernel_takes(weight: torch.Tensor) -> bool:
    """Does this weight's short blocks go through the row kernel (float32 or bfloat16, contiguous, on a
    CPU, where the kernel is on)?"""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.is_contiguous() and row_kernel_ready())


def short_blocks_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [..., in] -> F.linear(x, weight, bias), short blocks through the row kernel where it takes this
    weight (up to kernel_rows(weight) rows), else weight-first up to SHORT_BLOCK_ROWS rows; longer ones
    through F.linear. The choice of path is made once, here."""
    if not row_kernel_takes(weight):
        return lambda x: weight_first_rows(x, weight, bias)

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = _through_row_kernel(x, weight, bias)
        return F.linear(x, weight, bias) if y is None else y
    return forward


def _through_row_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [..., in] -> [..., out] through the row kernel when x has 1 to kernel_rows(weight) rows of the weight's
    dtype, else None (the caller has checked that the kernel takes this weight). Another dtype is what autocast
    hands a float32 weight's product (a head trained in bfloat16 autocast): F.linear casts both, as autocast
    wants; the kernel multiplies one dtype."""
    n = x.numel() // max(x.shape[-1], 1)
    if not 0 < n <= kernel_rows(weight) or x.dtype != weight.dtype:
        return None
    return cpu_rows.rows_linear(x.reshape(n, -1), weight, bias).view(*x.shape[:-1], weight.shape[0])


def weight_first(weight: torch.Tensor) -> bool:
    """Does this weight take the weight-first path for short blocks on this machine (float32, on a CPU,
    where the rule or SPECDEC_WEIGHT_FIRST turns it on)?"""
    return WEIGHT_FIRST_MAX_ROWS > 0 and _qualifies(weight)


def _qualifies(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu"


def weight_first_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      max_rows: int = SHORT_BLOCK_ROWS) -> torch.Tensor:
    """F.linear(x, weight, bias), weight-first when x has 1..max_rows rows and the weight is float32 on
    a CPU, whatever the machine (benchmarks compare the two this way)."""
    n = x.numel() // max(x.shape[-1], 1)
    if not (0 < n <= max_rows and _qualifies(weight)):
        return F.linear(x, weight, bias)
    rows = x.reshape(n, -1)
    rows = rows.repeat(2, 1) if n == 1 else rows.contiguous()  # xᵀ must be a transposed view of contiguous rows
    y = torch.mm(weight, rows.t()).t()[:n]
    if bias is not None:
        y = y + bias
    return y.contiguous().view(*x.shape[:-1], weight.shape[0])


def bound_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """F.linear(x, weight, bias) for x [n, in], the weight's transposed view taken once: the torch.mm /
    torch.addmm that F.linear itself calls for a 2-D input (the same numbers, bit for bit), without its
    three dispatch layers per call (about 0.6 ms of a SmolLM2 step's 210 products)."""
    wt = weight.t()
    if bias is None:
        return lambda x: torch.mm(x, wt)
    return lambda x: torch.addmm(bias, x, wt)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), short blocks through the row kernel or weight-first where this machine's
    rules say so (see the module doc)."""
    y = _through_row_kernel(x, weight, bias) if row_kernel_takes(weight) else None
    return weight_first_rows(x, weight, bias, WEIGHT_FIRST_MAX_ROWS) if y is None else y


def plain_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's modules that are nn.Linear itself (no subclass: a quantized or otherwise special linear
    keeps its own forward): what short_block_linears takes."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@contextlib.contextmanager
def short_block_linears(linears: list[torch.nn.Linear]):
    """While inside, these nn.Linear modules multiply through `linear_rows` (this machine's short-block
    products): a model run through its own modules (hf/runner.py, architectures the lean loop does not
    cover) gets them too. On the AMD EPYC a Gemma 3 270M token spent 54 ms of its ~100 in MKL's one-row
    product over the 262 144-row LM head (12.5 GB/s; the row kernel: 22 ms). A module whose forward is
    already replaced on the instance (accelerate's offload hooks) is left alone; each is restored on exit."""
    patched = []
    try:
        for m in linears:
            if "forward" not in vars(m):
                m.forward = functools.partial(_linear_forward, m)
                patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward


def _linear_forward(m: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear_rows(x, m.weight, m.bias)
