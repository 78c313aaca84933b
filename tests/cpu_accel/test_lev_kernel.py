"""The compiled CPU LEV kernel (`cpu_accel.lev_kernel`): its selection by --lev-kernel, its
build cache, its step 3b (`CpuSeedNorm`) against torch's, and its backward near every knot (edge and
interior buckets) against the float64 reference. Its numerics through `lev_modes` (values,
gradients, gradcheck, overflow, threads, saved tensors, autocast) are checked with every other
kernel in tests/lev/test_lev_reference.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.cpu_accel import lev_kernel
from megatron_ext.lev import math as lev_math
from megatron_ext.lev.fused import TORCH_SEED_NORM
from megatron_ext.lev.kernels import LEVKernelOptions, select_backend

if lev_kernel.cpu_kernel_error() is not None:  # pragma: no cover - needs a machine without g++
    pytest.skip(f"CPU kernel unavailable: {lev_kernel.cpu_kernel_error()}", allow_module_level=True)


def test_selection():
    z = torch.zeros(2, 3)
    assert select_backend("cpu", z) is lev_kernel.CPU_BACKEND
    assert select_backend("auto", z) is lev_kernel.CPU_BACKEND
    assert select_backend("torch", z).name == "torch"


def test_missing_compiler_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MEGATRON_EXT_CACHE", str(tmp_path / "cache"))
    lev_kernel.load_library.cache_clear()
    lev_kernel.cpu_kernel_error.cache_clear()
    try:
        error = lev_kernel.cpu_kernel_error()
        assert error is not None and "--lev-kernel torch" in error and "$CXX" in error
        with pytest.raises(RuntimeError, match="no-such-compiler"):
            select_backend("cpu", torch.zeros(2, 3))
    finally:
        lev_kernel.load_library.cache_clear()
        lev_kernel.cpu_kernel_error.cache_clear()


def test_builds_into_a_fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGATRON_EXT_CACHE", str(tmp_path))
    lev_kernel.load_library.cache_clear()
    try:
        lev_kernel.load_library()
        built = list(tmp_path.iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"  # no temporary left behind
    finally:
        lev_kernel.load_library.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("h, d", [(3, 37), (1, 128), (2, 5)])  # widths off the 64-byte blocks
def test_seed_norm_equals_torchs(dtype, h, d):
    gen = torch.Generator().manual_seed(d)
    u = (torch.randn(50, h, d, generator=gen, dtype=torch.float64) * 3 + 1).to(dtype)
    u[7, 0] = float("nan")  # one (id, head) row: NaN there only
    gain, shift, grad_y = (
        torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
        for shape in ((h, d), (h, d), (50, h, d))
    )
    ours = lev_kernel.CPU_BACKEND.seed_norm
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    y, y_ref = ours.forward(u, gain, shift, 1e-5), TORCH_SEED_NORM.forward(u, gain, shift, 1e-5)
    assert torch.isnan(y[7, 0]).all() and not torch.isnan(y[7, 1:]).any()
    torch.testing.assert_close(y, y_ref, equal_nan=True, **tol)
    rows = torch.ones(50, dtype=torch.bool)
    rows[7] = False  # the NaN row's gradients are NaN (summed into every column): leave it out
    grads = ours.backward(u[rows], gain, grad_y[rows], 1e-5)
    grads_ref = TORCH_SEED_NORM.backward(u[rows], gain, grad_y[rows], 1e-5)
    for name, a, b in zip(("u", "gain", "shift"), grads, grads_ref):
        torch.testing.assert_close(a, b, **tol, msg=name)
    threads = torch.get_num_threads()
    try:  # each row and each column of the sums is one thread's: the same bits for 1 and 3
        torch.set_num_threads(1)
        one = ours.backward(u[rows], gain, grad_y[rows], 1e-5)
        torch.set_num_threads(3)
        three = ours.backward(u[rows], gain, grad_y[rows], 1e-5)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, three))


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("kappa", [3, 6, 16])
def test_backward_near_every_knot_equals_the_float64_reference(kappa, normalize):
    # The backward takes the ids of each knot's bucket together: the two edge knots (a dropped
    # neighbour; the values renormalised) one way, the interior ones through the quadratics in f
    # (csrc/lev_cpu.cpp `bucket_interior`). Values of t near every knot, on both sides, at the
    # half-way points between knots and at 0 and 1, against lev.math's dense basis under
    # float64 autograd.
    gen = torch.Generator().manual_seed(kappa)
    h, d, r, eps = 2, 7, 16, 1e-9
    offsets = torch.tensor([-0.5, -0.49, -0.2, 0.0, 0.1, 0.3, 0.4999])
    places = (torch.arange(kappa).unsqueeze(1) + offsets).flatten() / (kappa - 1)
    places = torch.cat([places.clamp(0, 1), torch.tensor([0.0, 1.0])]).double()
    n = places.numel()
    t = places[torch.randperm(n * h * d, generator=gen) % n].view(n, h, d)
    delta = torch.randn(h, d, kappa, r, generator=gen, dtype=torch.float64) * 0.3
    grad_modes = torch.randn(n, h, r, generator=gen, dtype=torch.float64)
    opts = LEVKernelOptions(product_eps=eps, normalize_basis=normalize)

    t_ref, delta_ref = t.clone().requires_grad_(), delta.clone().requires_grad_()
    basis = lev_math.bspline_basis(t_ref.transpose(0, 1), kappa, normalize)
    phi = lev_math.spline_values(basis, delta_ref)
    modes_ref = lev_math.separable_product(phi, eps).transpose(0, 1)
    grad_t, grad_delta_ref = torch.autograd.grad(modes_ref, [t_ref, delta_ref], grad_modes)

    backend = lev_kernel.CPU_BACKEND
    modes = backend.forward(t.transpose(0, 1), delta, opts)
    torch.testing.assert_close(modes, modes_ref.detach(), rtol=1e-12, atol=0)
    scaled = (grad_modes * modes).transpose(0, 1).contiguous().transpose(0, 1)
    grad_y, grad_delta = backend.backward(t.transpose(0, 1), delta, scaled, opts)
    grad_y_ref = grad_t * t * (1 - t)
    for name, ours, ref in (
        ("y", grad_y.transpose(0, 1), grad_y_ref),
        ("Delta", grad_delta, grad_delta_ref),
    ):
        torch.testing.assert_close(
            ours, ref, rtol=1e-10, atol=1e-12 * float(ref.abs().max()), msg=name
        )
