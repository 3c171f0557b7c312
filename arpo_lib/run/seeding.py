"""Seeds derived from names: identical in every process, Python version and machine; and the
fingerprint of what makes a seeded run's floating-point results differ between machines."""
from __future__ import annotations

import os
import zlib
from typing import Any


def stable_seed(*parts: Any) -> int:
    """A seed from any parts (`stable_seed(seed, "demo", task, i)`), stable across processes
    (unlike `hash`, which Python salts per process)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


NUMERICS_ISA = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16")
"""CPU features whose presence changes which kernels torch and oneDNN pick (and so the rounding)."""


def numerics_fingerprint() -> str:
    """One line naming what a seeded CPU run's numbers depend on besides the code and the seed:
    torch's version, its CPU dispatch level, the host's vector extensions of `NUMERICS_ISA` and
    the thread count (reductions are split per thread). Two hosts with the same line produced the
    same numbers in every check so far; a different line means outputs recorded on one are not
    expected bit for bit on the other (the same recipe gave another warm start on another host:
    docs/learning.md, section 7)."""
    import torch

    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        flags = set()
    isa = " ".join(f for f in NUMERICS_ISA if f in flags) or "unknown"
    return (f"torch {torch.__version__}, cpu {torch.backends.cpu.get_cpu_capability()} ({isa}), "
            f"{torch.get_num_threads()} threads of {os.cpu_count()} cores")
