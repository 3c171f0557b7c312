"""Seeds derived from names: identical in every process, Python version and machine."""
from __future__ import annotations

import zlib
from typing import Any


def stable_seed(*parts: Any) -> int:
    """A seed from any parts (`stable_seed(seed, "demo", task, i)`), stable across processes
    (unlike `hash`, which Python salts per process)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF
