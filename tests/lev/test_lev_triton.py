"""The Triton LEV kernels against the torch kernel through the whole module (float64 and
bfloat16 parameters), and their selection, on CPU in Triton's interpreter. The kernel-level
numerics are checked with every other kernel in tests/lev/test_lev_reference.py.

The kernels are compiled for CUDA on a GPU; here TRITON_INTERPRET=1 runs the same kernel code
on CPU tensors (scripts/gpu_check.sh repeats the comparison compiled, on a GPU).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from megatron_ext.lev import LEVConfig
from megatron_ext.lev.kernels import lev_modes, select_backend

pytest.importorskip("triton", reason="triton is not installed (pip install '.[gpu]')")


@pytest.fixture(scope="module")
def kernel():
    """The Triton kernels, interpreted on CPU (tests/conftest.py sets TRITON_INTERPRET=1 when
    there is no GPU) or compiled on CUDA; `.device` is where their tensors go."""
    from megatron_ext.lev import triton_kernel

    if triton_kernel.INTERPRETED:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (see tests/conftest.py)")
    return SimpleNamespace(
        module=triton_kernel, modes=functools.partial(lev_modes, kernel="triton"), device=device
    )


def _embedding_grads(lev, kernel_name, dtype, ids):
    cfg = lev.tiny_config(kernel=kernel_name, rank=4, num_knots=6)
    module = lev.make_lev(cfg, dtype=dtype, spread=0.8).to(ids.device)
    out = module(ids)
    out.float().pow(2).sum().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_embedding_output_and_all_six_gradients_match_the_torch_kernel(kernel, lev, dtype):
    # Repeated ids: the layer deduplicates before the kernel and gathers afterwards.
    ids = torch.tensor([[3, 7, 3, 49, 0], [7, 7, 12, 0, 31]], device=kernel.device)
    out_t, grads_t = _embedding_grads(lev, "triton", dtype, ids)
    out_r, grads_r = _embedding_grads(lev, "torch", dtype, ids)
    assert out_t.dtype == dtype
    assert torch.equal(out_t[0, 0], out_t[0, 2])
    assert len(grads_t) == 6
    # float64: same function up to rounding. bf16 parameters: both compute in float32 from the
    # same bf16 values and round the output / gradients to bf16 once.
    rel = 1e-11 if dtype == torch.float64 else 2 * 2.0**-8
    torch.testing.assert_close(out_t, out_r, rtol=rel, atol=rel * out_r.abs().max().item())
    for name, g in grads_t.items():
        ref = grads_r[name]
        assert ref.abs().max() > 0, name
        atol = rel * ref.abs().max().item()
        torch.testing.assert_close(g, ref, rtol=rel, atol=atol, msg=name)


def test_auto_never_picks_triton_on_cpu_and_triton_refuses_cpu_outside_the_interpreter(
    kernel, monkeypatch
):
    from megatron_ext.lev.kernels import cpu_kernel_error

    z = torch.zeros(2, 3)
    # On CPU tensors auto means the C++ kernel (cpu_accel.lev_kernel), or torch where it cannot
    # build or the CPU accelerations are off.
    cpu_choice = "cpu" if cpu_kernel_error() is None else "torch"
    assert select_backend("auto", z).name == cpu_choice
    assert select_backend("torch", z).name == "torch"
    assert select_backend("triton", z).name == "triton"  # the interpreter runs CPU tensors
    if kernel.device.type != "cpu":
        pytest.skip("checks the CPU selection rules")
    monkeypatch.setattr(kernel.module, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="runs on CUDA tensors.*--lev-kernel torch"):
        select_backend("triton", z)
    with pytest.raises(ValueError, match="--lev-kernel must be one of auto, .*, got 'cuda'"):
        LEVConfig(vocab_size=10, hidden_size=4, kernel="cuda")
