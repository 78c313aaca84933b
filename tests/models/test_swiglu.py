"""SwiGLUMLP's activation (`_SwiGLU`: no `up + 0.0` pass, no `cat` of the gradient halves) must
give megatron's unfused SwiGLU results bit for bit, forward and backward."""

import megatron_ext.megatron_import  # noqa: F401

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.models.local_modules import _SwiGLU


def _megatron_glu(x: torch.Tensor) -> torch.Tensor:
    """megatron.core.transformer.mlp.MLP.forward's unfused gated path (glu_linear_offset 0)."""
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    return F.silu(x_glu) * (x_linear + 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_megatrons_glu(dtype):
    torch.manual_seed(0)
    x = (torch.randn(9, 3, 2 * 24) * 3).to(dtype)  # [s, b, 2F] = [gate | up]
    grad = torch.randn(9, 3, 24).to(dtype)
    theirs, ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = _megatron_glu(theirs), _SwiGLU.apply(ours)
    assert torch.equal(got, want)
    want.backward(grad)
    got.backward(grad)
    assert torch.equal(ours.grad, theirs.grad) and ours.grad.is_contiguous()
