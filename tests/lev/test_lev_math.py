"""Unit tests of the steps of docs/lev.md section 2 (lev.math) and of the fused product
(lev.fused)."""

import pytest
import torch

from megatron_ext.lev import math as lev_math
from megatron_ext.lev.fused import PRODUCT_GROUP, exact_ldexp, separable_product_from_phi


@pytest.mark.parametrize("base,k", [(2, 1), (10, 3), (59, 3), (7, 4), (300, 2)])
def test_digits_round_trip(base, k):
    ids = torch.arange(base**k)
    digits = lev_math.to_digits(ids, base, k)
    assert digits.shape == (base**k, k)
    assert digits.min() >= 0 and digits.max() < base
    powers = torch.tensor([base ** (k - 1 - m) for m in range(k)])
    assert torch.equal((digits * powers).sum(-1), ids)
    # Most significant digit first.
    assert lev_math.to_digits(torch.tensor([123]), 10, 3).tolist() == [[1, 2, 3]]


@pytest.mark.parametrize("kappa", [3, 5, 16])
def test_basis_partition_of_unity(kappa):
    t = torch.linspace(0, 1, 2001, dtype=torch.float64)
    raw = lev_math.bspline_basis(t, kappa, normalize=False)
    norm = lev_math.bspline_basis(t, kappa, normalize=True)
    for basis in (raw, norm):
        assert (basis >= 0).all()
        assert ((basis > 0).sum(-1) <= 3).all()
    torch.testing.assert_close(norm.sum(-1), torch.ones_like(t), rtol=0, atol=1e-14)
    # Unnormalised: exactly 1 wherever all three neighbouring knots exist ...
    s = (kappa - 1) * t
    interior = (s >= 0.5) & (s <= kappa - 1.5)
    torch.testing.assert_close(
        raw.sum(-1)[interior], torch.ones_like(t[interior]), atol=1e-14, rtol=0
    )
    # ... and 3/4 + 1/8 = 7/8 at the ends, where one outer knot is missing.
    assert raw.sum(-1)[0].item() == pytest.approx(0.875)
    assert raw.sum(-1)[-1].item() == pytest.approx(0.875)


def test_basis_values_match_beta2():
    kappa = 5
    t = torch.tensor([0.0, 0.3, 0.5, 1.0], dtype=torch.float64)
    basis = lev_math.bspline_basis(t, kappa, normalize=False)
    # t = 0.3 -> s = 1.2: B_1 = 3/4 - 0.2^2, B_2 = (1.5 - 0.8)^2 / 2, B_0 = (1.5 - 1.2)^2 / 2.
    assert basis[1, 1].item() == pytest.approx(0.75 - 0.04)
    assert basis[1, 2].item() == pytest.approx(0.5 * 0.7**2)
    assert basis[1, 0].item() == pytest.approx(0.5 * 0.3**2)
    assert basis[2, 2].item() == pytest.approx(0.75)  # t on a knot
    assert basis[0, 0].item() == pytest.approx(0.75) and basis[0, 1].item() == pytest.approx(1 / 8)


def _direct_product(phi, eps=1e-9):
    """prod_d sign(phi) (|phi| + eps) with torch.prod (float64)."""
    x = phi.double()
    return torch.prod(torch.sign(x) * (x.abs() + eps) + (x == 0) * eps, dim=2)


@pytest.mark.parametrize("negatives", [0, 1, 2, 3])
def test_product_sign_handling(negatives):
    # [h=1, N=2, d=4, r=1]; `negatives` of the 4 factors of token 0 are negative.
    phi = torch.tensor(
        [[[[0.5], [2.0], [1.5], [0.25]], [[1.0], [1.0], [1.0], [1.0]]]], dtype=torch.float64
    )
    phi[0, 0, :negatives] *= -1
    M = lev_math.separable_product(phi)
    expected = (-1) ** negatives * 0.5 * 2.0 * 1.5 * 0.25
    assert M[0, 0, 0].item() == pytest.approx(expected, rel=1e-8)
    assert M[0, 1, 0].item() == pytest.approx(1.0, rel=1e-8)
    torch.testing.assert_close(M, _direct_product(phi), rtol=1e-14, atol=0)
    fused = separable_product_from_phi(phi.permute(0, 2, 1, 3).contiguous(), 1e-9)
    torch.testing.assert_close(fused, M, rtol=1e-14, atol=0)


def _product_rtol(phi: torch.Tensor) -> float:
    """Relative error bound of a product over d factors (phi [h, N, d, r]) in phi's dtype: each
    factor (its sum with eps, its multiplication) adds ~eps, the renormalisations are exact.
    Twice that leaves room (the bound does not depend on the CPU)."""
    eps = torch.finfo(phi.dtype).eps
    return 2 * eps * (2 * phi.shape[2] + 1) + 1e-14


def _tiny(phi: torch.Tensor) -> float:
    """Products below phi's dtype's smallest normal number (1e-8 ** 13) underflow to 0."""
    return torch.finfo(phi.dtype).tiny


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", [1, 3, 4, 13, 128, 300])
def test_fused_product_equals_spec_formula(dtype, d):
    torch.manual_seed(d)
    phi = torch.randn(3, 7, d, 5, dtype=dtype)  # about half the factors negative
    phi[0, 0, 0, 0] = 0.0  # |0| + eps: a factor of +eps
    phi[1, 2, :, 1] = 1e-8  # tiny factors: the mantissa product must not underflow
    # Against the spec's formula in float64 on the same inputs (before the fused call, which
    # overwrites its input, and that may share phi's storage when d == 1).
    expected = lev_math.separable_product(phi.double())
    fused = separable_product_from_phi(phi.permute(0, 2, 1, 3).contiguous(), 1e-9)
    torch.testing.assert_close(fused.double(), expected, rtol=_product_rtol(phi), atol=_tiny(phi))
    if d > PRODUCT_GROUP:
        # 300 mantissas in [1/2, 1) multiply to as little as 2^-300: renormalised in between.
        assert ((expected != 0) & (expected.abs() < 1e30)).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_product_has_no_overflowing_partial_product(dtype):
    # Four factors of 1e12 overflow a running float32 product; the mantissa-exponent product
    # of docs/lev.md step 3e does not, and neither does float32's largest finite factor
    # followed by five factors of eps (|phi| = 0 or << eps).
    big = torch.finfo(torch.float32).max
    phi = torch.full((1, 2, 8, 2), 1e12, dtype=dtype)
    phi[:, :, 4:] = 1e-12
    phi[:, 1, :, 1] = torch.tensor([big, 0, 0, -1e-30, 0, 1e-20, -2.0, 4.0], dtype=dtype)
    assert torch.isfinite(lev_math.separable_product(phi)).all()
    expected = lev_math.separable_product(phi.double())
    fused = separable_product_from_phi(phi.permute(0, 2, 1, 3).contiguous(), 1e-9)
    torch.testing.assert_close(fused.double(), expected, rtol=_product_rtol(phi), atol=_tiny(phi))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_ldexp_rounds_once_over_the_whole_range(dtype):
    info = torch.finfo(dtype)
    max_exp = 128 if dtype == torch.float32 else 1024
    mantissa = torch.tensor([0.75, -0.75, 0.5, 0.999, 0.75, 0.75, 0.5], dtype=dtype)
    exponent = torch.tensor([max_exp, max_exp, max_exp + 1, 0, -(max_exp + 10), -(10**6), 10**6])
    out = exact_ldexp(mantissa, exponent)
    # 0.75 * 2^max_exp is finite although 2^max_exp is not.
    assert out[0].item() == 0.75 * 2.0 ** (max_exp - 1) * 2 and out[0].item() <= info.max
    assert out[1] == -out[0] and torch.isinf(out[2]) and out[3] == mantissa[3]
    assert 0 < out[4] < info.tiny and out[4].item() == 0.75 * 2.0 ** -(max_exp + 10)  # subnormal
    assert out[5] == 0 and torch.isinf(out[6])


def test_product_is_float32_for_low_precision_input():
    phi = torch.full((1, 1, 64, 1), 1.01, dtype=torch.bfloat16)
    M = lev_math.separable_product(phi)
    assert M.dtype == torch.float32


def test_check_ids_messages():
    lev_math.check_ids(torch.tensor([[0, 49]]), 50)
    with pytest.raises(ValueError, match=r"token id 50, outside the valid range \[0, 50\)"):
        lev_math.check_ids(torch.tensor([[0, 50]]), 50)
    with pytest.raises(ValueError, match=r"token id -3, outside the valid range \[0, 50\)"):
        lev_math.check_ids(torch.tensor([[-3, 4]]), 50)
    with pytest.raises(TypeError, match="integer"):
        lev_math.check_ids(torch.tensor([[1.0]]), 50)


@pytest.mark.parametrize("kappa", [3, 4, 16])
@pytest.mark.parametrize("normalize", [True, False])
def test_fast_basis_equals_definition(kappa, normalize):
    # The torch kernel's basis from its three non-zero values per coordinate (lev.fused).
    from megatron_ext.lev.fused import _basis_parts, _dense_basis

    t = torch.cat([torch.linspace(0, 1, 1001, dtype=torch.float64), torch.rand(500).double()])
    expected = lev_math.bspline_basis(t, kappa, normalize)
    fast = _dense_basis(_basis_parts(t, kappa, normalize), torch.empty_like(expected))
    torch.testing.assert_close(fast, expected, rtol=0, atol=1e-14)
