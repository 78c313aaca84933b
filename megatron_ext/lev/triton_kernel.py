"""Fused LEV modes in Triton (the "triton" backend of `lev.kernels`): steps 3c-3e in one kernel
per direction, so no [N, d, r] or [N, d, kappa] tensor is ever in memory.

forward, one program per (head l, block of ids), one pass over the d seed coordinates: the
three basis values of t[l, n, c], phi = sum_j B_j * (1 + Delta[l, c, i_j, :]) in registers, and
the frexp mantissa-exponent product of phi -/+ eps. backward, one program per (head l,
coordinate c) over all ids (deterministic: no atomics): dL/dphi = G / x, dL/dDelta[l, c] +=
B^T @ dL/dphi (tl.dot, IEEE float32), dL/dt from the three basis values, dL/dy = dL/dt*t*(1-t).

Compiled for CUDA tensors; with TRITON_INTERPRET=1 set before this module is imported they run
on CPU tensors in Triton's interpreter (how the tests check them).
"""

from __future__ import annotations

import math
import os

import torch

from megatron_ext.lev.fused import PRODUCT_GROUP, TORCH_SEED_NORM

try:  # Triton is optional: the torch paths serve CPU and machines without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = [
    "TRITON_BACKEND",
    "TritonBackend",
    "TRITON_AVAILABLE",
    "INTERPRETED",
    "check_triton_usable",
]

TRITON_AVAILABLE = triton is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
"""Whether the kernels below were defined for Triton's CPU interpreter (fixed at import)."""

_SUPPORTED_DTYPES = (torch.float32, torch.float64)


def check_triton_usable(device: torch.device, dtype: torch.dtype) -> None:
    """Raise a one-line error when the Triton kernel cannot run on `device` / `dtype`."""
    if not TRITON_AVAILABLE:
        raise RuntimeError(
            "--lev-kernel triton needs the triton package (pip install 'triton==3.9.0', or the "
            "[gpu] extra); use --lev-kernel torch or auto"
        )
    if device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"--lev-kernel triton runs on CUDA tensors, got {device.type} ones (set "
            "TRITON_INTERPRET=1 before start-up for Triton's CPU interpreter); use --lev-kernel "
            "torch or auto"
        )
    if dtype not in _SUPPORTED_DTYPES:
        raise RuntimeError(f"the LEV Triton kernel computes in float32/float64, got {dtype}")


if TRITON_AVAILABLE:

    @triton.jit
    def _basis(t, KNOTS: tl.constexpr, NORMALIZE: tl.constexpr):
        """Three non-zero basis values, their d/ds slopes, knot indices and the total mass."""
        s = t * (KNOTS - 1)
        nearest = tl.floor(s + 0.5)
        f = s - nearest
        half_minus = 0.5 - f
        half_plus = 0.5 + f
        c = nearest.to(tl.int32)
        c = tl.minimum(tl.maximum(c, 0), KNOTS - 1)
        # Knots -1 and kappa do not exist: their basis functions are dropped.
        keep0 = c >= 1
        keep2 = c <= KNOTS - 2
        w0 = tl.where(keep0, 0.5 * half_minus * half_minus, 0.0)
        w1 = 0.75 - f * f
        w2 = tl.where(keep2, 0.5 * half_plus * half_plus, 0.0)
        d0 = tl.where(keep0, -half_minus, 0.0)
        d1 = -2.0 * f
        d2 = tl.where(keep2, half_plus, 0.0)
        total = w0 + w1 + w2
        if NORMALIZE:
            w0 = w0 / total
            w1 = w1 / total
            w2 = w2 / total
        i0 = tl.maximum(c - 1, 0)
        i2 = tl.minimum(c + 1, KNOTS - 1)
        return w0, w1, w2, d0, d1, d2, i0, c, i2, total

    @triton.jit
    def _split(x, IS_F64: tl.constexpr):
        """frexp by bits: x = m * 2^e, 1/2 <= |m| < 1 (finite non-zero x, subnormals too);
        0, inf and NaN give m = x, e = 0 (as lev/csrc/lev_cpu.cpp `split`)."""
        if IS_F64:
            bits = x.to(tl.int64, bitcast=True)
            sub = (((bits >> 52) & 0x7FF) == 0) & (x != 0)
            x = tl.where(sub, x * 18446744073709551616.0, x)  # * 2^64: normal
            bits = x.to(tl.int64, bitcast=True)
            ex = ((bits >> 52) & 0x7FF).to(tl.int32)
            normal = (ex != 0) & (ex != 0x7FF)
            # Clear the exponent field (mask ~(0x7ff << 52)), set it to 1022: [1/2, 1).
            mant = (bits & -9218868437227405313) | 4602678819172646912
            m = tl.where(normal, mant.to(tl.float64, bitcast=True), x)
            e = tl.where(normal, ex - 1022, 0) - tl.where(sub, 64, 0)
        else:
            bits = x.to(tl.int32, bitcast=True)
            sub = (((bits >> 23) & 0xFF) == 0) & (x != 0)
            x = tl.where(sub, x * 18446744073709551616.0, x)
            bits = x.to(tl.int32, bitcast=True)
            ex = (bits >> 23) & 0xFF
            normal = (ex != 0) & (ex != 0xFF)
            mant = (bits & -2139095041) | 1056964608  # ~(0xff << 23); 126 << 23
            m = tl.where(normal, mant.to(tl.float32, bitcast=True), x)
            e = tl.where(normal, ex - 126, 0) - tl.where(sub, 64, 0)
        return m, e

    @triton.jit
    def _power_of_two(k, IS_F64: tl.constexpr):
        """2^k exactly for integer k in the dtype's normal range (built from its bits)."""
        if IS_F64:
            p = ((k.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
        else:
            p = ((k + 127) << 23).to(tl.float32, bitcast=True)
        return p

    @triton.jit
    def _ldexp(m, e, IS_F64: tl.constexpr):
        """m * 2^e rounded once (lev/fused.py exact_ldexp): the first step is exact."""
        if IS_F64:
            first = tl.minimum(tl.maximum(e, -1000), 1000)
            second = tl.minimum(tl.maximum(e - first, -1000), 1000)
        else:
            first = tl.minimum(tl.maximum(e, -100), 100)
            second = tl.minimum(tl.maximum(e - first, -100), 100)
        return m * _power_of_two(first, IS_F64) * _power_of_two(second, IS_F64)

    @triton.jit
    def _lev_modes_fwd_kernel(
        t_ptr,
        delta_ptr,
        m_ptr,
        N,
        D,
        R,
        stride_th,
        stride_tn,
        stride_td,
        stride_mn,
        stride_mh,
        eps_ptr,
        eps_exp,
        KNOTS: tl.constexpr,
        NORMALIZE: tl.constexpr,
        IS_F64: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        head = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        mask_n = offs_n < N
        mask = mask_n[:, None] & (offs_r < R)[None, :]
        # eps and its frexp mantissa in the compute dtype (a float argument would be float32).
        eps = tl.load(eps_ptr)
        eps_mant = tl.load(eps_ptr + 1)
        acc = tl.full([BLOCK_N, BLOCK_R], 1.0, dtype=m_ptr.dtype.element_ty)
        expo = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.int32)
        t_row = t_ptr + head * stride_th + offs_n * stride_tn
        for c in range(0, D):
            t = tl.load(t_row + c * stride_td, mask=mask_n, other=0.5)
            b0, b1, b2, _d0, _d1, _d2, i0, i1, i2, _total = _basis(t, KNOTS, NORMALIZE)
            delta_row = delta_ptr + (head * D + c) * KNOTS * R + offs_r[None, :]
            c0 = 1.0 + tl.load(delta_row + i0[:, None] * R, mask=mask, other=0.0)
            c1 = 1.0 + tl.load(delta_row + i1[:, None] * R, mask=mask, other=0.0)
            c2 = 1.0 + tl.load(delta_row + i2[:, None] * R, mask=mask, other=0.0)
            phi = b0[:, None] * c0
            phi += b1[:, None] * c1
            phi += b2[:, None] * c2
            m, e = _split(tl.where(phi < 0, phi - eps, phi + eps), IS_F64)
            acc *= tl.where(phi == 0, eps_mant, m)
            expo += tl.where(phi == 0, eps_exp, e)
            if c % GROUP == GROUP - 1:
                acc, e = _split(acc, IS_F64)
                expo += e
        modes = _ldexp(acc, expo, IS_F64)
        out = m_ptr + offs_n[:, None] * stride_mn + head * stride_mh + offs_r[None, :]
        tl.store(out, modes, mask=mask)

    @triton.jit
    def _lev_modes_bwd_kernel(
        t_ptr,
        delta_ptr,
        g_ptr,
        grad_t_ptr,
        grad_delta_ptr,
        N,
        D,
        R,
        stride_th,
        stride_tn,
        stride_td,
        stride_gn,
        stride_gh,
        stride_dth,
        stride_dtn,
        stride_dtd,
        eps_ptr,
        KNOTS: tl.constexpr,
        KNOTS_PAD: tl.constexpr,
        NORMALIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        head = tl.program_id(0)
        c = tl.program_id(1)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        knots = tl.arange(0, KNOTS_PAD)
        delta_row = delta_ptr + (head * D + c) * KNOTS * R + offs_r[None, :]
        acc = tl.zeros([KNOTS_PAD, BLOCK_R], dtype=grad_delta_ptr.dtype.element_ty)
        eps = tl.load(eps_ptr)
        for start in range(0, N, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            mask = mask_n[:, None] & mask_r[None, :]
            t_off = head * stride_th + offs_n * stride_tn + c * stride_td
            t = tl.load(t_ptr + t_off, mask=mask_n, other=0.5)
            b0, b1, b2, d0, d1, d2, i0, i1, i2, total = _basis(t, KNOTS, NORMALIZE)
            c0 = 1.0 + tl.load(delta_row + i0[:, None] * R, mask=mask, other=0.0)
            c1 = 1.0 + tl.load(delta_row + i1[:, None] * R, mask=mask, other=0.0)
            c2 = 1.0 + tl.load(delta_row + i2[:, None] * R, mask=mask, other=0.0)
            phi = b0[:, None] * c0 + b1[:, None] * c1 + b2[:, None] * c2
            x = tl.where(phi < 0, phi - eps, phi + eps)
            g_off = offs_n[:, None] * stride_gn + head * stride_gh + offs_r[None, :]
            grad_phi = tl.load(g_ptr + g_off, mask=mask, other=0.0) / x
            g0 = tl.sum(grad_phi * c0, axis=1)
            g1 = tl.sum(grad_phi * c1, axis=1)
            g2 = tl.sum(grad_phi * c2, axis=1)
            grad_s = g0 * d0 + g1 * d1 + g2 * d2
            if NORMALIZE:
                # B_j = w_j / T: dB_j/ds = (w'_j - B_j T') / T.
                grad_s = (grad_s - (d0 + d1 + d2) * (g0 * b0 + g1 * b1 + g2 * b2)) / total
            grad_t_off = head * stride_dth + offs_n * stride_dtn + c * stride_dtd
            # Through the sigmoid t = sigmoid(y): dL/dy = dL/dt * t * (1 - t).
            grad_y = grad_s * (KNOTS - 1) * (t * (1.0 - t))
            tl.store(grad_t_ptr + grad_t_off, grad_y, mask=mask_n)
            dense = tl.where(i0[:, None] == knots[None, :], b0[:, None], 0.0)
            dense += tl.where(i1[:, None] == knots[None, :], b1[:, None], 0.0)
            dense += tl.where(i2[:, None] == knots[None, :], b2[:, None], 0.0)
            acc += tl.dot(tl.trans(dense), grad_phi, input_precision="ieee")
        out = grad_delta_ptr + (head * D + c) * KNOTS * R + knots[:, None] * R + offs_r[None, :]
        tl.store(out, acc, mask=(knots < KNOTS)[:, None] & mask_r[None, :])


def _pad(n: int) -> int:
    """Power of two >= max(n, 16) (tl.arange needs powers of two; tl.dot dims >= 16)."""
    return max(16, triton.next_power_of_2(n))


_BLOCK_N = 32  # ids per block, both directions


class TritonBackend:
    """Steps 3c-3e in the Triton kernels (`lev.kernels.LEVBackend`)."""

    name = "triton"
    seed_norm = TORCH_SEED_NORM

    def forward(self, t: torch.Tensor, delta: torch.Tensor, opts) -> torch.Tensor:
        """See `lev.kernels.LEVBackend` (t: any strides)."""
        check_triton_usable(t.device, t.dtype)
        h, n, d = t.shape
        r = delta.shape[-1]
        modes = torch.empty(n, h, r, dtype=t.dtype, device=t.device)
        if n == 0:
            return modes
        eps_mant, eps_exp = math.frexp(opts.product_eps)
        eps = torch.tensor([opts.product_eps, eps_mant], dtype=t.dtype, device=t.device)
        _lev_modes_fwd_kernel[(h, triton.cdiv(n, _BLOCK_N))](
            t, delta, modes, n, d, r, *t.stride(), modes.stride(0), modes.stride(1), eps, eps_exp,
            KNOTS=delta.shape[2], NORMALIZE=opts.normalize_basis,
            IS_F64=t.dtype == torch.float64, GROUP=PRODUCT_GROUP,
            BLOCK_N=_BLOCK_N, BLOCK_R=_pad(r),
        )  # fmt: skip
        return modes

    def backward(self, t, delta, grad, opts) -> tuple[torch.Tensor, torch.Tensor]:
        """See `lev.kernels.LEVBackend` (dL/dy: the [h, N, d] view of an [N, h, d] tensor)."""
        h, n, d = t.shape
        r = delta.shape[-1]
        grad_t = torch.empty(n, h, d, dtype=t.dtype, device=t.device).transpose(0, 1)
        grad_delta = torch.zeros_like(delta)
        if n == 0:
            return grad_t, grad_delta
        _lev_modes_bwd_kernel[(h, d)](
            t, delta, grad, grad_t, grad_delta, n, d, r, *t.stride(),
            grad.stride(0), grad.stride(1), *grad_t.stride(),
            torch.tensor([opts.product_eps], dtype=t.dtype, device=t.device),
            KNOTS=delta.shape[2], KNOTS_PAD=_pad(delta.shape[2]), NORMALIZE=opts.normalize_basis,
            BLOCK_N=_BLOCK_N, BLOCK_R=_pad(r),
        )  # fmt: skip
        return grad_t, grad_delta


TRITON_BACKEND = TritonBackend()
