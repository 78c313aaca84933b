"""Fused LEV modes: seed z -> separable modes M with recompute-in-backward.

`lev.math.lev_modes` keeps every intermediate for autograd: t [h, N, d], the dense basis
[h, N, d, kappa] and the spline values phi [h, N, d, r] (h*d*(kappa + r) numbers per id, about
80k at the defaults: far more than the [N, D] embedding it produces). `fused_lev_modes` computes
the same function but saves only its input z [N, d_in] and its output M [N, h, r], i.e.
O(N * (d_in + h*r)) memory, and recomputes the rest chunk by chunk in backward.

Forward, per chunk of n ids (all heads at once, layout [h, d, n, .] so that the spline evaluation
is one batched matmul per (head, coordinate))::

    t = sigmoid(LN(z W^T) / tau)                  [h, n, d]        (lev.math.seed_to_t)
    B = basis(t)                                  [h, d, n, kappa] (3 non-zeros per row)
    phi = B @ (1 + Delta)                         [h, d, n, r]
    x = phi + copysign(eps, phi)                  sign(phi) * (|phi| + eps)
    M = prod_d x                                  [h, n, r]

The last line is docs/lev.md step 3e, sign * exp(sum_d log(|phi| + eps)): the product of the signed
factors has the sign (-1)^(#negative phi) and the magnitude prod(|phi| + eps). It is evaluated
by multiplying groups of G coordinates before one log|.| (and one sign count) per group, which
cuts the transcendental work G-fold. G is chosen so that no product of G factors (each >= eps)
can underflow; if one overflows (|phi| > ~4e9 in float32) the chunk falls back to one log per
factor, so the result never depends on the grouping beyond rounding.

The basis is built from the three non-zero values per coordinate (nearest knot c = round(s),
s = (kappa-1) t, f = s - c: B_{c-1} = (1/2 - f)^2 / 2, B_c = 3/4 - f^2, B_{c+1} = (1/2 + f)^2 / 2,
knots outside [0, kappa-1] dropped, then renormalised), scattered into a dense [.., kappa] row
for the matmul. It equals `lev.math.bspline_basis` (the definition, docs/lev.md step 3c) up to
rounding.

Backward, per chunk, with G_M = dL/dM * M and the same x:

    dL/dphi[l, d, n, rho] = G_M[l, n, rho] * sign(phi) / (|phi| + eps) = G_M / x
    dL/dDelta[l, d]       = B[l, d]^T @ dL/dphi[l, d]      (batched matmul)
    dL/dB[l, d]           = dL/dphi[l, d] @ (1 + Delta[l, d])^T

dL/dB goes through the three basis values analytically to dL/dt, and from t through the
(cheap) sigmoid, LayerNorm and seed projection by a local autograd graph rebuilt for the chunk.
At phi == 0 exactly (an exact cancellation, never seen in practice) the gradient uses
x = +eps, the one-sided derivative, where autograd through |phi| would give 0.

Large temporaries live in per-call workspaces reused by every chunk: on CPU, allocating fresh
multi-megabyte tensors per op costs more (page faults) than the arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from megatron_ext.lev.kernels import LEVKernelOptions

__all__ = [
    "TORCH_BACKEND",
    "TorchBackend",
    "default_chunk_size",
    "group_size",
    "fast_bspline_basis",
    "separable_product_from_phi",
]

# Spline values per chunk when the chunk size is automatic: h*d*r*n of them. 2M (8 MiB in
# float32) keeps a chunk's working set in the last-level cache; measured best on CPU.
_AUTO_CHUNK_ELEMENTS = 1 << 21


def default_chunk_size(num_heads: int, seed_dim: int, rank: int) -> int:
    """Ids per chunk so that one chunk's spline values hold about 2M numbers."""
    return max(1, _AUTO_CHUNK_ELEMENTS // (num_heads * seed_dim * rank))


def group_size(dtype: torch.dtype, eps: float) -> int:
    """Largest G <= 8 such that a product of G factors of magnitude >= eps stays normal."""
    if eps >= 1.0:
        return 8
    return max(1, min(8, int(math.log(torch.finfo(dtype).tiny) / math.log(eps))))


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


def fast_bspline_basis(t: torch.Tensor, num_knots: int, normalize: bool = True) -> torch.Tensor:
    """The basis of `lev.math.bspline_basis` from its three non-zero values (no autograd).

    Args:
        t: [...] in [0, 1].
    Returns:
        [..., kappa].
    """
    parts = _basis_parts(t, num_knots, normalize)
    out = torch.empty(*t.shape, num_knots, dtype=t.dtype, device=t.device)
    return _dense_basis(parts, out)


# ----------------------------------------------------------------------------- product


def _signed_exp(log_abs: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
    return (1 - 2 * (negatives % 2)).to(log_abs.dtype) * log_abs.exp_()


def separable_product_from_phi(
    phi: torch.Tensor,
    eps: float,
    scratch: Optional[torch.Tensor] = None,
    prod_buffer: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """M [h, n, r] = sign * exp(sum_d log(|phi| + eps)) from phi [h, d, n, r] (dim 1 = d).

    With x = sign(phi) (|phi| + eps), M = prod_d x: the product of the signed factors carries
    the sign (-1)^(#negative phi) itself. Factors are multiplied in groups of G (signed), then
    one log|.| and one sign count per group. `phi` is overwritten with x; the optional flat
    buffers avoid allocating full-size temporaries.
    """
    x = signed_factors(phi, eps, scratch)
    d = x.shape[1]
    group = min(group_size(x.dtype, eps), d)
    if group > 1:
        q = d // group
        shape = (x.shape[0], q, *x.shape[2:])
        if prod_buffer is None:
            prod = torch.empty(shape, dtype=x.dtype, device=x.device)
        else:
            prod = _prefix(prod_buffer, *shape)
        torch.mul(x[:, :q], x[:, q : 2 * q], out=prod)
        for g in range(2, group):
            prod.mul_(x[:, g * q : (g + 1) * q])
        negatives = torch.lt(prod, 0).sum(dim=1)
        log_abs = prod.abs_().log_().sum(dim=1)
        if group * q < d:
            rest = x[:, group * q :]
            negatives += torch.lt(rest, 0).sum(dim=1)
            log_abs += rest.abs().log_().sum(dim=1)
        if bool(torch.isfinite(log_abs).all()):
            return _signed_exp(log_abs, negatives)
        # A grouped product overflowed (or phi holds inf/nan): one log per factor.
    return _signed_exp(x.abs().log_().sum(dim=1), torch.lt(x, 0).sum(dim=1))


def signed_factors(
    phi: torch.Tensor, eps: float, scratch: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """x = phi + copysign(eps, phi) = sign(phi) * (|phi| + eps), in place on `phi`.

    At phi == +0 this is +eps (a positive factor, as the sign count of docs/lev.md step 3e has
    it); a -0.0 (which needs every term of the spline sum to be -0.0) would count as negative.
    """
    eps_t = torch.tensor(eps, dtype=phi.dtype, device=phi.device)
    if scratch is None:
        return phi.add_(torch.copysign(eps_t, phi))
    return phi.add_(torch.copysign(eps_t, phi, out=_prefix(scratch, *phi.shape)))


# ----------------------------------------------------------------------------- backend


class _Workspace:
    """Flat buffers for one call, sized for a full chunk; each chunk views their prefix."""

    def __init__(self, h, d, chunk, kappa, r, dtype, device, backward: bool):
        numel = h * d * chunk
        self.basis = torch.empty(numel * kappa, dtype=dtype, device=device)
        self.phi = torch.empty(numel * r, dtype=dtype, device=device)
        self.scratch = torch.empty(numel * r, dtype=dtype, device=device)
        if backward:
            self.grad_basis = torch.empty(numel * kappa, dtype=dtype, device=device)


def _chunk(opts: "LEVKernelOptions", h: int, d: int, r: int, n_total: int) -> int:
    return max(1, min(opts.chunk_size or default_chunk_size(h, d, r), n_total))


class TorchBackend:
    """Steps 3c-3e in chunked torch ops (`lev.kernels.LEVBackend`; any device)."""

    name = "torch"

    def forward(self, t: torch.Tensor, coeff: torch.Tensor, opts: "LEVKernelOptions"):
        """t [h, N, d], coeff [h, d, kappa, r] -> M [N, h, r]."""
        h, d, kappa, r = coeff.shape
        coeff3 = coeff.view(h * d, kappa, r)
        n_total = t.shape[1]
        chunk = _chunk(opts, h, d, r, n_total)
        ws = _Workspace(h, d, chunk, kappa, r, t.dtype, t.device, backward=False)
        modes = torch.empty(n_total, h, r, dtype=t.dtype, device=t.device)
        for start in range(0, n_total, chunk):
            n = min(chunk, n_total - start)
            tt = t[:, start : start + n].transpose(1, 2).contiguous()  # [h, d, n]
            parts = _basis_parts(tt, kappa, opts.normalize_basis)
            basis = _dense_basis(parts, _prefix(ws.basis, h, d, n, kappa))
            phi = _prefix(ws.phi, h, d, n, r)
            torch.bmm(basis.view(h * d, n, kappa), coeff3, out=phi.view(h * d, n, r))
            product = separable_product_from_phi(phi, opts.product_eps, ws.scratch, ws.scratch)
            modes[start : start + n] = product.transpose(0, 1)
        return modes

    def backward(self, t, coeff, grad, opts: "LEVKernelOptions"):
        """grad = dL/dM * M [N, h, r] -> (dL/dt [h, N, d], dL/dcoeff [h, d, kappa, r])."""
        h, d, kappa, r = coeff.shape
        coeff3 = coeff.view(h * d, kappa, r)
        coeff3_t = coeff3.transpose(1, 2)  # [h*d, r, kappa]
        scaled = grad.transpose(0, 1).unsqueeze(1)  # [h, 1, N, r]
        n_total = t.shape[1]
        chunk = _chunk(opts, h, d, r, n_total)
        grad_t = torch.empty_like(t)
        grad_coeff3 = torch.zeros_like(coeff3)
        ws = _Workspace(h, d, chunk, kappa, r, t.dtype, t.device, backward=True)
        for start in range(0, n_total, chunk):
            n = min(chunk, n_total - start)
            tt = t[:, start : start + n].transpose(1, 2).contiguous()  # [h, d, n]
            parts = _basis_parts(tt, kappa, opts.normalize_basis)
            basis = _dense_basis(parts, _prefix(ws.basis, h, d, n, kappa))
            basis3 = basis.view(h * d, n, kappa)
            x = _prefix(ws.phi, h, d, n, r)
            torch.bmm(basis3, coeff3, out=x.view(h * d, n, r))
            # x = phi + copysign(eps, phi); dM/dphi = M / x.
            signed_factors(x, opts.product_eps, ws.scratch)
            grad_phi = torch.div(scaled[:, :, start : start + n], x, out=x)
            grad_phi3 = grad_phi.view(h * d, n, r)
            grad_coeff3.baddbmm_(basis3.transpose(1, 2), grad_phi3)
            grad_basis = _prefix(ws.grad_basis, h, d, n, kappa)
            torch.bmm(grad_phi3, coeff3_t, out=grad_basis.view(h * d, n, kappa))
            grad_t[:, start : start + n] = _basis_backward(grad_basis, parts, kappa).transpose(1, 2)
        return grad_t, grad_coeff3.view(h, d, kappa, r)


TORCH_BACKEND = TorchBackend()
