"""The compiled CPU LEV kernel (lev.cpu_fused): its selection by --lev-kernel and its build
cache. Its numerics (values, gradients, gradcheck, overflow, threads, saved tensors, autocast)
are checked with every other kernel in tests/lev/test_lev_reference.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.lev import cpu_fused
from megatron_ext.lev.kernels import select_backend

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
