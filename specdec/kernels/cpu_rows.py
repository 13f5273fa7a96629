"""A CPU kernel for the short blocks speculation lives on: y [n, out] = x [n, in] @ weight [out, in]ᵀ (+ bias)
for 1 to MAX_ROWS rows, float32 or bfloat16 weights, on x86 CPUs with AVX2 and FMA (cpu_rows.cpp).

Why: a decode, draft or verification step multiplies 1 to 16 rows by every weight, so its cost is the
speed the weights are read at. The BLAS torch calls is built for big blocks: on an AMD EPYC (MKL on its
generic code paths, 2 threads, a streaming line of about 29 GB/s) SmolLM2-135M's float32 layer weights
read at 13.5 GB/s for 1 row and 7-8 GB/s for 2-16 (the weight-first form of hf/linear.py: 11-12 GB/s
for 2-4), bfloat16 ones (oneDNN without AVX512 there) at 14 GB/s for 1 row down to 1 GB/s for 16. The
kernel reads each weight row once for all the rows of x, split between torch's intra-op threads: float32
at 20-22 GB/s for 1-6 rows, 9 GB/s for 16; bfloat16 (widened in registers, half the bytes) in 12-14 ms
for 1-4 rows where F.linear takes 15-52 ms, 4.4x faster at 16 rows
(benchmarks/results/cpu_rows_amd_epyc.md). Past 8 rows it is bound by arithmetic, not memory.

Built on first use with the C++ compiler inductor also uses (`CXX`, default c++) against the installed
torch, cached as SPECDEC_HOME/kernels/cpu_rows-<hash of source, torch, compiler>.so (written under a
temporary name, then renamed: two processes building at once both end with a whole file). `load()`
returns why it cannot run (no AVX2/FMA, no compiler, a build error) or None; callers fall back to their
own product then. The op is `torch.ops.specdec_cpu.rows_linear`, with a fake (meta) implementation so
torch.compile graphs call it as an opaque kernel.

Shapes: x [n, in] (the weight's dtype), weight [out, in] contiguous, bias [out] or None -> [n, out].
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..hf.cpu import cpuinfo

SOURCE = Path(__file__).with_name("cpu_rows.cpp")
MAX_ROWS = 16  # past 16 rows the kernel is compute-bound (measured: module doc's results file); the BLAS takes over


def cpu_supports() -> bool:
    """Does this CPU have the instructions the kernel is built for (AVX2 and FMA, from /proc/cpuinfo)?"""
    flags = set(cpuinfo("flags").split())
    return {"avx2", "fma"} <= flags


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _build_command(compiler: str, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    includes = [f"-I{p}" for p in include_paths()]
    libs = [f"-L{p}" for p in library_paths()]
    return [compiler, "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *includes, str(SOURCE),
            *libs, "-lc10", "-ltorch_cpu", "-o", str(out)]


def library_path(compiler: str) -> Path:
    """Where this source, built by this compiler against this torch, is cached."""
    from ..zoo.real import home

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + version.encode()).hexdigest()[:16]
    return home() / "kernels" / f"cpu_rows-{key}.so"


def build(compiler: str) -> Path:
    """Compile the kernel into the cache (once per source, torch and compiler) and return the library."""
    path = library_path(compiler)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".part", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run(_build_command(compiler, Path(tmp)), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def load() -> str | None:
    """Build (or find) and load the kernel once per process: None when `rows_linear` can run, else why not."""
    if not cpu_supports():
        return "this CPU lacks AVX2 or FMA"
    compiler = _compiler()
    if compiler is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} not found; set CXX)"
    try:
        torch.ops.load_library(str(build(compiler)))
    except (RuntimeError, OSError) as e:
        return str(e)
    torch.library.register_fake("specdec_cpu::rows_linear")(_fake)
    return None


def _fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [n, in] through the kernel (call `load()` first; raises where it
    did not load)."""
    return torch.ops.specdec_cpu.rows_linear(x, weight, bias)


def rows_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's reference: the product in float32, rounded once to x's dtype (what the kernel computes,
    but for summation order)."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
