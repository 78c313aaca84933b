"""LEV's [V, D] table, materialised fast: batched no-grad math in large chunks.

Exports (`tools/convert_checkpoint.py`), the eval table and generation need LEV's embedding of
every id once, with no gradient. `lev.fused` is built for training (an autograd Function whose
chunks hold ~32 ids so that its recompute-in-backward stays in cache); this module computes the
same function (docs/lev.md section 2) with the work per id cut to what the output needs:

1. Seed projection by digit. z(i) @ W_l^T is linear in the k codebook rows that form z(i), so
   P_m = C_m @ W_m^T ([b, h*d], W_m = W for "sum", the m-th column block of W for "concat") is
   computed once per table and each id sums k rows of it: k*h*d additions instead of
   d_in*h*d multiply-adds.
2. LayerNorm and sigmoid per head: t [h, d, n].
3. The three non-zero quadratic B-spline values per coordinate (as `lev.fused`), scattered
   into a dense [h*d, n, kappa] basis, and phi = basis @ (1 + Delta) as one batched matmul.
4. The separable product without logarithms: sign * exp(sum_d log(|phi| + eps)) is exactly
   prod_d x with x = phi + copysign(eps, phi) (= basis @ (1 + Delta + eps) when every
   coefficient is positive and the basis normalised, the usual case). Groups of G factors
   are multiplied (G such that G factors >= eps cannot underflow), each group product is
   (float32 ones continue in float64, 8 at a time, where they stay normal) split by
   `torch.frexp` into a mantissa in [0.5, 1) and an integer exponent, mantissas are
   multiplied 32 at a time (never below 2^-32) and split again, and the exponents are summed
   as integers: no intermediate under- or overflows, and the result differs from the
   definition only by rounding. If a group product overflows (|phi| > ~1e9 in float32) the
   chunk is redone with G = 1.
5. out_proj: one [n, h*r] @ [h*r, D] matmul, written straight into the output rows.

On CPU tensors, when `LEVConfig.kernel` is "auto" or "cpu" and the C++ kernel builds
(`lev.cpu_fused`, the training path's CPU kernel: three basis values per coordinate, the product
in double, no [.., kappa] or [.., r] tensor), steps 2-4 run in that kernel instead, about 7x
faster at the paper's widths; "torch" keeps the steps above on every device.

Shapes (n ids per chunk, h heads on this rank, d = d_seed, kappa knots, rank r, width D)::

    ids [n] -> digits [n, k] -> u [n, h*d] -> t [h*d, n] -> basis [h*d, n, kappa]
        -> phi [h, d, n*r] -> M [h, n, r] -> e [n, D]

The result is this rank's partial embedding (summed over TP ranks it is the full one), in
float32 by default or float64 (`dtype`), checked against an independent float64 reference in
tests/lev/test_lev_table.py.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F

from megatron_ext.lev import math as lev_math
from megatron_ext.lev.config import LEVConfig

__all__ = ["LEVTable", "lev_table", "table_chunk_size"]

# Spline values phi per chunk (h*d*r*n of them): 16M (64 MiB in float32; 256 ids at the
# defaults) amortise the per-op overhead and thread start-up; measured best on 2 CPU cores.
_CHUNK_ELEMENTS = 1 << 24
# Mantissas in [0.5, 1) multiplied before the next frexp: the product stays above 2^-32.
_MANTISSA_GROUP = 32


def _cpu_kernel_usable(kernel: str) -> bool:
    """Whether `kernel` ("auto" or "cpu") lets the table use the C++ kernel, and it builds
    ("auto" logs once why it does not).

    Raises:
        RuntimeError: --lev-kernel cpu asked for and the kernel cannot be built (its reason).
    """
    from megatron_ext.lev.cpu_fused import cpu_kernel_error
    from megatron_ext.lev.kernels import cpu_kernel_available

    if kernel == "auto":
        return cpu_kernel_available()
    if kernel != "cpu":
        return False
    error = cpu_kernel_error()
    if error is not None:
        raise RuntimeError(error)
    return True


def table_chunk_size(num_heads: int, seed_dim: int, rank: int) -> int:
    """Ids per chunk so that one chunk's spline values hold about 16M numbers."""
    return max(1, _CHUNK_ELEMENTS // (num_heads * seed_dim * rank))


def _first_group(dtype: torch.dtype, eps: float) -> int:
    """Largest G <= 32 such that a product of G factors of magnitude >= eps stays normal."""
    if eps >= 1.0:
        return _MANTISSA_GROUP
    tiny = torch.finfo(dtype).tiny
    return max(1, min(_MANTISSA_GROUP, int(math.log(tiny) / math.log(eps))))


def _group_products(x: torch.Tensor, group: int) -> torch.Tensor:
    """[h, q*group (+ rest), m] -> [h, q (+ rest), m]: products of `group` rows of dim 1.

    Row j of the result multiplies rows j, j+q, ..., j+(group-1)*q (one reduction op);
    leftover rows (dim 1 not divisible by `group`) are appended unchanged.
    """
    h, rows, m = x.shape
    group = min(group, rows)
    q = rows // group
    if group == 1:
        return x
    out = x[:, : group * q].view(h, group, q, m).prod(dim=1)
    if group * q < rows:
        out = torch.cat([out, x[:, group * q :]], dim=1)
    return out


def _product_over_dim1(x: torch.Tensor, first_group: int) -> Optional[torch.Tensor]:
    """prod over dim 1 of x [h, d, m] -> [h, m], or None if a first-level product overflowed.

    Every factor must have magnitude >= the eps that `first_group` was chosen for. float32
    group products (in [eps^G, 3.4e38]) continue in float64, 8 at a time, where that product
    stays normal; then mantissas and integer exponents take over.
    """
    dtype = x.dtype
    x = _group_products(x, first_group)
    if dtype == torch.float32:
        x = _group_products(x.double(), 8)
    exponent = torch.zeros(x.shape[0], x.shape[2], dtype=torch.int64, device=x.device)
    while x.shape[1] > 1:
        x, e = torch.frexp(x)
        exponent += e.sum(dim=1)
        x = _group_products(x, _MANTISSA_GROUP)
    x, e = torch.frexp(x[:, 0])
    exponent += e
    # An overflowed group product (or an inf/nan factor) stays inf/nan through the mantissas.
    if first_group > 1 and not bool(torch.isfinite(x).all()):
        return None
    # (2m) * 2^(e-1): 2m lies in [1, 2), so 2^(e-1) is finite whenever the result is.
    return ((2 * x) * torch.exp2((exponent - 1).to(x.dtype))).to(dtype)


def _separable_product(
    phi: torch.Tensor, eps: float, scratch: torch.Tensor, eps_added: bool = False
) -> torch.Tensor:
    """M [h, m] = sign * exp(sum_d log(|phi| + eps)) for phi [h, d, m] (overwritten with x;
    `scratch` is a flat buffer of at least phi's size). `eps_added`: phi is x already."""
    x = phi
    if not eps_added:
        eps_t = torch.tensor(eps, dtype=phi.dtype, device=phi.device)
        x = phi.add_(torch.copysign(eps_t, phi, out=scratch[: phi.numel()].view(phi.shape)))
    product = _product_over_dim1(x, _first_group(x.dtype, eps))
    if product is None:
        # Some |phi| is huge: one frexp per factor (never overflows; inf/nan stay so).
        product = _product_over_dim1(x, 1)
    return product


class LEVTable:
    """This rank's LEV embeddings of any ids, from parameters prepared once (no autograd).

    Args:
        lev_config: the hyper-parameters (vocab size, knots, eps, ...).
        params: this rank's parameters by name (LEV_PARAMETER_NAMES; h = seed_proj.shape[0]
            heads), any dtype and device.
        dtype: compute and output dtype, float32 (default) or float64.
        chunk_size: ids per chunk (0: `table_chunk_size`).
    """

    def __init__(
        self,
        lev_config: LEVConfig,
        params: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        chunk_size: int = 0,
    ):
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"LEV tables are computed in float32 or float64, not {dtype}")
        lc = self.lev_config = lev_config
        self.dtype = dtype
        with torch.no_grad():
            p = {name: t.detach().to(dtype) for name, t in params.items()}
            codebooks = p["codebooks"]  # [k, b, d]
            h, d, d_in = p["seed_proj"].shape
            k, b, _ = codebooks.shape
            weight = p["seed_proj"].reshape(h * d, d_in)
            if lc.codebook_combine == "sum":
                digit_proj = torch.matmul(codebooks, weight.t())  # [k, b, h*d]
            else:  # concat: digit m meets the m-th block of d_in columns
                blocks = weight.view(h * d, k, d).permute(1, 2, 0)  # [k, d, h*d]
                digit_proj = torch.bmm(codebooks, blocks)
            self.digit_proj = digit_proj.reshape(k * b, h * d).contiguous()
            self.digit_offsets = torch.arange(k, device=codebooks.device) * b
            self.gain = p["seed_norm_weight"].reshape(h, d, 1).contiguous()
            self.bias = p["seed_norm_bias"].reshape(h, d, 1).contiguous()
            kappa, r = p["spline_delta"].shape[2:]
            self.coeff = (1 + p["spline_delta"]).reshape(h * d, kappa, r).contiguous()
            # With a normalised basis (weights summing to 1) and positive coefficients every
            # phi is positive and x = phi + eps = basis @ (coeff + eps): the eps and sign pass
            # over the largest tensor disappear (the usual case: coefficients start at 1 + N(0,
            # 0.1^2) and stay near 1).
            self.eps_in_coeff = lc.normalize_basis and bool((self.coeff > 0).all())
            if self.eps_in_coeff:
                self.coeff += lc.product_eps
            self.out_proj = p["out_proj"].reshape(h * r, -1).contiguous()
            self.kernel_params = tuple(
                p[name] for name in ("seed_proj", "seed_norm_weight", "seed_norm_bias")
            ) + (p["spline_delta"],)
            self.codebooks = codebooks
        self.num_heads, self.seed_dim, self.num_knots, self.rank = h, d, kappa, r
        self.hidden_size = self.out_proj.shape[1]
        self.device = codebooks.device
        self.chunk_size = chunk_size or table_chunk_size(h, d, r)
        self.cpu_kernel = self.device.type == "cpu" and _cpu_kernel_usable(lc.kernel)
        self._buffers: dict[str, torch.Tensor] = {}

    def _t(self, ids: torch.Tensor) -> torch.Tensor:
        """Steps 1-3b: ids [n] -> t [h, d, n]."""
        lc = self.lev_config
        digits = lev_math.to_digits(ids, lc.base, lc.num_digits)  # [n, k]
        u = F.embedding_bag(digits + self.digit_offsets, self.digit_proj, mode="sum")
        u = u.t().reshape(self.num_heads, self.seed_dim, -1)  # [h, d, n]
        mean = u.mean(dim=1, keepdim=True)
        centred = u - mean
        var = centred.square().mean(dim=1, keepdim=True)  # biased, as torch LayerNorm
        normed = centred * torch.rsqrt(var + lc.norm_eps)
        return torch.sigmoid((normed * self.gain + self.bias) / lc.temperature)

    def _basis(self, t: torch.Tensor) -> torch.Tensor:
        """Step 3c: t [h, d, n] -> dense basis [h*d, n, kappa] (3 non-zeros per row)."""
        kappa = self.num_knots
        s = t.reshape(-1, t.shape[-1]) * (kappa - 1)  # [h*d, n]
        nearest = torch.floor(s + 0.5)
        f = (s - nearest).unsqueeze(-1)
        values = torch.cat(
            [0.5 * (0.5 - f).square(), 0.75 - f.square(), 0.5 * (0.5 + f).square()], -1
        )
        index = nearest.long().unsqueeze(-1) + torch.arange(-1, 2, device=t.device)
        # Knots -1 and kappa do not exist: their values are dropped (normalisation restores
        # the missing mass); a dropped knot's clamped index may meet a kept one: it adds 0.
        values.mul_(((index >= 0) & (index < kappa)).to(values.dtype))
        index.clamp_(0, kappa - 1)
        if self.lev_config.normalize_basis:
            values.div_(values.sum(dim=-1, keepdim=True))
        basis = self._buffer("basis", s.numel() * kappa).view(*s.shape, kappa).zero_()
        return basis.scatter_add_(-1, index, values)

    def _buffer(self, name: str, numel: int) -> torch.Tensor:
        """A flat workspace reused by every chunk: on CPU, fresh multi-megabyte tensors per
        chunk cost more in page faults than the arithmetic on them."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[name] = torch.empty(numel, dtype=self.dtype, device=self.device)
        return buffer[:numel]

    @torch.no_grad()
    def modes(self, ids: torch.Tensor) -> torch.Tensor:
        """Steps 1-3e: ids [n] (int64, in [0, V), not checked) -> M [n, h, r]."""
        h, d, r = self.num_heads, self.seed_dim, self.rank
        n = ids.shape[0]
        lc = self.lev_config
        with torch.autocast(device_type=self.device.type, enabled=False):
            if self.cpu_kernel:
                from megatron_ext.lev.cpu_fused import cpu_lev_modes

                digits = lev_math.to_digits(ids, lc.base, lc.num_digits)
                z = lev_math.seed(self.codebooks, digits, lc.codebook_combine)  # [n, d_in]
                return cpu_lev_modes(z, *self.kernel_params, lc)
            basis = self._basis(self._t(ids))  # [h*d, n, kappa]
            phi = self._buffer("phi", h * d * n * r).view(h * d, n, r)
            torch.bmm(basis, self.coeff, out=phi)
            product = _separable_product(
                phi.view(h, d, n * r),
                self.lev_config.product_eps,
                self._buffer("x", phi.numel()),
                eps_added=self.eps_in_coeff,
            )
        return product.view(h, n, r).transpose(0, 1)

    @torch.no_grad()
    def rows(self, ids: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Embeddings of ids [n] -> [n, D] (into `out` when given), one chunk at a time."""
        n = ids.shape[0]
        if out is None:
            out = torch.empty(n, self.hidden_size, dtype=self.dtype, device=self.device)
        for start in range(0, n, self.chunk_size):
            chunk = ids[start : start + self.chunk_size]
            modes = self.modes(chunk).reshape(chunk.shape[0], -1)  # [n', h*r]
            target = out[start : start + chunk.shape[0]]
            if target.dtype == self.dtype and target.is_contiguous():
                torch.mm(modes, self.out_proj, out=target)
            else:
                target.copy_(torch.mm(modes, self.out_proj))
        return out

    @torch.no_grad()
    def table(
        self,
        out: Optional[torch.Tensor] = None,
        progress: Optional[Callable[[int], None]] = None,
    ) -> torch.Tensor:
        """The whole [V, D] table (into `out` when given); `progress(ids_done)` per chunk."""
        vocab = self.lev_config.vocab_size
        if out is None:
            out = torch.empty(vocab, self.hidden_size, dtype=self.dtype, device=self.device)
        for start in range(0, vocab, self.chunk_size):
            ids = torch.arange(start, min(start + self.chunk_size, vocab), device=self.device)
            self.rows(ids, out[start : start + ids.shape[0]])
            if progress is not None:
                progress(ids.shape[0])
        return out


def lev_table(
    lev_config: LEVConfig,
    params: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    out: Optional[torch.Tensor] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> torch.Tensor:
    """This rank's [V, D] LEV table from its parameters (see `LEVTable`)."""
    return LEVTable(lev_config, params, dtype=dtype).table(out=out, progress=progress)
