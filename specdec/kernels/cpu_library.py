"""specdec's C++ CPU kernels as one library: built on first use, cached, loaded once per process.

Why one library: the kernels (cpu_rows.cpp, the short-block linear; cpu_attention.cpp, a step's attention over
the paged KV; cpu_layer.cpp, a whole decoder layer of a step, built from the other two's headers) share
their build: the C++ compiler inductor also uses (`CXX`, default c++), AVX2 + FMA,
against the installed torch; cached as SPECDEC_HOME/kernels/cpu_kernels-<hash of the sources, torch,
compiler>.so (written under a temporary name, then renamed: two processes building at once both end with a
whole file). Where the CPU has AVX512-BF16, bfloat16 products take cpu_rows_bf16.h's path (compiled for it
in that header alone, switched on here at load; `SPECDEC_BF16_DOT=0` keeps the AVX2 one). `load()` returns
why they cannot run (no AVX2/FMA, no compiler, a build error) or None; callers fall back to their own torch
path then. The ops live in `torch.ops.specdec_cpu`.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from .cpu_info import cpuinfo

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_rows.cpp", "cpu_attention.cpp", "cpu_layer.cpp"))
# included by the sources: part of the cache key
HEADERS = tuple(Path(__file__).with_name(name)
                for name in ("cpu_vec.h", "cpu_rows.h", "cpu_rows_bf16.h", "cpu_attention.h"))


def cpu_supports() -> bool:
    """Does this CPU have the instructions the kernels are built for (AVX2 and FMA, from /proc/cpuinfo)?"""
    flags = set(cpuinfo("flags").split())
    return {"avx2", "fma"} <= flags


# what cpu_rows_bf16.h's path runs on: 512-bit registers and vdpbf16ps (AMD Zen 4, Intel Cooper Lake and later)
BF16_DOT_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})

BF16_DOT_OVERRIDE = os.environ.get("SPECDEC_BF16_DOT")
if BF16_DOT_OVERRIDE not in (None, "", "0", "1"):
    raise ValueError(f"SPECDEC_BF16_DOT must be 0 or 1, got {BF16_DOT_OVERRIDE!r}")


def bf16_dot_wanted(flags: str, override: str | None = BF16_DOT_OVERRIDE) -> bool:
    """Should bfloat16 products multiply with AVX512-BF16 dot products (cpu_rows_bf16.h)? Where the CPU has
    them (flags: /proc/cpuinfo's), unless SPECDEC_BF16_DOT=0 (1, like unset, cannot force instructions the
    CPU lacks)."""
    return override != "0" and BF16_DOT_FLAGS <= set(flags.split())


def bf16_dot_on() -> bool:
    """Do the loaded kernels' bfloat16 products run on AVX512-BF16 (False where the library is not loaded)?"""
    return load() is None and torch.ops.specdec_cpu.bf16_dot()


@functools.cache
def bf16_dot_here() -> bool:
    """Can the AVX512-BF16 path run here (whatever SPECDEC_BF16_DOT says): does the CPU have the instructions, and
    were the loaded kernels built with the path (its pragma is GCC 11+'s)?"""
    if not bf16_dot_wanted(cpuinfo("flags"), override=None) or load() is not None:
        return False
    before = torch.ops.specdec_cpu.bf16_dot()
    built = torch.ops.specdec_cpu.set_bf16_dot(True)
    torch.ops.specdec_cpu.set_bf16_dot(before)
    return built


@contextlib.contextmanager
def bf16_dot(on: bool) -> Iterator[None]:
    """The block with the loaded kernels' bfloat16 products on AVX512-BF16 (on) or on AVX2 (off), the loader's
    choice restored after: benchmarks A/B the two, tests check both. on=True where the path cannot run (the CPU
    lacks the instructions, or the compiler the path) raises instead of running an illegal instruction."""
    reason = load()
    if reason is not None:
        raise RuntimeError(f"specdec's CPU kernels are not loaded: {reason}")
    if on and not bf16_dot_here():
        if not bf16_dot_wanted(cpuinfo("flags"), override=None):
            raise RuntimeError(f"this CPU lacks AVX512-BF16 (needs {', '.join(sorted(BF16_DOT_FLAGS))})")
        raise RuntimeError("the kernels were built without the AVX512-BF16 path (its pragma is GCC 11+'s)")
    before = torch.ops.specdec_cpu.bf16_dot()
    torch.ops.specdec_cpu.set_bf16_dot(on)
    try:
        yield
    finally:
        torch.ops.specdec_cpu.set_bf16_dot(before)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _build_command(compiler: str, sources: tuple[Path, ...], out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    includes = [f"-I{p}" for p in include_paths()]
    libs = [f"-L{p}" for p in library_paths()]
    return [compiler, "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++20", f"-I{HEADERS[0].parent}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *includes, *map(str, sources),
            *libs, "-lc10", "-ltorch_cpu", "-o", str(out)]


def library_path(compiler: str, sources: tuple[Path, ...] = SOURCES) -> Path:
    """Where these sources, built by this compiler against this torch, are cached."""
    from ..zoo.real import home

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for source in (*sources, *HEADERS):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    digest.update(torch.__version__.encode() + version.encode())
    return home() / "kernels" / f"cpu_kernels-{digest.hexdigest()[:16]}.so"


def build(compiler: str, sources: tuple[Path, ...] = SOURCES) -> Path:
    """Compile the kernels into the cache (once per sources, torch and compiler) and return the library."""
    path = library_path(compiler, sources)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".part", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run(_build_command(compiler, sources, Path(tmp)), capture_output=True, text=True)
        if done.returncode != 0:
            names = ", ".join(s.name for s in sources)
            raise RuntimeError(f"building {names} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def load() -> str | None:
    """Build (or find) and load the kernels once per process: None when the ops can run, else why not."""
    if not cpu_supports():
        return "this CPU lacks AVX2 or FMA"
    compiler = _compiler()
    if compiler is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} not found; set CXX)"
    try:
        torch.ops.load_library(str(build(compiler)))
    except (RuntimeError, OSError) as e:
        return str(e)
    torch.ops.specdec_cpu.set_bf16_dot(bf16_dot_wanted(cpuinfo("flags")))
    from . import cpu_rows

    torch.library.register_fake("specdec_cpu::rows_linear")(cpu_rows.fake)  # the compiled step's graphs call it
    return None
