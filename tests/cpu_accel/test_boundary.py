"""The core reaches the CPU accelerations only through `megatron_ext.cpu_accel`'s accessors: no
module outside the subpackage imports one of its modules, and with the switch off none of them
is asked for: every extension point takes the core's portable path."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import megatron_ext
from megatron_ext import cpu_accel, tensor_parallel
from megatron_ext.inference import generation
from megatron_ext.lev import kernels

PACKAGE = pathlib.Path(megatron_ext.__file__).parent
SUBPACKAGE = PACKAGE / "cpu_accel"
PIECES = {p.stem for p in SUBPACKAGE.glob("*.py") if p.stem != "__init__"}


def _imports_of_pieces(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names.append(node.module)
        else:
            continue
        for name in names:
            parts = name.split(".")
            if "cpu_accel" in parts:
                after = parts[parts.index("cpu_accel") + 1 :]
                if after and after[0] in PIECES:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    return found


def test_no_core_module_imports_an_acceleration_module():
    assert PIECES >= {"build", "cross_entropy", "host_memory", "lean_decode", "lev_kernel"}
    offenders = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if SUBPACKAGE not in path.parents
        for hit in _imports_of_pieces(path)
    ]
    assert offenders == []


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
