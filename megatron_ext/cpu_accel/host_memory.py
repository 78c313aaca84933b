"""Keep freed host memory in the process between training iterations (glibc's malloc).

glibc returns freed memory to the operating system eagerly: blocks above its mmap threshold
(128 KiB at start, raised only when such a block is freed) are unmapped on free, and the top of
the heap is trimmed once more than the trim threshold (twice the mmap threshold) is free. A
CPU training step frees and re-allocates the same activations every iteration, in sizes that
vary with the data (LEV's distinct ids): each iteration then faults fresh zeroed pages in
again, kernel time that measured 3-5% of a step at width 256 (benchmarks/RESULTS.md 4.3).
`retain_freed_host_memory` sets the mmap threshold to glibc's largest (32 MiB) and the trim
threshold to 1 GiB, as `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` would, so that the
next iteration reuses the pages. The resident size stays at the step's peak instead of
falling between steps.

Blocks above 32 MiB are still mapped and unmapped per allocation at that threshold: on a CPU
run these are the step's largest activations (the [s, b, V] logits and their gradient, 64 MiB
each at seq 512, micro-batch 4, V = 8k), about 16k fresh pages per iteration. With
`large_blocks=True` (what training on CPU asks for) the mmap count is also set to 0
(`MALLOC_MMAP_MAX_=0`), so that every block comes from the heap and is kept too. glibc still
maps a block that the heap cannot hold (a thread's arena is at most 64 MiB; the main heap when
it cannot grow), so no allocation fails because of it; memory freed at the heap's top above
the trim threshold is still returned. GPU runs keep large host blocks mapped: there they are
one-off buffers (checkpoint loads), which in the heap could leave holes that stay resident.

So do CPU runs whose rank holds `LARGE_BLOCKS_PARAM_LIMIT` bytes of parameters or more: there
the blocks above 32 MiB are the weights' gradients (freed by every zero_grad and allocated
again by the next backward), the Adam states and the [s, V] logits, in sizes that differ from
one another, so the heap that serves them all keeps holes that no later block fits. At the
paper's 1.2B width (TP=2, one layer, micro-batch 1) that measured 5.40 GiB resident per rank
against 4.40 GiB with those blocks mapped (benchmarks/scale_1p2b.py, benchmarks/RESULTS.md),
while faulting them in again costs a step of several seconds about 1%.
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
    """Set glibc's mmap and trim thresholds (see the module doc) for this process and the
    processes it forks.

    Args:
        large_blocks: also serve blocks above the largest mmap threshold from the heap (mmap
            count 0), for runs whose activations are host memory (training on CPU).

    Returns:
        None when set, else why not (one line): not Linux/glibc, or the user chose the
        allocator's settings (a MALLOC_* or GLIBC_TUNABLES variable, or an LD_PRELOADed
        allocator), which are left alone.
    """
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
