"""The Triton LEV kernels against the torch paths, on CPU in Triton's interpreter.

The kernels are compiled for CUDA on a GPU; here TRITON_INTERPRET=1 runs the same kernel code
on CPU tensors (scripts/gpu_check.sh repeats the comparison compiled, on a GPU).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_ext.lev import LEVConfig
from megatron_ext.lev import math as lev_math
from megatron_ext.lev.fused import fused_lev_modes
from megatron_ext.lev.kernels import select_backend
from megatron_ext.testing.memory import saved_tensor_bytes

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
        module=triton_kernel, modes=triton_kernel.triton_lev_modes, device=device
    )


def _config(kappa: int, normalize: bool = True) -> LEVConfig:
    """The hyper-parameters the kernels read (tau 2, eps defaults); V and D do not enter them."""
    return LEVConfig(vocab_size=1, hidden_size=1, num_knots=kappa, normalize_basis=normalize)


def _inputs(dtype, n=37, d_in=5, h=2, d=5, kappa=6, r=3, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, std=1.0, mean=0.0):
        x = mean + std * torch.randn(*shape, generator=gen, dtype=torch.float64)
        return x.to(device=device, dtype=dtype)

    # spline_delta std 0.8: many spline values are negative (the product's sign matters).
    return [
        draw(n, d_in).requires_grad_(),
        draw(h, d, d_in, std=0.5).requires_grad_(),
        draw(h, d, mean=1.0, std=0.3).requires_grad_(),
        draw(h, d, std=0.3).requires_grad_(),
        draw(h, d, kappa, r, std=0.8).requires_grad_(),
    ]


@pytest.mark.parametrize("normalize", [True, False])
def test_kernel_equals_the_readable_math_in_float64(kernel, normalize):
    inputs = _inputs(torch.float64, device=kernel.device)
    kappa = inputs[-1].shape[2]
    out = kernel.modes(*inputs, _config(kappa, normalize))
    ref = lev_math.lev_modes(*inputs, temperature=2.0, num_knots=kappa, normalize_basis=normalize)
    assert out.dtype == torch.float64 and out.shape == ref.shape == (37, 2, 3)
    assert (ref < 0).any() and (ref > 0).any()  # both signs of the product are exercised
    scale = ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12 * scale)
    weight = torch.randn_like(ref)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weight).sum(), inputs)
    for name, g, rg in zip(["z", "seed_proj", "norm_w", "norm_b", "delta"], grads, ref_grads):
        assert rg.abs().max() > 0, name
        torch.testing.assert_close(g, rg, rtol=0, atol=1e-11 * rg.abs().max().item(), msg=name)


def test_kernel_matches_the_torch_fused_path_in_float32(kernel):
    inputs = _inputs(torch.float32, n=50, d_in=8, h=2, d=8, kappa=7, r=20, device=kernel.device)
    cfg = _config(7)
    out = kernel.modes(*inputs, cfg)
    ref = fused_lev_modes(*inputs, cfg)
    exact = lev_math.lev_modes(
        *[x.detach().double().requires_grad_() for x in inputs], temperature=2.0, num_knots=7
    )
    # float32: each of the d factors carries ~1 ulp; tolerance from the magnitudes.
    tol = 8 * 8 * torch.finfo(torch.float32).eps * exact.abs().max().item()
    torch.testing.assert_close(out.double(), exact.detach(), rtol=0, atol=tol)
    torch.testing.assert_close(out, ref, rtol=0, atol=tol)
    weight = torch.randn_like(out)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weight).sum(), inputs)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=0, atol=64 * tol * max(1.0, rg.abs().max().item()))


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


def test_saves_only_seeds_and_modes(kernel):
    n, d_in, h, d, kappa, r = 64, 16, 2, 16, 8, 16
    inputs = _inputs(
        torch.float32, n=n, d_in=d_in, h=h, d=d, kappa=kappa, r=r, device=kernel.device
    )
    cfg = _config(kappa)
    z = inputs[0].detach().clone().requires_grad_()
    params = inputs[1:]
    size, out = saved_tensor_bytes(
        lambda: kernel.modes(z.clone(), *params, cfg), exclude=[z, *params]
    )
    out.sum().backward()
    # z [n, d_in] (the clone) and M [n, h, r]; no [n, d, r] or [n, d, kappa] tensor.
    assert size == 4 * n * (d_in + h * r)


def test_auto_never_picks_triton_on_cpu_and_triton_refuses_cpu_outside_the_interpreter(
    kernel, monkeypatch
):
    from megatron_ext.lev import cpu_fused

    z = torch.zeros(2, 3)
    # On CPU tensors auto means the C++ kernel (lev.cpu_fused), or torch where it cannot build.
    cpu_choice = "cpu" if cpu_fused.cpu_kernel_error() is None else "torch"
    assert select_backend("auto", z).name == cpu_choice
    assert select_backend("torch", z).name == "torch"
    assert select_backend("triton", z).name == "triton"  # the interpreter runs CPU tensors
    if kernel.device.type != "cpu":
        pytest.skip("checks the CPU selection rules")
    monkeypatch.setattr(kernel.module, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="runs on CUDA tensors.*--lev-kernel torch"):
        select_backend("triton", z)
    with pytest.raises(ValueError, match="change --lev-kernel"):
        LEVConfig(vocab_size=10, hidden_size=4, kernel="cuda")
