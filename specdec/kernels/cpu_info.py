"""What CPU this is (/proc/cpuinfo): the CPU kernels check its instruction sets (cpu_library.py), the
machine rules for multiplying linears (hf/linear.py, hf/packed.py) are fixed per vendor, since each was
measured on one, and benchmark headers name both."""
from __future__ import annotations

import functools
import platform


def cpuinfo(field: str) -> str:
    """A field of /proc/cpuinfo's first processor ('' where there is none, as off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache  # both machine rules ask at import; /proc/cpuinfo is read once
def cpu_vendor() -> str:
    """The CPU's vendor string ('GenuineIntel', 'AuthenticAMD', ...; '' when it cannot be read)."""
    proc = cpuinfo("vendor_id") or platform.processor()  # Windows: 'AMD64 Family 25 ..., AuthenticAMD'
    return next((v for v in ("GenuineIntel", "AuthenticAMD") if v in proc), proc if " " not in proc else "")


def cpu_name() -> str:
    return cpuinfo("model name") or platform.processor() or "unknown CPU"


def vector_extensions(flags: str) -> str:
    """The widest vector instructions in flags (/proc/cpuinfo's), for a benchmark's machine line: CPUs of one
    name differ here (AMD EPYC Zen 3: AVX2; Zen 4: AVX512 with AVX512-BF16), and so do their kernels' paths."""
    have = set(flags.split())
    found = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX512"), ("avx512_bf16", "AVX512-BF16"),
                                     ("amx_bf16", "AMX-BF16")) if flag in have]
    return " + ".join(found) or "no AVX2"
