"""The compiled CPU LEV kernel (lev.cpu_fused) against the readable math (lev.math) and the
torch fused path; its selection by --lev-kernel; its build cache.

The full module is also checked against the independent float64 reference, through every
kernel, in tests/lev/test_lev_reference.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.lev import cpu_fused
from megatron_ext.lev import math as lev_math
from megatron_ext.lev.config import LEVConfig
from megatron_ext.lev.fused import fused_lev_modes
from megatron_ext.lev.kernels import select_backend
from megatron_ext.testing.memory import saved_tensor_bytes

if cpu_fused.cpu_kernel_error() is not None:  # pragma: no cover - needs a machine without g++
    pytest.skip(f"CPU kernel unavailable: {cpu_fused.cpu_kernel_error()}", allow_module_level=True)


# Low enough that t = sigmoid(LN(.) / tau) spreads over [0, 1] and reaches both end knots.
_TEMPERATURE = 0.3


def _opts(kappa: int, normalize: bool = True, eps: float = 1e-9) -> LEVConfig:
    return LEVConfig(
        vocab_size=1, hidden_size=1, temperature=_TEMPERATURE, num_knots=kappa,
        normalize_basis=normalize, norm_eps=1e-5, product_eps=eps,
    )  # fmt: skip


def _inputs(dtype, n=37, d_in=5, h=3, d=9, kappa=6, r=5, seed=0, delta_std=0.8):
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, std=1.0, mean=0.0):
        x = mean + std * torch.randn(*shape, generator=gen, dtype=torch.float64)
        return x.to(dtype).requires_grad_()

    # delta_std 0.8: many spline values are negative (the product's sign matters).
    return [
        draw(n, d_in),
        draw(h, d, d_in, std=0.5),
        draw(h, d, mean=1.0, std=0.3),
        draw(h, d, std=0.3),
        draw(h, d, kappa, r, std=delta_std),
    ]


def _readable(inputs, opts):
    return lev_math.lev_modes(
        *inputs,
        temperature=opts.temperature,
        num_knots=opts.num_knots,
        normalize_basis=opts.normalize_basis,
        norm_eps=opts.norm_eps,
        product_eps=opts.product_eps,
    )


def _with_grads(fn, inputs, weight):
    for x in inputs:
        x.grad = None
    out = fn()
    (out * weight.to(out.dtype)).sum().backward()
    return out.detach(), [x.grad.clone() for x in inputs]


@pytest.mark.parametrize("normalize", [True, False])
def test_equals_the_readable_math_in_float64(normalize):
    inputs = _inputs(torch.float64)
    opts = _opts(inputs[-1].shape[2], normalize)
    weight = torch.randn(37, 3, 5, dtype=torch.float64)
    ref, ref_grads = _with_grads(lambda: _readable(inputs, opts), inputs, weight)
    out, grads = _with_grads(lambda: cpu_fused.cpu_lev_modes(*inputs, opts), inputs, weight)
    assert (ref < 0).any() and (ref > 0).any()  # both signs of the product were produced
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    for name, g, g_ref in zip(["z", "seed_proj", "gain", "bias", "delta"], grads, ref_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-11, atol=1e-13, msg=name)


def test_reaches_both_end_knots():
    # The basis near t = 0 and t = 1 drops a knot (and normalisation restores the mass): the
    # float64 test above only means something if those cases occur.
    inputs = _inputs(torch.float64)
    with torch.no_grad():
        t = lev_math.seed_to_t(inputs[0], *inputs[1:4], _TEMPERATURE)
    s = t * (inputs[-1].shape[2] - 1)
    assert (s < 0.5).any() and (s > inputs[-1].shape[2] - 1.5).any()


def test_gradcheck():
    inputs = [x.detach()[:4].clone() if i == 0 else x.detach().clone()
              for i, x in enumerate(_inputs(torch.float64, d=3, h=2, r=2, kappa=4))]  # fmt: skip
    inputs = [x.requires_grad_() for x in inputs]
    for normalize in (True, False):
        opts = _opts(4, normalize)
        assert torch.autograd.gradcheck(lambda *a: cpu_fused.cpu_lev_modes(*a, opts), inputs)


def test_float32_matches_float64_and_the_torch_path():
    inputs64 = _inputs(torch.float64, n=200, d=32, r=16, kappa=16, delta_std=0.1)
    inputs32 = [x.detach().float().requires_grad_() for x in inputs64]
    opts = _opts(16)
    weight = torch.randn(200, 3, 16, dtype=torch.float64)
    ref, ref_grads = _with_grads(lambda: _readable(inputs64, opts), inputs64, weight)
    out, grads = _with_grads(lambda: cpu_fused.cpu_lev_modes(*inputs32, opts), inputs32, weight)
    torch_out, torch_grads = _with_grads(lambda: fused_lev_modes(*inputs32, opts), inputs32, weight)
    assert out.dtype == torch.float32
    # float32 rounding of a product of 32 factors (and of their sums): relative to the scale.
    for a, b in [(out, ref), (torch_out, ref)]:
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    for g, g_torch, g_ref in zip(grads, torch_grads, ref_grads):
        tol = 1e-5 * float(g_ref.abs().max())
        torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=tol)
        torch.testing.assert_close(g, g_torch, rtol=1e-4, atol=tol)


def _constant_spline(values: torch.Tensor, kappa: int) -> torch.Tensor:
    """spline_delta [1, d, kappa, 1] whose spline is the constant values[c] on coordinate c
    (a normalised basis sums to 1)."""
    return (values - 1).view(1, -1, 1, 1).expand(1, values.numel(), kappa, 1).clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_product_survives_partial_overflow(dtype):
    # Factors 1e30, 1e30, then six exact zeros (each counted as eps = 1e-9): a running float32
    # product overflows after two factors and would stay inf; the spec's exp(sum log) and the
    # kernel give 1e60 * 1e-54 = 1e6.
    kappa, d = 5, 8
    values = torch.tensor([1e30, 1e30, 0, 0, 0, 0, 0, 0], dtype=torch.float64)
    delta = _constant_spline(values, kappa).to(dtype)
    z = torch.randn(4, 3, dtype=dtype)
    inputs = [z, torch.randn(1, d, 3, dtype=dtype), torch.ones(1, d, dtype=dtype),
              torch.zeros(1, d, dtype=dtype), delta]  # fmt: skip
    out = cpu_fused.cpu_lev_modes(*inputs, _opts(kappa))
    expected = torch.full((4, 1, 1), 1e6, dtype=torch.float64)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=0)


def test_product_underflow_and_overflow_of_the_result():
    # The product itself out of float32's range: 0 and inf, as exp(sum log) gives.
    kappa, d = 5, 8
    z = torch.randn(2, 3)
    common = [torch.randn(1, d, 3), torch.ones(1, d), torch.zeros(1, d)]
    tiny = cpu_fused.cpu_lev_modes(
        z, *common, _constant_spline(torch.full((d,), 1e-6), kappa), _opts(kappa)
    )
    huge = cpu_fused.cpu_lev_modes(
        z, *common, _constant_spline(torch.full((d,), 1e6), kappa), _opts(kappa)
    )
    assert (tiny == 0).all() and torch.isinf(huge).all() and (huge > 0).all()


def test_nan_seed_gives_nan_modes():
    inputs = [x.detach() for x in _inputs(torch.float32)]
    inputs[0][3] = float("nan")
    out = cpu_fused.cpu_lev_modes(*inputs, _opts(inputs[-1].shape[2]))
    assert torch.isnan(out[3]).all() and torch.isfinite(out[:3]).all()


def test_threads_give_the_same_result():
    inputs = _inputs(torch.float64, n=64)
    opts = _opts(inputs[-1].shape[2])
    weight = torch.randn(64, 3, 5, dtype=torch.float64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, one_grads = _with_grads(lambda: cpu_fused.cpu_lev_modes(*inputs, opts), inputs, weight)
        torch.set_num_threads(3)
        many, many_grads = _with_grads(
            lambda: cpu_fused.cpu_lev_modes(*inputs, opts), inputs, weight
        )
    finally:
        torch.set_num_threads(threads)
    # Each output and each parameter-gradient row is computed by one thread: bitwise equal.
    assert torch.equal(one, many)
    assert all(torch.equal(a, b) for a, b in zip(one_grads, many_grads))


def test_saves_only_the_seeds_and_the_modes():
    inputs = [x.detach().requires_grad_() for x in _inputs(torch.float32, n=50, d=16, r=8)]
    z, params = inputs[0], inputs[1:]
    size, out = saved_tensor_bytes(
        lambda: cpu_fused.cpu_lev_modes(z.clone(), *params, _opts(6)), exclude=[z, *params]
    )
    out.sum().backward()
    # z [n, d_in] (the clone) and M [n, h, r]; no [n, d, r] or [n, d, kappa] tensor.
    assert size == 4 * 50 * (5 + 3 * 8)


def test_autocast_keeps_float32():
    inputs = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cpu_fused.cpu_lev_modes(*inputs, _opts(inputs[-1].shape[2]))
    assert out.dtype == torch.float32


def test_selection():
    z = torch.zeros(2, 3)
    assert select_backend("cpu", z) is cpu_fused.CPU_BACKEND
    assert select_backend("auto", z) is cpu_fused.CPU_BACKEND
    assert select_backend("torch", z).name == "torch"


def test_missing_compiler_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MEGATRON_EXT_CACHE", str(tmp_path / "cache"))
    cpu_fused.load_library.cache_clear()
    cpu_fused.cpu_kernel_error.cache_clear()
    try:
        error = cpu_fused.cpu_kernel_error()
        assert error is not None and "--lev-kernel torch" in error and "$CXX" in error
        with pytest.raises(RuntimeError, match="no-such-compiler"):
            select_backend("cpu", torch.zeros(2, 3))
    finally:
        cpu_fused.load_library.cache_clear()
        cpu_fused.cpu_kernel_error.cache_clear()


def test_builds_into_a_fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGATRON_EXT_CACHE", str(tmp_path))
    cpu_fused.load_library.cache_clear()
    try:
        cpu_fused.load_library()
        built = list(tmp_path.iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"  # no temporary left behind
    finally:
        cpu_fused.load_library.cache_clear()
