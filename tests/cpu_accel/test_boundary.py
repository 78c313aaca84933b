"""With the switch off no CPU acceleration is asked for: every extension point of the core takes
its portable path (that no module outside `megatron_ext.cpu_accel` imports one of its modules:
tests/test_import_layers.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext import cpu_accel, tensor_parallel
from megatron_ext.inference import generation
from megatron_ext.lev import kernels


@pytest.fixture
def switched_off(monkeypatch):
    """The switch off in this process; the core's once-per-process choices (cached) are made
    afresh before and after."""
    caches = (tensor_parallel._chunk_kernel_error, kernels.cpu_kernel_available)
    for cache in caches:
        cache.cache_clear()
    monkeypatch.setenv(cpu_accel.ENV, "0")
    yield
    monkeypatch.undo()
    for cache in caches:
        cache.cache_clear()


def test_switch_off_every_extension_point_takes_the_portable_path(switched_off):
    assert not cpu_accel.enabled()
    for accessor in (
        cpu_accel.lev_backend,
        cpu_accel.cross_entropy_kernel,
        cpu_accel.decode_step,
        cpu_accel.host_memory_tuning,
    ):
        assert accessor() is None, accessor.__name__
    assert kernels.cpu_kernel_error() == cpu_accel.OFF
    assert generation.decode_step_for(torch.nn.Linear(2, 2)) == ("megatron", cpu_accel.OFF)
    # The chunked cross entropy still gives the loss, by the portable path.
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 2, 8), torch.randn(11, 8)
    target = torch.randint(0, 11, (3, 2))
    expected = torch.nn.functional.cross_entropy(
        (hidden @ weight.T).reshape(-1, 11).double(), target.reshape(-1), reduction="none"
    ).reshape(3, 2)
    with torch.no_grad():
        got = tensor_parallel.chunked_head_cross_entropy(hidden, weight, target, rows=2)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
