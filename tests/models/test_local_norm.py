"""The local norm under --bf16 on CPU: a float32 weight on bfloat16 activations gives torch's
mixed-dtype RMSNorm bit for bit, forward and backward, without calling it with mixed dtypes
(torch warns once per process there, which every rank printed)."""

import megatron_ext.megatron_import  # noqa: F401

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from megatron_ext.models import local_modules
from megatron_ext.models.local_modules import SequenceParallelNorm


def test_bf16_rmsnorm_equals_torchs_mixed_dtype_path_without_mixing_dtypes(monkeypatch):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        normalization="RMSNorm",
        use_cpu_initialization=True,
    )
    norm = SequenceParallelNorm(config, 64)
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.mul_(1 + 0.1 * torch.randn(64))
    x = torch.randn(16, 4, 64).bfloat16()
    grad = torch.randn(16, 4, 64).bfloat16()
    weight = norm.weight.detach().clone().requires_grad_()
    theirs, ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = F.rms_norm(theirs, (64,), weight, 1e-5)  # torch's mixed-dtype path
    calls, rms_norm = [], F.rms_norm

    def recording_rms_norm(input, shape, weight, eps):
        calls.append((input.dtype, weight.dtype))
        return rms_norm(input, shape, weight, eps)

    monkeypatch.setattr(local_modules.F, "rms_norm", recording_rms_norm)
    got = norm(ours)
    assert calls == [(torch.float32, torch.float32)]
    got.backward(grad)
    want.backward(grad)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert torch.equal(ours.grad, theirs.grad) and torch.equal(norm.weight.grad, weight.grad)
