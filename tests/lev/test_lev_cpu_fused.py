"""The compiled CPU LEV kernel (lev.cpu_fused): its selection by --lev-kernel, its build cache
and its step 3b (`CpuSeedNorm`) against torch's. Its numerics through `lev_modes` (values,
gradients, gradcheck, overflow, threads, saved tensors, autocast) are checked with every other
kernel in tests/lev/test_lev_reference.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.lev import cpu_fused
from megatron_ext.lev.kernels import TORCH_SEED_NORM, select_backend

if cpu_fused.cpu_kernel_error() is not None:  # pragma: no cover - needs a machine without g++
    pytest.skip(f"CPU kernel unavailable: {cpu_fused.cpu_kernel_error()}", allow_module_level=True)


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
    ours = cpu_fused.CPU_BACKEND.seed_norm
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
