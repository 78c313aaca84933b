"""Fused LEV modes: seed z -> separable modes M with recompute-in-backward.

`lev.math.lev_modes` keeps every intermediate for autograd: t [h, N, d], the dense basis
[h, N, d, kappa] and the spline values phi [h, N, d, r] (h*d*(kappa + r) numbers per id, about
80k at the defaults: far more than the [N, D] embedding it produces). `fused_lev_modes` computes
the same function but saves only its input z [N, d_in] and its output M [N, h, r], i.e.
O(N * (d_in + h*r)) memory, and recomputes the rest chunk by chunk in backward.

Forward, per chunk of ids (all heads at once, layout [h, d, n, .] so that the spline evaluation
is one batched matmul per (head, coordinate))::

    t = sigmoid(LN(z W^T) / tau)                  [h, n, d]       (lev.math.seed_to_t)
    B = basis(t)                                  [h, d, n, kappa] (lev.math.bspline_basis)
    phi = B @ (1 + Delta)                         [h, d, n, r]
    x = phi + copysign(eps, phi) = sign(phi) (|phi| + eps)
    M = prod_d x = sign * exp(sum_d log(|phi| + eps))

The last line is the spec's formula exactly (the product of the x's has the sign
(-1)^(#negative phi) and magnitude prod(|phi| + eps)); it is evaluated by multiplying groups of
G coordinates before taking one log per group, which cuts the transcendental work G-fold. G is
chosen so that no partial product of G factors (each >= eps in magnitude) can underflow; a
partial product that overflows (|phi| > ~4e9 in float32) sends the chunk to the plain
log-sum form, so the result never depends on the grouping beyond rounding.

Backward, per chunk: with G_M = dL/dM * M,

    dL/dphi[l, d, n, rho] = G_M[l, n, rho] * sign(phi) / (|phi| + eps) = G_M / x
    dL/dDelta[l, d]       = B[l, d]^T @ dL/dphi[l, d]      (batched matmul)
    dL/dB[l, d]           = dL/dphi[l, d] @ (1 + Delta[l, d])^T

and dL/dB is pushed through the (cheap) basis, sigmoid, LayerNorm and seed projection by a local
autograd graph that is rebuilt for the chunk and freed right away. At phi == 0 exactly (never
seen in practice: it needs an exact cancellation) the gradient uses x = +eps, the one-sided
derivative, where autograd through |phi| would give 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_ext.lev import math as lev_math

__all__ = ["FusedOptions", "fused_lev_modes", "default_chunk_size"]

# Spline values per chunk when the chunk size is automatic: h*d*r*n of them (32 MiB in float32)
# keeps a chunk's working set near L3 and makes the Python loop overhead negligible.
_AUTO_CHUNK_ELEMENTS = 1 << 23


@dataclass(frozen=True)
class FusedOptions:
    """The non-tensor arguments of the fused function (from LEVConfig)."""

    temperature: float
    num_knots: int
    normalize_basis: bool
    norm_eps: float
    product_eps: float
    chunk_size: int = 0


def default_chunk_size(num_heads: int, seed_dim: int, rank: int) -> int:
    """Ids per chunk so that one chunk's spline values hold about 8M numbers."""
    return max(1, _AUTO_CHUNK_ELEMENTS // (num_heads * seed_dim * rank))


def group_size(dtype: torch.dtype, eps: float) -> int:
    """Largest G <= 8 such that a product of G factors of magnitude >= eps stays normal."""
    if eps >= 1.0:
        return 8
    return max(1, min(8, int(math.log(torch.finfo(dtype).tiny) / math.log(eps))))


def _signed_factors(phi: torch.Tensor, eps: float) -> torch.Tensor:
    """x = phi + copysign(eps, phi) = sign(phi) * (|phi| + eps), in place on `phi`."""
    return phi.add_(torch.copysign(phi.new_tensor(eps), phi))


def _signed_exp(log_abs: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
    return (1 - 2 * (negatives % 2)).to(log_abs.dtype) * log_abs.exp_()


def _plain_log_product(x: torch.Tensor) -> torch.Tensor:
    """The spec's form: prod over dim 1 of x = sign * exp(sum log|x|). x: [h, d, n, r]."""
    return _signed_exp(x.abs().log_().sum(dim=1), (x < 0).sum(dim=1))


def _grouped_log_product(x: torch.Tensor, group: int) -> Optional[torch.Tensor]:
    """Same as `_plain_log_product` with one log per `group` factors; None on overflow.

    x is left unchanged, so the caller can fall back to `_plain_log_product(x)`.
    """
    q = x.shape[1] // group
    prod = x[:, :q] * x[:, q : 2 * q]
    for g in range(2, group):
        prod.mul_(x[:, g * q : (g + 1) * q])
    log_abs = prod.abs().log_().sum(dim=1)
    negatives = (prod < 0).sum(dim=1)
    rest = x[:, group * q :]
    if rest.shape[1] > 0:
        log_abs += rest.abs().log_().sum(dim=1)
        negatives += (rest < 0).sum(dim=1)
    if not bool(torch.isfinite(log_abs).all()):
        return None
    return _signed_exp(log_abs, negatives)


def separable_product_from_phi(phi: torch.Tensor, eps: float) -> torch.Tensor:
    """M [h, n, r] = prod_d phi as sign * exp(sum_d log(|phi| + eps)); phi [h, d, n, r].

    `phi` is overwritten (it becomes the signed factors x).
    """
    x = _signed_factors(phi, eps)
    group = min(group_size(x.dtype, eps), x.shape[1])
    if group > 1:
        out = _grouped_log_product(x, group)
        if out is not None:
            return out
    return _plain_log_product(x)


def _autocast_off(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


class _FusedLEVModes(torch.autograd.Function):
    """z [N, d_in] -> M [N, h, r]; saves only z and M (see the module docstring)."""

    @staticmethod
    def forward(ctx, z, seed_proj, norm_weight, norm_bias, spline_delta, opts: FusedOptions):
        with _autocast_off(z.device):
            cdt = lev_math.compute_dtype(z.dtype)
            params = [p.to(cdt) for p in (seed_proj, norm_weight, norm_bias)]
            coeff = 1 + spline_delta.to(cdt)  # [h, d, kappa, r]
            h, d, _, r = coeff.shape
            n = z.shape[0]
            chunk = opts.chunk_size or default_chunk_size(h, d, r)
            modes = torch.empty(n, h, r, dtype=cdt, device=z.device)
            for start in range(0, n, chunk):
                basis = _chunk_basis(z[start : start + chunk].to(cdt), params, opts)
                phi = torch.matmul(basis, coeff)  # [h, d, n, r]
                product = separable_product_from_phi(phi, opts.product_eps)  # [h, n, r]
                modes[start : start + chunk] = product.transpose(0, 1)
        ctx.opts = opts
        ctx.chunk = chunk
        ctx.save_for_backward(z, seed_proj, norm_weight, norm_bias, spline_delta, modes)
        return modes

    @staticmethod
    def backward(ctx, grad_modes):
        z, seed_proj, norm_weight, norm_bias, spline_delta, modes = ctx.saved_tensors
        opts: FusedOptions = ctx.opts
        need_z, need_w, need_g, need_b, need_delta = ctx.needs_input_grad[:5]
        with _autocast_off(z.device):
            cdt = modes.dtype
            params = [
                p.detach().to(cdt).requires_grad_(need)
                for p, need in ((seed_proj, need_w), (norm_weight, need_g), (norm_bias, need_b))
            ]
            coeff = 1 + spline_delta.detach().to(cdt)  # [h, d, kappa, r]
            h, d, kappa, r = coeff.shape
            coeff_t = coeff.transpose(-1, -2)  # [h, d, r, kappa]
            # dL/dM * M, the factor shared by every dL/dphi of one mode.
            scaled = (grad_modes.to(cdt) * modes).transpose(0, 1)  # [h, N, r]
            grad_z = torch.empty(z.shape, dtype=cdt, device=z.device) if need_z else None
            grad_params = [torch.zeros_like(p) if p.requires_grad else None for p in params]
            grad_coeff = torch.zeros_like(coeff) if need_delta else None
            n = z.shape[0]
            for start in range(0, n, ctx.chunk):
                stop = min(start + ctx.chunk, n)
                zc = z[start:stop].detach().to(cdt).requires_grad_(need_z)
                with torch.enable_grad():
                    basis = _chunk_basis(zc, params, opts)  # [h, d, n, kappa]
                with torch.no_grad():
                    x = _signed_factors(torch.matmul(basis.detach(), coeff), opts.product_eps)
                    # dM/dphi = M * sign(phi) / (|phi| + eps) = M / x.
                    grad_phi = torch.div(scaled[:, start:stop].unsqueeze(1), x, out=x)
                    if grad_coeff is not None:
                        grad_coeff.view(h * d, kappa, r).baddbmm_(
                            basis.detach().view(h * d, -1, kappa).transpose(1, 2),
                            grad_phi.view(h * d, -1, r),
                        )
                    grad_basis = torch.matmul(grad_phi, coeff_t)  # [h, d, n, kappa]
                    del x, grad_phi
                inputs = ([zc] if need_z else []) + [p for p in params if p.requires_grad]
                if inputs:
                    grads = list(torch.autograd.grad(basis, inputs, grad_basis))
                    if need_z:
                        grad_z[start:stop] = grads.pop(0)
                    for i, p in enumerate(params):
                        if p.requires_grad:
                            grad_params[i] += grads.pop(0)

        def cast(grad, like):
            return None if grad is None else grad.to(like.dtype)

        return (
            cast(grad_z, z),
            cast(grad_params[0], seed_proj),
            cast(grad_params[1], norm_weight),
            cast(grad_params[2], norm_bias),
            cast(grad_coeff, spline_delta),
            None,
        )


def _chunk_basis(z: torch.Tensor, params, opts: FusedOptions) -> torch.Tensor:
    """Steps 3a-3c for a chunk: z [n, d_in] -> basis [h, d, n, kappa] (contiguous)."""
    t = lev_math.seed_to_t(z, *params, opts.temperature, opts.norm_eps)  # [h, n, d]
    return lev_math.bspline_basis(
        t.transpose(1, 2).contiguous(), opts.num_knots, opts.normalize_basis
    )


def fused_lev_modes(
    z: torch.Tensor,
    seed_proj: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    spline_delta: torch.Tensor,
    opts: FusedOptions,
) -> torch.Tensor:
    """Same function as `lev.math.lev_modes`, memory O(N*(d_in + h*r)) for backward.

    Args:
        z: [N, d_in] seeds; seed_proj [h, d, d_in]; norm_weight, norm_bias [h, d];
            spline_delta [h, d, kappa, r] (h = heads on this rank).
    Returns:
        M: [N, h, r] in float32 (float64 if z is float64), whatever the autocast state.
    """
    return _FusedLEVModes.apply(z, seed_proj, norm_weight, norm_bias, spline_delta, opts)
