"""Fixtures of the LEV tests: a tiny configuration that every test can afford."""

from __future__ import annotations

import megatron_ext.megatron_import  # noqa: F401

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megatron_ext.lev import LEVConfig, LEVEmbedding

TINY = dict(vocab_size=50, hidden_size=6, seed_dim=4, num_knots=5, rank=3, num_heads=2)


def transformer_config(hidden_size: int, dtype=torch.float32, tp: int = 1, sp: bool = False):
    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden_size,
        num_attention_heads=2,
        use_cpu_initialization=True,
        params_dtype=dtype,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
    )


def tiny_config(**overrides) -> LEVConfig:
    return LEVConfig(**{**TINY, **overrides})


def make_lev(lev_config: LEVConfig, dtype=torch.float32, seed: int = 0, spread: float = 0.0, **kw):
    """A single-process LEVEmbedding. `spread` > 0 redraws spline_delta with that std so that
    some spline values are negative (exercising the product's sign handling); the LayerNorm
    affine parameters are perturbed so that their gradients are non-trivial."""
    torch.manual_seed(seed)
    module = LEVEmbedding(
        lev_config, config=transformer_config(lev_config.hidden_size, dtype), **kw
    )
    with torch.no_grad():
        if spread:
            module.spline_delta.normal_(0.0, spread)
        module.seed_norm_weight.add_(0.3 * torch.randn_like(module.seed_norm_weight))
        module.seed_norm_bias.add_(0.3 * torch.randn_like(module.seed_norm_bias))
    return module


class LevFactory:
    """What the fixture hands to tests (keeps the helpers importable in any pytest mode)."""

    tiny_config = staticmethod(tiny_config)
    make_lev = staticmethod(make_lev)
    transformer_config = staticmethod(transformer_config)


@pytest.fixture
def lev():
    return LevFactory
