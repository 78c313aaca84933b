"""The plain-PyTorch baseline of bench_lev_quality.py computes the same LEV function as the
package (float64, same parameters), and its --lev-init-output-std means the same thing."""

from __future__ import annotations

import pytest
import torch


def _plain():
    from benchmarks import plain_gpt

    return plain_gpt


def test_plain_lev_matches_the_package_float64():
    import megatron_ext.megatron_import  # noqa: F401

    from megatron.core.transformer import TransformerConfig

    from megatron_ext.lev import LEVConfig, LEVEmbedding

    vocab, hidden, k, d, kappa, r, h = 500, 12, 3, 6, 7, 4, 2
    torch.manual_seed(0)
    plain = _plain().PlainLEV(vocab, hidden, k, d, kappa, r, h, tau=2.0).double()
    with torch.no_grad():  # non-trivial LayerNorm affine and negative spline values
        plain.ln_weight.add_(0.3 * torch.randn_like(plain.ln_weight))
        plain.ln_bias.add_(0.3 * torch.randn_like(plain.ln_bias))
        plain.delta.normal_(0.0, 0.7)
    cfg = LEVConfig(
        vocab_size=vocab, hidden_size=hidden, num_digits=k, seed_dim=d, num_knots=kappa,
        rank=r, num_heads=h,
    )  # fmt: skip
    tc = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=2, use_cpu_initialization=True,
        params_dtype=torch.float64,
    )  # fmt: skip
    package = LEVEmbedding(cfg, config=tc)
    assert package.lev_config.base == plain.base
    names = dict(
        codebooks="codebooks", seed_proj="seed_proj", seed_norm_weight="ln_weight",
        seed_norm_bias="ln_bias", spline_delta="delta", out_proj="out",
    )  # fmt: skip
    with torch.no_grad():
        for ours, theirs in names.items():
            getattr(package, ours).copy_(getattr(plain, theirs))
    ids = torch.randint(0, vocab, (3, 20), generator=torch.Generator().manual_seed(1))
    expected, actual = plain(ids), package(ids)
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12)
    expected.square().sum().backward()
    actual.square().sum().backward()
    for ours, theirs in names.items():
        torch.testing.assert_close(
            getattr(package, ours).grad, getattr(plain, theirs).grad, rtol=1e-8, atol=1e-12
        )


def test_plain_init_output_std():
    torch.manual_seed(0)
    plain = _plain().PlainLEV(300, 16, 3, 8, 6, 4, 2, tau=2.0, output_std=0.02)
    with torch.no_grad():
        assert plain.embed(torch.arange(300)).std().item() == pytest.approx(0.02, rel=1e-5)
