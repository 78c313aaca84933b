"""Fused LEV modes in torch ops (the "torch" backend of `lev.kernels`): steps 3c-3e chunk by
chunk of ids, all heads at once (layout [h, d, n, .], one batched matmul per coordinate)::

    B = basis(t)              [h, d, n, kappa]   three non-zeros per row (docs/lev.md step 3c)
    phi = B @ (1 + Delta)     [h, d, n, r]
    M = prod_d (phi -/+ eps)  [h, n, r]          `separable_product_from_phi` (step 3e)

    backward, G_M = dL/dM * M, x = phi -/+ eps:
    dL/dphi = G_M / x,  dL/dDelta = B^T @ dL/dphi,  dL/dB = dL/dphi @ (1 + Delta)^T -> dL/dy

At phi == 0 the gradient takes x = +eps (one-sided). Large temporaries live in per-call
workspaces reused by every chunk (on CPU fresh multi-megabyte tensors cost page faults).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from megatron_ext.lev.kernels import LEVKernelOptions

__all__ = [
    "TORCH_BACKEND",
    "TORCH_SEED_NORM",
    "TorchBackend",
    "TorchSeedNorm",
    "default_chunk_size",
    "PRODUCT_GROUP",
    "exact_ldexp",
    "separable_product_from_phi",
    "signed_factors",
]

# Spline values per chunk when the chunk size is automatic: h*d*r*n of them. 2M (8 MiB in
# float32) keeps a chunk's working set in the last-level cache; measured best on CPU.
_AUTO_CHUNK_ELEMENTS = 1 << 21


def default_chunk_size(num_heads: int, seed_dim: int, rank: int) -> int:
    """Ids per chunk so that one chunk's spline values hold about 2M numbers."""
    return max(1, _AUTO_CHUNK_ELEMENTS // (num_heads * seed_dim * rank))


def _prefix(buffer: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous [shape] view on the start of a flat workspace buffer."""
    return buffer[: math.prod(shape)].view(shape)


# ----------------------------------------------------------------------------- basis


@dataclass
class _BasisParts:
    """The three non-zero basis values per coordinate and what their derivative needs."""

    index: torch.Tensor  # [..., 3] knot indices c-1, c, c+1 (clamped into range; int64)
    values: torch.Tensor  # [..., 3] basis values (normalised if asked; 0 for dropped knots)
    slopes: torch.Tensor  # [..., 3] d(unnormalised value)/ds (0 for dropped knots)
    total: Optional[torch.Tensor]  # [..., 1] sum of unnormalised values (None: not normalised)


def _basis_parts(t: torch.Tensor, num_knots: int, normalize: bool) -> _BasisParts:
    s = t * (num_knots - 1)
    nearest = torch.floor(s + 0.5)
    f = (s - nearest).unsqueeze(-1)
    half_minus, half_plus = 0.5 - f, 0.5 + f
    values = torch.cat([0.5 * half_minus.square(), 0.75 - f.square(), 0.5 * half_plus.square()], -1)
    slopes = torch.cat([-half_minus, -2.0 * f, half_plus], dim=-1)
    c = nearest.long().unsqueeze(-1)
    index = c + torch.arange(-1, 2, device=t.device)
    # Knots -1 and kappa do not exist: their basis functions are dropped (the missing mass is
    # what normalisation restores).
    keep = ((index >= 0) & (index < num_knots)).to(values.dtype)
    values.mul_(keep)
    slopes.mul_(keep)
    index.clamp_(0, num_knots - 1)
    total = None
    if normalize:
        total = values.sum(dim=-1, keepdim=True)
        values = values / total
    return _BasisParts(index=index, values=values, slopes=slopes, total=total)


def _dense_basis(parts: _BasisParts, out: torch.Tensor) -> torch.Tensor:
    """Scatter the three values into a dense [..., kappa] row (`out` is overwritten)."""
    out.zero_()
    # scatter_add: a dropped knot's clamped index may coincide with a kept one; it adds 0.
    return out.scatter_add_(-1, parts.index, parts.values)


def _basis_backward(grad_basis: torch.Tensor, parts: _BasisParts, num_knots: int) -> torch.Tensor:
    """dL/dt from dL/dB [..., kappa] through the three non-zero basis values."""
    g = torch.gather(grad_basis, -1, parts.index)  # [..., 3]
    grad_s = (g * parts.slopes).sum(-1)
    if parts.total is not None:
        # B_j = w_j / T:  dB_j/ds = (w'_j - B_j T') / T.
        total_slope = parts.slopes.sum(-1)
        grad_s = (grad_s - total_slope * (g * parts.values).sum(-1)) / parts.total.squeeze(-1)
    return grad_s * (num_knots - 1)


# ----------------------------------------------------------------------------- product

PRODUCT_GROUP = 64
"""Mantissas multiplied between two renormalisations (the same in every backend): a running
mantissa in [1/2, 1) times 64 more stays above 2^-65, well inside float32's normal range."""

_FLOAT_BITS = {
    # dtype: (integer dtype of the same width, mantissa bits, exponent bias, ldexp step limit)
    torch.float32: (torch.int32, 23, 127, 100),
    torch.float64: (torch.int64, 52, 1023, 1000),
}


def signed_factors(
    phi: torch.Tensor, eps: float, scratch: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """x = phi - eps where phi < 0, else phi + eps, in place on `phi`: sign(phi) * (|phi| + eps)
    with phi == 0 (also -0.0, turned into +0.0 by adding 0) a positive factor, as the sign count
    of docs/lev.md step 3e has it. `scratch` (phi's shape) avoids a temporary."""
    eps_t = torch.tensor(eps, dtype=phi.dtype, device=phi.device)
    return phi.add_(0.0).add_(torch.copysign(eps_t, phi, out=scratch))


def _power_of_two(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^k exactly, for integer k within the normal range of `dtype` (built from its bits)."""
    int_dtype, mant, bias, _ = _FLOAT_BITS[dtype]
    return ((k.to(int_dtype) + bias) << mant).view(dtype)


def exact_ldexp(mantissa: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """mantissa * 2^exponent rounded once (to inf or 0 only when out of range), for
    1/2 <= |mantissa| < 1, the same on every device (torch.ldexp may form 2^exponent first,
    which overflows before the product does): the first step is exact, only the second rounds."""
    limit = _FLOAT_BITS[mantissa.dtype][3]
    first = exponent.clamp(-limit, limit)
    second = (exponent - first).clamp(-limit, limit)
    dtype = mantissa.dtype
    return mantissa * _power_of_two(first, dtype) * _power_of_two(second, dtype)


def separable_product_from_phi(
    phi: torch.Tensor,
    eps: float,
    mantissa: Optional[torch.Tensor] = None,
    exponent: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """M [h, n, r] = sign * exp(sum_d log(|phi| + eps)) from phi [h, d, n, r] (dim 1 = d).

    The signed product of `lev.kernels` ("The signed product"): each factor x = phi -/+ eps is
    split by frexp into a mantissa in [1/2, 1) and an integer exponent (phi == 0 counts as eps,
    split in float64 so that an eps below the dtype's range counts exactly); the mantissas are
    multiplied, renormalised every PRODUCT_GROUP factors, the exponents summed, and the result
    rounded once. No log or exp, and no partial product can overflow or underflow. `phi` is
    overwritten; the optional `mantissa` (phi's dtype) and `exponent` (int32) buffers of phi's
    shape avoid allocating full-size temporaries (page faults cost more than the arithmetic).
    """
    if mantissa is None:
        mantissa = torch.empty_like(phi)
    if exponent is None:
        exponent = torch.empty(phi.shape, dtype=torch.int32, device=phi.device)
    info = torch.finfo(phi.dtype)
    zero = None if info.tiny <= eps <= info.max else phi == 0
    torch.frexp(signed_factors(phi, eps, scratch=mantissa), out=(mantissa, exponent))
    if zero is not None:
        # Where eps is a normal number of the dtype, frexp(+eps) is already eps's own split.
        eps_mantissa, eps_exponent = math.frexp(eps)
        mantissa.masked_fill_(zero, eps_mantissa)
        exponent.masked_fill_(zero, eps_exponent)
    total = exponent.sum(dim=1, dtype=torch.int32)  # |sum| <= 1100 d
    acc = None
    for start in range(0, phi.shape[1], PRODUCT_GROUP):
        part = mantissa[:, start : start + PRODUCT_GROUP].prod(dim=1)
        acc, shift = torch.frexp(part if acc is None else acc.mul_(part))
        total += shift
    return exact_ldexp(acc, total)


# ----------------------------------------------------------------------------- backend


class _Workspace:
    """Flat buffers for one call, sized for a full chunk; each chunk views their prefix."""

    def __init__(self, h, d, chunk, kappa, r, dtype, device, backward: bool):
        numel = h * d * chunk
        self.basis = torch.empty(numel * kappa, dtype=dtype, device=device)
        self.phi = torch.empty(numel * r, dtype=dtype, device=device)
        self.mantissa = torch.empty(numel * r, dtype=dtype, device=device)
        self.exponent = torch.empty(numel * r, dtype=torch.int32, device=device)
        if backward:
            self.grad_basis = torch.empty(numel * kappa, dtype=dtype, device=device)


def _chunks(t: torch.Tensor, coeff: torch.Tensor, opts: "LEVKernelOptions", backward: bool):
    """Per chunk of the ids of t [h, N, d], with coeff = 1 + Delta [h, d, kappa, r]: (ids slice,
    tt [h, d, n], basis parts, B [h*d, n, kappa], phi = B @ coeff [h, d, n, r], workspace)."""
    h, d, kappa, r = coeff.shape
    n_total = t.shape[1]
    chunk = max(1, min(opts.chunk_size or default_chunk_size(h, d, r), n_total))
    ws = _Workspace(h, d, chunk, kappa, r, t.dtype, t.device, backward)
    for start in range(0, n_total, chunk):
        n = min(chunk, n_total - start)
        tt = t[:, start : start + n].transpose(1, 2).contiguous()
        parts = _basis_parts(tt, kappa, opts.normalize_basis)
        basis3 = _dense_basis(parts, _prefix(ws.basis, h, d, n, kappa)).view(h * d, n, kappa)
        phi = _prefix(ws.phi, h, d, n, r)
        torch.bmm(basis3, coeff.view(h * d, kappa, r), out=phi.view(h * d, n, r))
        yield slice(start, start + n), tt, parts, basis3, phi, ws


class TorchSeedNorm:
    """`LEVBackend.seed_norm` in torch ops: layer_norm and addcmul, their autograd for backward."""

    def forward(self, u, gain, shift, eps):
        """(LN(u) * g + b) / tau = LN(u) * (g / tau) + b / tau: one addcmul after layer_norm."""
        return torch.addcmul(shift, F.layer_norm(u, (u.shape[-1],), eps=eps), gain)

    def backward(self, u, gain, grad_y, eps):
        """The local autograd graph of `forward`."""
        inputs = [x.detach().requires_grad_() for x in (u, gain, torch.zeros_like(gain))]
        with torch.enable_grad():
            y = self.forward(*inputs, eps)
        return tuple(torch.autograd.grad(y, inputs, grad_y))


TORCH_SEED_NORM = TorchSeedNorm()


class TorchBackend:
    """Steps 3c-3e in chunked torch ops (`lev.kernels.LEVBackend`; any device)."""

    name = "torch"
    seed_norm = TORCH_SEED_NORM

    def forward(self, t: torch.Tensor, delta: torch.Tensor, opts: "LEVKernelOptions"):
        """See `lev.kernels.LEVBackend`."""
        h, d, kappa, r = delta.shape
        modes = torch.empty(t.shape[1], h, r, dtype=t.dtype, device=t.device)
        for ids, _, _, _, phi, ws in _chunks(t, 1 + delta, opts, backward=False):
            shape = phi.shape
            mantissa, exponent = _prefix(ws.mantissa, *shape), _prefix(ws.exponent, *shape)
            product = separable_product_from_phi(phi, opts.product_eps, mantissa, exponent)
            modes[ids] = product.transpose(0, 1)
        return modes

    def backward(self, t, delta, grad, opts: "LEVKernelOptions"):
        """See `lev.kernels.LEVBackend`."""
        h, d, kappa, r = delta.shape
        coeff = 1 + delta
        coeff3_t = coeff.view(h * d, kappa, r).transpose(1, 2)  # [h*d, r, kappa]
        scaled = grad.transpose(0, 1).unsqueeze(1)  # [h, 1, N, r]
        grad_t = torch.empty_like(t)
        grad_coeff = torch.zeros_like(coeff)
        for ids, tt, parts, basis3, x, ws in _chunks(t, coeff, opts, backward=True):
            n = tt.shape[2]
            # dM/dphi = M / x with x = phi -/+ eps; dL/d(1 + Delta) = dL/dDelta.
            factors = signed_factors(x, opts.product_eps, _prefix(ws.mantissa, h, d, n, r))
            grad_phi3 = torch.div(scaled[:, :, ids], factors, out=x).view(h * d, n, r)
            grad_coeff.view(h * d, kappa, r).baddbmm_(basis3.transpose(1, 2), grad_phi3)
            grad_basis = _prefix(ws.grad_basis, h, d, n, kappa)
            torch.bmm(grad_phi3, coeff3_t, out=grad_basis.view(h * d, n, kappa))
            grad_t_chunk = _basis_backward(grad_basis, parts, kappa)  # [h, d, n]
            # Through the sigmoid t = sigmoid(y): dL/dy = dL/dt * t * (1 - t).
            grad_t[:, ids] = grad_t_chunk.mul_(tt * (1 - tt)).transpose(1, 2)
        return grad_t, grad_coeff


TORCH_BACKEND = TorchBackend()
