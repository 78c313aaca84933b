"""Which implementation runs the fused LEV modes (`--lev-kernel auto|triton|cpu|torch`).

"torch" is `lev.fused.fused_lev_modes` (chunked torch ops, any device); "triton" is
`lev.triton_kernel.triton_lev_modes` (CUDA, or CPU under TRITON_INTERPRET=1); "cpu" is
`lev.cpu_fused.cpu_lev_modes` (a C++ kernel compiled on first use). "auto" takes triton for
float32 CUDA tensors when the triton package imports, cpu for CPU tensors when its kernel builds
(else it logs why, once, and takes torch), else torch. All compute the same function with the
same saved tensors (z and M), so a run may switch kernels on resume.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Callable

import torch

from megatron_ext.lev import math as lev_math
from megatron_ext.lev.fused import fused_lev_modes

__all__ = ["cpu_kernel_available", "select_fused_kernel", "triton_importable"]

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """True when the triton package is installed (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def cpu_kernel_available() -> bool:
    """Whether the CPU kernel is usable; logs the reason once when it is not."""
    from megatron_ext.lev import cpu_fused

    error = cpu_fused.cpu_kernel_error()
    if error is not None:
        logger.warning("LEV runs the torch fused path on CPU (slower): %s", error)
    return error is None


def select_fused_kernel(kernel: str, z: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The fused-modes function for `kernel` and the seed tensor z [N, d_in].

    Raises:
        RuntimeError: "triton" or "cpu" asked for where it cannot run (one line saying what to
            change).
    """
    if kernel == "torch":
        return fused_lev_modes
    if kernel == "cpu" or (kernel == "auto" and z.device.type == "cpu"):
        from megatron_ext.lev import cpu_fused

        if kernel == "auto":
            return cpu_fused.cpu_lev_modes if cpu_kernel_available() else fused_lev_modes
        if z.device.type != "cpu":
            raise RuntimeError(
                f"--lev-kernel cpu runs on CPU tensors, but LEV's input is on {z.device}; "
                "use --lev-kernel auto"
            )
        error = cpu_fused.cpu_kernel_error()
        if error is not None:
            raise RuntimeError(error)
        return cpu_fused.cpu_lev_modes
    cdt = lev_math.compute_dtype(z.dtype)
    if kernel == "auto":
        if not (z.is_cuda and cdt == torch.float32 and triton_importable()):
            return fused_lev_modes
    elif kernel != "triton":
        raise ValueError(f"unknown LEV kernel {kernel!r}; choose auto, triton, cpu or torch")
    from megatron_ext.lev import triton_kernel

    triton_kernel.check_triton_usable(z.device, cdt)
    return triton_kernel.triton_lev_modes
