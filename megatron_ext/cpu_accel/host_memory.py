"""Keep freed host memory in the process between training iterations (glibc's malloc).

A CPU step re-allocates activations of data-dependent sizes, and glibc returns freed memory
eagerly, so every iteration faults fresh pages. `retain_freed_host_memory` raises the mmap and
trim thresholds (as `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_`); `large_blocks=True`
(small CPU models) also keeps blocks above 32 MiB on the heap. Measurements:
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

__all__ = ["LARGE_BLOCKS_PARAM_LIMIT", "retain_freed_host_memory"]

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30
LARGE_BLOCKS_PARAM_LIMIT = 256 << 20
"""Parameter bytes of a rank from which a CPU run maps its largest blocks (see the module doc):
64M float32 parameters, above every quick-start and benchmark width, below the 1.2B shape."""


def retain_freed_host_memory(large_blocks: bool = False) -> Optional[str]:
    """Set glibc's mmap and trim thresholds (module doc) for this process and its children;
    `large_blocks`: also serve the largest blocks from the heap (CPU training). None when set, else
    why not: not glibc, or the user set the allocator up (MALLOC_*, GLIBC_TUNABLES, LD_PRELOAD)."""
    if not sys.platform.startswith("linux"):
        return f"not on Linux ({sys.platform})"
    chosen = [k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]
    if os.environ.get("LD_PRELOAD"):
        chosen.append("LD_PRELOAD")
    if chosen:
        return f"the allocator settings of {', '.join(sorted(chosen))} are left as they are"
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return "the C library has no mallopt (not glibc)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    ):
        return "mallopt refused the thresholds"
    if large_blocks and not mallopt(_M_MMAP_MAX, 0):
        return "mallopt refused the mmap count"
    return None
