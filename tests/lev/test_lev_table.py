"""lev.table (the fast no-grad table) equals the float64 definition of lev.math."""

import pytest
import torch

from megatron_ext.lev import math as lev_math
from megatron_ext.lev.kernels import cpu_kernel_error
from megatron_ext.lev.table import LEVTable

CONFIGS = {
    "sum": dict(),
    "concat": dict(codebook_combine="concat"),
    "unnormalised": dict(normalize_basis=False, temperature=0.7),
    "k2_kappa3": dict(num_digits=2, num_knots=3, rank=2),
}


def _definition(module, ids: torch.Tensor) -> torch.Tensor:
    """docs/lev.md section 2 in float64, step by step (lev.math, no fused code)."""
    lc = module.lev_config
    p = {n: t.detach().double() for n, t in module.named_parameters()}
    z = lev_math.seed(
        p["codebooks"], lev_math.to_digits(ids, lc.base, lc.num_digits), lc.codebook_combine
    )
    modes = lev_math.lev_modes(
        z,
        p["seed_proj"],
        p["seed_norm_weight"],
        p["seed_norm_bias"],
        p["spline_delta"],
        temperature=lc.temperature,
        num_knots=lc.num_knots,
        normalize_basis=lc.normalize_basis,
        norm_eps=lc.norm_eps,
        product_eps=lc.product_eps,
    )
    return lev_math.lev_embed(modes, p["out_proj"])


def _params(module):
    return dict(module.named_parameters())


def _skip_unless_runs(kernel: str) -> None:
    if kernel == "cpu" and cpu_kernel_error() is not None:  # no g++, or the accelerations off
        pytest.skip(cpu_kernel_error())


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
@pytest.mark.parametrize("spread", [1.5, 0.0])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_table_matches_definition(lev, name, spread, kernel):
    # spread 1.5: negative spline values (the sign path); 0: the init's coefficients 1 + N(0,
    # 0.1^2), all positive (eps folded into the coefficients when the basis is normalised).
    # The table's steps 3c-3e are the forward of the backend --lev-kernel picks.
    _skip_unless_runs(kernel)
    cfg = lev.tiny_config(**CONFIGS[name], kernel=kernel)
    module = lev.make_lev(cfg, dtype=torch.float64, spread=spread)
    ref = _definition(module, torch.arange(cfg.vocab_size))
    assert (ref.abs() > 1e-3).any()
    # float64: the same function up to float64 rounding, over several chunks.
    builder = LEVTable(cfg, _params(module), dtype=torch.float64, chunk_size=7)
    assert builder.backend.name == kernel
    table = builder.table()
    assert table.dtype == torch.float64 and table.shape == (cfg.vocab_size, cfg.hidden_size)
    torch.testing.assert_close(table, ref, rtol=1e-10, atol=1e-10)
    # float32 (the default): rounding only, relative to the embeddings' magnitude.
    table32 = LEVTable(cfg, _params(module)).table()
    assert table32.dtype == torch.float32
    scale = float(ref.abs().max())
    torch.testing.assert_close(table32.double(), ref, rtol=1e-4, atol=1e-5 * scale)


def test_rows_of_any_ids_and_output_dtype(lev):
    cfg = lev.tiny_config()
    module = lev.make_lev(cfg, dtype=torch.float64, spread=0.5)
    ids = torch.tensor([49, 0, 7, 7, 23])
    builder = LEVTable(cfg, _params(module), dtype=torch.float64, chunk_size=2)
    torch.testing.assert_close(builder.rows(ids), _definition(module, ids), rtol=1e-10, atol=1e-10)
    out = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16)
    assert builder.table(out=out) is out
    torch.testing.assert_close(out, builder.table().to(torch.bfloat16), rtol=0, atol=0)
    with pytest.raises(ValueError, match="float32 or float64"):
        LEVTable(cfg, _params(module), dtype=torch.float16)


def _constant_spline(module, values):
    """Make coordinate o of every head a constant spline phi = values[o] (normalised basis)."""
    with torch.no_grad():
        delta = torch.tensor(values, dtype=torch.float64).view(1, -1, 1, 1) - 1.0
        module.spline_delta.copy_(delta.expand_as(module.spline_delta))


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
def test_product_neither_underflows_nor_overflows(lev, kernel):
    # 16 factors of 2^-10 then 16 of 2^10 (exact in float32, as their 1 + delta): the true
    # product is ~1, but a running float32 product underflows to 0 after 13 factors. Two
    # factors 1e20 (coordinates o, o+8) overflow float32 next to tiny ones: the product is
    # still the finite one. (Every kernel's product: tests/lev/test_lev_reference.py.)
    _skip_unless_runs(kernel)
    cfg = lev.tiny_config(seed_dim=32, kernel=kernel)
    module = lev.make_lev(cfg, dtype=torch.float64)
    ids = torch.arange(cfg.vocab_size)
    huge = [1e20] + [1.0] * 7 + [1e20] + [1e-15] * 2 + [1.0] * 21
    for values in ([2.0**-10] * 16 + [2.0**10] * 16, huge):
        _constant_spline(module, values)
        ref = _definition(module, ids)
        assert torch.isfinite(ref).all() and (ref.abs() > 1e-6).any()
        table32 = LEVTable(cfg, _params(module)).table()
        scale = float(ref.abs().max())
        torch.testing.assert_close(table32.double(), ref, rtol=1e-4, atol=1e-5 * scale)


def test_eval_table_is_built_by_lev_table(lev):
    cfg = lev.tiny_config(eval_table=True)
    module = lev.make_lev(cfg, spread=0.5).eval()
    with torch.no_grad():
        module(torch.tensor([[1, 2]]))
    torch.testing.assert_close(
        module._table, LEVTable(cfg, _params(module)).table(), rtol=0, atol=0
    )
