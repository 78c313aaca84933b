"""The LEV forward pass, one function per step of docs/lev.md section 2, in order.

The readable form (plain torch ops under autograd, `--lev-kernel reference`): the definition,
not the training path (`lev.kernels.lev_modes`). Shapes (N ids, k digits, base b, seed width
d = d_seed, seed input width d_in = d or k*d, h heads on this rank, kappa knots, rank r, model
width D)::

    ids [N] -> digits [N, k] -> z [N, d_in] -> t [h, N, d] -> basis [h, N, d, kappa]
        -> phi [h, N, d, r] -> M [h, N, r] -> e [N, D]

From the seed on everything is float32 (float64 with float64 parameters) whatever the parameter
dtype or autocast: the product of d_seed factors is not safe in bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "compute_dtype",
    "check_ids",
    "to_digits",
    "seed",
    "seed_to_t",
    "bspline_basis",
    "spline_values",
    "separable_product",
    "lev_modes",
    "lev_embed",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (tests); everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Raise a clear error for non-integer ids or ids outside [0, vocab_size) (written in
    base b, such an id would silently become another token)."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"LEV token ids must be an integer tensor, got dtype {ids.dtype}")
    if ids.numel() == 0:
        return
    lo, hi = torch.aminmax(ids)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"LEV got token id {bad}, outside the valid range [0, {vocab_size}) "
            f"(vocab size {vocab_size}); check the tokenizer / --vocab-size and the data"
        )


def to_digits(ids: torch.Tensor, base: int, num_digits: int) -> torch.Tensor:
    """Step 1: ids [...] in [0, b^k) -> base-b digits [..., k] (int64), most significant first:
    ids = sum_m digits[..., m] * b^(k-1-m)."""
    powers = base ** torch.arange(num_digits - 1, -1, -1, device=ids.device, dtype=torch.int64)
    return torch.div(ids.long().unsqueeze(-1), powers, rounding_mode="floor") % base


def seed(codebooks: torch.Tensor, digits: torch.Tensor, combine: str = "sum") -> torch.Tensor:
    """Step 2: codebooks [k, b, d], digits [N, k] -> z(i) = sum_m C_m[i_m] ("sum", [N, d]) or
    concat_m C_m[i_m] ("concat", [N, k*d])."""
    k, b, d = codebooks.shape
    # One lookup into the k stacked codebooks: row m*b + i_m is C_m[i_m].
    offsets = torch.arange(k, device=digits.device, dtype=digits.dtype) * b
    rows = F.embedding(digits + offsets, codebooks.reshape(k * b, d))  # [N, k, d]
    if combine == "sum":
        return rows.sum(dim=1)
    return rows.reshape(rows.shape[0], k * d)


def seed_to_t(
    z: torch.Tensor,
    seed_proj: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    temperature: float,
    norm_eps: float = 1e-5,
) -> torch.Tensor:
    """Steps 3a-3b per head: t = sigmoid(LayerNorm_l(z @ W_seed[l].T) / tau) [h, N, d] in
    [0, 1], of z [N, d_in], seed_proj [h, d, d_in], norm_weight and norm_bias [h, d]."""
    u = torch.matmul(z, seed_proj.transpose(1, 2))  # [h, N, d]
    mean = u.mean(dim=-1, keepdim=True)
    var = (u - mean).square().mean(dim=-1, keepdim=True)  # biased, as torch LayerNorm
    normed = (u - mean) * torch.rsqrt(var + norm_eps)
    normed = normed * norm_weight.unsqueeze(1) + norm_bias.unsqueeze(1)
    return torch.sigmoid(normed / temperature)


def bspline_basis(t: torch.Tensor, num_knots: int, normalize: bool = True) -> torch.Tensor:
    """Step 3c: quadratic B-spline basis on knots g_j = j/(kappa-1).

    B_j(t) = beta2((kappa-1)|t - g_j|), beta2(x) = 3/4 - x^2 (x < 1/2), (3/2 - x)^2 / 2
    (1/2 <= x < 3/2), 0 otherwise. At most 3 are non-zero; near t = 0 or 1 the missing
    outer knots make the sum smaller than 1, which `normalize` corrects. t [...] in [0, 1] ->
    [..., kappa] (dense; layout-agnostic, so it serves [h, N, d] and [h, d, N] alike).
    """
    knots = torch.arange(num_knots, device=t.device, dtype=t.dtype)
    x = ((num_knots - 1) * t.unsqueeze(-1) - knots).abs()
    inner = 0.75 - x.square()
    outer = 0.5 * (1.5 - x).clamp(min=0).square()
    basis = torch.where(x < 0.5, inner, outer)
    if normalize:
        basis = basis / basis.sum(dim=-1, keepdim=True)
    return basis


def spline_values(basis: torch.Tensor, spline_delta: torch.Tensor) -> torch.Tensor:
    """Step 3d: phi[l, n, d, rho] = sum_j B_j(t[l, n, d]) * (1 + Delta[l, d, j, rho]) of basis
    [h, N, d, kappa] and spline_delta [h, d, kappa, r] -> phi [h, N, d, r]."""
    return torch.einsum("hndj,hdjr->hndr", basis, 1 + spline_delta)


def separable_product(phi: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """Step 3e: M[l, n, rho] = prod_d phi[l, n, d, rho], as sign * exp(sum_d log(|phi| + eps)),
    sign = (-1)^(number of negative factors): phi [h, N, d, r] -> M [h, N, r], in float32 at
    least."""
    phi = phi.to(compute_dtype(phi.dtype))
    log_abs = torch.log(phi.abs() + eps).sum(dim=2)
    negatives = (phi < 0).sum(dim=2)
    sign = 1 - 2 * (negatives % 2)
    return sign * torch.exp(log_abs)


def lev_modes(
    z: torch.Tensor,
    seed_proj: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    spline_delta: torch.Tensor,
    *,
    temperature: float,
    num_knots: int,
    normalize_basis: bool = True,
    norm_eps: float = 1e-5,
    product_eps: float = 1e-9,
) -> torch.Tensor:
    """Steps 3a-3e for all heads: seed z [N, d_in] -> separable modes M [N, h, r].

    The [N, h, r] layout lets step 4 read M as the [N, h*r] concatenation of modes.
    """
    cdt = compute_dtype(z.dtype)
    t = seed_to_t(
        z.to(cdt),
        seed_proj.to(cdt),
        norm_weight.to(cdt),
        norm_bias.to(cdt),
        temperature,
        norm_eps,
    )
    basis = bspline_basis(t, num_knots, normalize_basis)
    phi = spline_values(basis, spline_delta.to(cdt))
    return separable_product(phi, product_eps).transpose(0, 1)


def lev_embed(modes: torch.Tensor, out_proj: torch.Tensor) -> torch.Tensor:
    """Step 4: e = sum_l M_l @ W_out[l], i.e. [N, h*r] @ [h*r, D], of modes [N, h, r] and
    out_proj [h, r, D] -> [N, D] in the dtype of `modes`."""
    n, h, r = modes.shape
    weight = out_proj.to(modes.dtype).reshape(h * r, out_proj.shape[-1])
    return torch.matmul(modes.reshape(n, h * r), weight)
