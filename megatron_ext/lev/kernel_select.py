"""Which implementation runs the fused LEV modes (`--lev-kernel auto|triton|torch`).

"torch" is `lev.fused.fused_lev_modes` (chunked torch ops, any device); "triton" is
`lev.triton_kernel.triton_lev_modes` (CUDA, or CPU under TRITON_INTERPRET=1); "auto" takes
triton for float32 CUDA tensors when the triton package imports, else torch. Both compute the
same function with the same saved tensors (z and M), so a run may switch kernels on resume.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import torch

from megatron_ext.lev import math as lev_math
from megatron_ext.lev.fused import fused_lev_modes

__all__ = ["select_fused_kernel", "triton_importable"]


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """True when the triton package is installed (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def select_fused_kernel(kernel: str, z: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The fused-modes function for `kernel` and the seed tensor z [N, d_in].

    Raises:
        RuntimeError: "triton" asked for where it cannot run (one line saying what to change).
    """
    if kernel == "torch":
        return fused_lev_modes
    cdt = lev_math.compute_dtype(z.dtype)
    if kernel == "auto":
        if not (z.is_cuda and cdt == torch.float32 and triton_importable()):
            return fused_lev_modes
    elif kernel != "triton":
        raise ValueError(f"unknown LEV kernel {kernel!r}; choose auto, triton or torch")
    from megatron_ext.lev import triton_kernel

    triton_kernel.check_triton_usable(z.device, cdt)
    return triton_kernel.triton_lev_modes
