"""Fused LEV modes on CPU: a compiled C++ twin of the Triton kernel (`--lev-kernel cpu`).

`lev.fused.fused_lev_modes` evaluates steps 3c-3e with torch ops over [h, d, n, kappa] and
[h, d, n, r] tensors: about fifteen elementwise passes and three batched matmuls per chunk,
which at small widths cost more than the arithmetic. Here one C++ loop (csrc/lev_cpu.cpp) per
(head, id) evaluates each spline value from the three non-zero basis values of its coordinate
and multiplies it into the mode at once; backward recomputes them per (head, coordinate) and
accumulates dL/dDelta and dL/dt in the same pass. Nothing of size h*d*r per id is stored.

The function is the same as `lev.math.lev_modes` (docs/lev.md steps 3a-3e) and saves the same
tensors as `lev.fused` (the seeds z [N, d_in] and the modes M [N, h, r]); steps 3a-3b (seed
projection, LayerNorm, sigmoid) stay torch ops, recomputed in backward. The product is taken as
the product of the signed factors sign(phi)(|phi| + eps) with periodic renormalisation, equal to
the spec's sign * exp(sum log(|phi| + eps)) up to rounding (see the C++ file).

The C++ source is compiled on first use with the system C++ compiler ($CXX, else c++ or g++)
into a shared library cached under $MEGATRON_EXT_CACHE (default ~/.cache/megatron_ext), keyed
by the source, the flags, the compiler and the CPU; later processes load it in milliseconds.
`cpu_kernel_error()` says why it cannot be used (no compiler, a failed build), and
`--lev-kernel auto` then logs that reason once and runs `lev.fused`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

from megatron_ext.lev import math as lev_math

logger = logging.getLogger(__name__)

__all__ = ["cpu_lev_modes", "cpu_kernel_error", "load_library", "CpuKernelUnavailable"]

_SOURCE = Path(__file__).resolve().parent / "csrc" / "lev_cpu.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]
_INT64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class CpuKernelUnavailable(RuntimeError):
    """The C++ LEV kernel cannot be built or loaded here (the message says why)."""


def _cache_dir() -> Path:
    root = os.environ.get("MEGATRON_EXT_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_ext"


def _compiler() -> str:
    """$CXX when set (and only it), else the first of c++, g++, clang++ on the PATH."""
    chosen = os.environ.get("CXX")
    for name in [chosen] if chosen else ["c++", "g++", "clang++"]:
        if shutil.which(name):
            return shutil.which(name)
    where = f"$CXX={chosen}" if chosen else "c++, g++, clang++"
    raise CpuKernelUnavailable(
        f"no C++ compiler found ({where}) to build the CPU LEV kernel; install one (e.g. "
        "apt-get install g++), set $CXX, or pass --lev-kernel torch"
    )


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as handle:
            lines = [ln for ln in handle if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _build(compiler: str, target: Path) -> None:
    """Compile to a temporary name in the cache, then rename (safe with concurrent ranks)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", tmp], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise CpuKernelUnavailable(
                f"building the CPU LEV kernel with {compiler} failed: "
                f"{proc.stderr.strip()[-500:]}; fix the compiler or pass --lev-kernel torch"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL:
    """The compiled kernel library (built on first use; cached on disk and per process).

    Raises:
        CpuKernelUnavailable: no compiler, or the build failed.
    """
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\n".join([_SOURCE.read_text(), " ".join(_FLAGS), version, _cpu_signature()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"lev_cpu_{key}.so"
    if not target.exists():
        logger.info("building the CPU LEV kernel %s", target)
        _build(compiler, target)
    lib = ctypes.CDLL(str(target))
    ints = [_INT64] * 5 + [ctypes.c_int, ctypes.c_double, ctypes.c_int]
    for dtype in ("f32", "f64"):
        forward = getattr(lib, f"lev_forward_{dtype}")
        forward.argtypes = [_PTR] * 3 + ints
        forward.restype = None
        backward = getattr(lib, f"lev_backward_{dtype}")
        backward.argtypes = [_PTR] * 5 + ints
        backward.restype = None
    return lib


@functools.lru_cache(maxsize=None)
def cpu_kernel_error() -> Optional[str]:
    """None when the CPU kernel is usable here, else the one-line reason."""
    try:
        load_library()
    except (CpuKernelUnavailable, OSError) as err:
        return str(err)
    return None


def _suffix(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.float64: "f64"}[dtype]


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


def _autocast_off(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


def _seed_to_t(z, params, opts) -> torch.Tensor:
    """Steps 3a-3b: z [N, d_in] -> t [h, N, d] (contiguous)."""
    return lev_math.seed_to_t(z, *params, opts.temperature, opts.norm_eps).contiguous()


class _CpuLEVModes(torch.autograd.Function):
    """z [N, d_in] -> M [N, h, r]; saves z and M (like `lev.fused`)."""

    @staticmethod
    def forward(ctx, z, seed_proj, norm_weight, norm_bias, spline_delta, opts):
        lib = load_library()
        with _autocast_off(z.device), torch.no_grad():
            cdt = lev_math.compute_dtype(z.dtype)
            params = [p.to(cdt) for p in (seed_proj, norm_weight, norm_bias)]
            t = _seed_to_t(z.to(cdt), params, opts)  # [h, N, d]
            coeff = (1 + spline_delta.to(cdt)).contiguous()  # [h, d, kappa, r]
            h, d, kappa, r = coeff.shape
            n = z.shape[0]
            modes = torch.empty(n, h, r, dtype=cdt)
            getattr(lib, f"lev_forward_{_suffix(cdt)}")(
                _ptr(t), _ptr(coeff), _ptr(modes), h, n, d, kappa, r,
                int(opts.normalize_basis), float(opts.product_eps), torch.get_num_threads(),
            )  # fmt: skip
        ctx.opts = opts
        ctx.save_for_backward(z, seed_proj, norm_weight, norm_bias, spline_delta, modes)
        return modes

    @staticmethod
    def backward(ctx, grad_modes):
        z, seed_proj, norm_weight, norm_bias, spline_delta, modes = ctx.saved_tensors
        opts = ctx.opts
        need_z, need_w, need_g, need_b, need_delta = ctx.needs_input_grad[:5]
        lib = load_library()
        with _autocast_off(z.device):
            cdt = modes.dtype
            params = [
                p.detach().to(cdt).requires_grad_(need)
                for p, need in ((seed_proj, need_w), (norm_weight, need_g), (norm_bias, need_b))
            ]
            zc = z.detach().to(cdt).requires_grad_(need_z)
            with torch.enable_grad():
                t = _seed_to_t(zc, params, opts)  # [h, N, d]
            coeff = (1 + spline_delta.detach().to(cdt)).contiguous()
            h, d, kappa, r = coeff.shape
            n = z.shape[0]
            scaled = (grad_modes.to(cdt) * modes).contiguous()  # dL/dM * M, [N, h, r]
            t_hdn = t.detach().transpose(1, 2).contiguous()  # one contiguous row per task
            grad_coeff = torch.empty_like(coeff)
            grad_t_hdn = torch.empty_like(t_hdn)
            getattr(lib, f"lev_backward_{_suffix(cdt)}")(
                _ptr(t_hdn), _ptr(coeff), _ptr(scaled), _ptr(grad_coeff), _ptr(grad_t_hdn),
                h, n, d, kappa, r, int(opts.normalize_basis), float(opts.product_eps),
                torch.get_num_threads(),
            )  # fmt: skip
            inputs = ([zc] if need_z else []) + [p for p in params if p.requires_grad]
            grad_t = grad_t_hdn.transpose(1, 2)
            grads = list(torch.autograd.grad(t, inputs, grad_t)) if inputs else []
        grad_z = grads.pop(0).to(z.dtype) if need_z else None
        grad_params = [
            grads.pop(0).to(p.dtype) if need else None
            for p, need in ((seed_proj, need_w), (norm_weight, need_g), (norm_bias, need_b))
        ]
        grad_delta = grad_coeff.to(spline_delta.dtype) if need_delta else None
        return (grad_z, *grad_params, grad_delta, None)


def cpu_lev_modes(
    z: torch.Tensor,
    seed_proj: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    spline_delta: torch.Tensor,
    opts,
) -> torch.Tensor:
    """Same function as `lev.math.lev_modes` on CPU tensors, memory O(N*(d_in + h*r)).

    Args:
        z: [N, d_in] seeds; seed_proj [h, d, d_in]; norm_weight, norm_bias [h, d];
            spline_delta [h, d, kappa, r] (h = heads on this rank), all on the CPU.
        opts: the LEV options (temperature, normalize_basis, norm_eps, product_eps; e.g.
            the LEVConfig); chunk_size is not used (no chunking:
            the kernel has no large temporaries).
    Returns:
        M: [N, h, r] in float32 (float64 if z is float64), whatever the autocast state.
    Raises:
        CpuKernelUnavailable: the kernel cannot be built here (see `cpu_kernel_error`).
    """
    if z.device.type != "cpu":
        raise ValueError(f"the CPU LEV kernel got a tensor on {z.device}; use --lev-kernel auto")
    return _CpuLEVModes.apply(z, seed_proj, norm_weight, norm_bias, spline_delta, opts)
