"""specdec's C++ CPU kernels as one library: built on first use, cached, loaded once per process.

Why one library: the kernels (cpu_rows.cpp, the short-block linear; cpu_attention.cpp, a step's attention over
the paged KV; cpu_layer.cpp, a whole decoder layer of a step, built from the other two's headers) share
their build: the C++ compiler inductor also uses (`CXX`, default c++), AVX2 + FMA,
against the installed torch; cached as SPECDEC_HOME/kernels/cpu_kernels-<hash of the sources, torch,
compiler>.so (written under a temporary name, then renamed: two processes building at once both end with a
whole file). `load()` returns why they cannot run (no AVX2/FMA, no compiler, a build error) or None;
callers fall back to their own torch path then. The ops live in `torch.ops.specdec_cpu`.
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

from .cpu_info import cpuinfo

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_rows.cpp", "cpu_attention.cpp", "cpu_layer.cpp"))
# included by the sources: part of the cache key
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_vec.h", "cpu_rows.h", "cpu_attention.h"))


def cpu_supports() -> bool:
    """Does this CPU have the instructions the kernels are built for (AVX2 and FMA, from /proc/cpuinfo)?"""
    flags = set(cpuinfo("flags").split())
    return {"avx2", "fma"} <= flags


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
    from . import cpu_rows

    torch.library.register_fake("specdec_cpu::rows_linear")(cpu_rows.fake)  # the compiled step's graphs call it
    return None
