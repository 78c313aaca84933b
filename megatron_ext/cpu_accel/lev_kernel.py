"""Fused LEV modes on CPU: a compiled C++ twin of the Triton kernel (`--lev-kernel cpu`).

csrc/lev_cpu.cpp evaluates each spline value from the three non-zero basis values of its
coordinate and multiplies it into the mode at once; backward recomputes them per (head,
coordinate), so nothing of size h*d*r per id is stored. Step 3b is C++ too (`CpuSeedNorm`).
Compiled on first use (`cpu_accel.build`); `cpu_kernel_error()` says why it cannot be used.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from pathlib import Path
from typing import Optional

import torch

from megatron_ext.cpu_accel.build import CpuKernelUnavailable, build_library, load_error

logger = logging.getLogger(__name__)

__all__ = [
    "CPU_BACKEND",
    "CpuBackend",
    "cpu_kernel_error",
    "load_library",
    "CpuKernelUnavailable",
]

_SOURCE = Path(__file__).resolve().parent / "csrc" / "lev_cpu.cpp"
_INT64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@functools.lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL:
    """The compiled kernel library, built on first use (CpuKernelUnavailable when it cannot be)."""
    lib = build_library(_SOURCE, "CPU LEV kernel", "pass --lev-kernel torch")
    sizes = [_INT64] * 5  # h, n, d, kappa, r
    strides = [_INT64] * 2  # (head, id) strides of a [h, n, .] operand
    eps = [ctypes.c_int, ctypes.c_double]  # normalize, eps
    threads = [ctypes.c_int]
    for dtype in ("f32", "f64"):
        forward = getattr(lib, f"lev_forward_{dtype}")
        eps_split = [ctypes.c_double, ctypes.c_int32]
        forward.argtypes = [_PTR, *strides, _PTR, _PTR, *sizes, *eps, *eps_split, *threads]
        forward.restype = None
        backward = getattr(lib, f"lev_backward_{dtype}")
        backward.argtypes = [
            _PTR, *strides, _PTR, _PTR, *strides, _PTR, _PTR, *strides, *sizes, *eps, *threads
        ]  # fmt: skip
        backward.restype = None
        norm = getattr(lib, f"lev_seed_logits_{dtype}")
        norm.argtypes = [_PTR] * 4 + [_INT64] * 3 + [ctypes.c_double, *threads]
        norm.restype = None
        norm_backward = getattr(lib, f"lev_seed_logits_backward_{dtype}")
        norm_backward.argtypes = [_PTR] * 6 + [_INT64] * 3 + [ctypes.c_double, *threads]
        norm_backward.restype = None
    return lib


@functools.lru_cache(maxsize=None)
def cpu_kernel_error() -> Optional[str]:
    """None when the CPU kernel is usable here, else the one-line reason."""
    return load_error(load_library)


def _suffix(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.float64: "f64"}[dtype]


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


class CpuSeedNorm:
    """`lev.kernels.LEVBackend.seed_norm` in C++: one pass per (id, head) row for y and for
    dL/du; dL/dgain and dL/dshift summed column by column in id order (the same bits for any
    thread count)."""

    def forward(self, u, gain, shift, eps) -> torch.Tensor:
        """u [N, h, d], gain and shift [h, d] (contiguous) -> y [N, h, d]."""
        n, h, d = u.shape
        y = torch.empty_like(u)
        getattr(load_library(), f"lev_seed_logits_{_suffix(u.dtype)}")(
            _ptr(u), _ptr(gain), _ptr(shift), _ptr(y), n, h, d, float(eps),
            torch.get_num_threads(),
        )  # fmt: skip
        return y

    def backward(self, u, gain, grad_y, eps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dL/dy [N, h, d] -> (dL/du [N, h, d], dL/dgain [h, d], dL/dshift [h, d])."""
        n, h, d = u.shape
        grad_u = torch.empty_like(u)
        grad_gain, grad_shift = torch.empty_like(gain), torch.empty_like(gain)
        getattr(load_library(), f"lev_seed_logits_backward_{_suffix(u.dtype)}")(
            _ptr(u), _ptr(gain), _ptr(grad_y), _ptr(grad_u), _ptr(grad_gain), _ptr(grad_shift),
            n, h, d, float(eps), torch.get_num_threads(),
        )  # fmt: skip
        return grad_u, grad_gain, grad_shift


class CpuBackend:
    """Steps 3c-3e in the C++ kernel (`lev.kernels.LEVBackend`; CPU tensors), and step 3b up
    to the sigmoid (`seed_norm`)."""

    name = "cpu"
    seed_norm = CpuSeedNorm()

    def forward(self, t: torch.Tensor, delta: torch.Tensor, opts) -> torch.Tensor:
        """See `lev.kernels.LEVBackend` (t: any head and id strides)."""
        lib = load_library()
        h, d, kappa, r = delta.shape
        n = t.shape[1]
        if t.stride(2) != 1:
            t = t.contiguous()
        modes = torch.empty(n, h, r, dtype=t.dtype)
        eps_mant, eps_exp = math.frexp(opts.product_eps)
        getattr(lib, f"lev_forward_{_suffix(t.dtype)}")(
            _ptr(t), t.stride(0), t.stride(1), _ptr(delta), _ptr(modes), h, n, d, kappa, r,
            int(opts.normalize_basis), float(opts.product_eps), eps_mant, eps_exp,
            torch.get_num_threads(),
        )  # fmt: skip
        return modes

    def backward(self, t, delta, grad, opts) -> tuple[torch.Tensor, torch.Tensor]:
        """See `lev.kernels.LEVBackend`; t and grad are read through their strides (rows
        contiguous, copied only if not); dL/dy is the [h, N, d] view of an [N, h, d] tensor."""
        lib = load_library()
        h, d, kappa, r = delta.shape
        n = t.shape[1]
        if t.stride(2) != 1:
            t = t.contiguous()
        if grad.stride(2) != 1:
            grad = grad.contiguous()
        grad_delta = torch.empty_like(delta)
        grad_t = torch.empty(n, h, d, dtype=t.dtype).transpose(0, 1)
        getattr(lib, f"lev_backward_{_suffix(t.dtype)}")(
            _ptr(t), t.stride(0), t.stride(1), _ptr(delta), _ptr(grad), grad.stride(1),
            grad.stride(0), _ptr(grad_delta), _ptr(grad_t), grad_t.stride(0), grad_t.stride(1),
            h, n, d, kappa, r, int(opts.normalize_basis), float(opts.product_eps),
            torch.get_num_threads(),
        )  # fmt: skip
        return grad_t, grad_delta


CPU_BACKEND = CpuBackend()
