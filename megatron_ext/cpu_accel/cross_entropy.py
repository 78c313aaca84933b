"""Forward-only per-row cross entropy of float32 CPU logits in one compiled C++ pass per row
(csrc/cross_entropy_cpu.cpp): the row maximum, then the sum of exp(x - max) with a vectorised
polynomial exp (under 1 ulp), then log(sum) - (x[target] - max), accumulated in float64.

`chunked_head_cross_entropy` (megatron_ext.tensor_parallel) uses it on each chunk of the
scoring head's logits. The kernel is compiled on first use (`megatron_ext.cpu_accel.build`);
`kernel_error()` says why it cannot be used here (no compiler, a failed build).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch

from megatron_ext.cpu_accel.build import build_library, load_error

__all__ = ["cross_entropy", "exp", "kernel_error", "load_library"]

_SOURCE = Path(__file__).resolve().parent / "csrc" / "cross_entropy_cpu.cpp"
_INT64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@functools.lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL:
    """The compiled kernel, built on first use (CpuKernelUnavailable when it cannot be)."""
    lib = build_library(
        _SOURCE, "CPU cross-entropy kernel", "the scoring loss uses torch ops (slower)"
    )
    lib.cross_entropy_f32.argtypes = [_PTR, _INT64, _INT64, _INT64, _PTR, _PTR, ctypes.c_int]
    lib.cross_entropy_f32.restype = None
    lib.exp_f32.argtypes = [_PTR, _PTR, _INT64]
    lib.exp_f32.restype = None
    return lib


@functools.lru_cache(maxsize=None)
def kernel_error() -> Optional[str]:
    """None when the kernel is usable here, else the one-line reason."""
    return load_error(load_library)


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Per-row loss [n] (float32) of float32 CPU logits [n, V] (rows contiguous) against int64
    targets [n], into `out` if given; the same for any thread count. IndexError: a target
    outside [0, V)."""
    n, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.device.type != "cpu":
        raise TypeError(f"expected float32 CPU logits, got {logits.dtype} on {logits.device}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    target = target.to(torch.int64).contiguous()
    if target.shape != (n,):
        raise ValueError(f"expected {n} target ids, got shape {tuple(target.shape)}")
    if n and (int(target.min()) < 0 or int(target.max()) >= vocab):
        bad = target[(target < 0) | (target >= vocab)][0]
        raise IndexError(f"target id {int(bad)} is out of range for a vocabulary of {vocab}")
    if out is None:
        out = torch.empty(n, dtype=torch.float32)
    load_library().cross_entropy_f32(
        logits.data_ptr(), n, vocab, logits.stride(0), target.data_ptr(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp of float32 CPU x with the kernel's exp (for its accuracy tests)."""
    x = x.to(torch.float32).contiguous()
    y = torch.empty_like(x)
    load_library().exp_f32(x.data_ptr(), y.data_ptr(), x.numel())
    return y
