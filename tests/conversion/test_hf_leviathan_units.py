"""`conversion/hf_leviathan` without a checkpoint: the transformers LEV module against the
training kernels' table, the config, the initialisation, and the export's code made from the
package's source (the import cost, which launches a process: test_hf_leviathan.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.conversion.hf_leviathan import (
    LeviathanConfig,
    LeviathanEmbedding,
    LeviathanForCausalLM,
)
from megatron_ext.conversion.hf_leviathan.remote_code import (
    REMOTE_CODE_FILES,
    _localise,
    remote_code_sources,
)
from megatron_ext.lev import LEVConfig
from megatron_ext.lev.table import LEVTable

TINY = dict(
    vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    lev_seed_dim=8, lev_rank=4, lev_num_heads=2, lev_num_knots=5,
)  # fmt: skip


@pytest.mark.parametrize("combine", ["sum", "concat"])
def test_lev_module_equals_the_training_table(combine):
    """Every id's row from `LeviathanEmbedding` (lev/math.py under autograd) equals the
    training kernels' `LEVTable` for the same parameters (float64, so only rounding differs)."""
    torch.manual_seed(0)
    config = LeviathanConfig(**TINY, lev_codebook_combine=combine)
    model = LeviathanForCausalLM(config).double()
    lev = model.model.embed_tokens
    with torch.no_grad():  # away from the initial values (LayerNorm 1/0, ...)
        for p in lev.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    lev_config = LEVConfig(
        vocab_size=300, hidden_size=32, num_digits=3, base=config.lev_base, seed_dim=8,
        num_knots=5, rank=4, num_heads=2, codebook_combine=combine, kernel="torch",
    )  # fmt: skip
    table = LEVTable(lev_config, dict(lev.named_parameters()), dtype=torch.float64).table()
    ids = torch.tensor([[0, 5, 299, 5], [17, 128, 42, 0]])
    rows = lev(ids)
    assert rows.shape == (2, 4, 32) and rows.dtype == torch.float64
    torch.testing.assert_close(rows, table[ids], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="outside the valid range"):
        lev(torch.tensor([[300]]))


def test_config_derives_and_checks_the_base(tmp_path):
    assert LeviathanConfig(**TINY).lev_base == 7  # 7**3 = 343 >= 300 > 6**3
    with pytest.raises(ValueError, match="cover 216 ids, fewer than vocab_size 300"):
        LeviathanConfig(**TINY, lev_base=6)
    with pytest.raises(ValueError, match="lev_codebook_combine"):
        LeviathanConfig(**TINY, lev_codebook_combine="mean")
    config = LeviathanConfig(**TINY, lev_temperature=1.5, tie_word_embeddings=True)
    assert config.tie_word_embeddings is False  # LEV has no table to tie
    config.save_pretrained(tmp_path)
    back = LeviathanConfig.from_pretrained(tmp_path)
    assert (back.lev_base, back.lev_temperature, back.model_type) == (7, 1.5, "leviathan")


def test_fresh_model_initialises_lev_as_the_spec():
    torch.manual_seed(0)
    lev = LeviathanForCausalLM(LeviathanConfig(**TINY)).model.embed_tokens
    assert isinstance(lev, LeviathanEmbedding)
    assert torch.equal(lev.seed_norm_weight, torch.ones(2, 8))
    assert torch.equal(lev.seed_norm_bias, torch.zeros(2, 8))
    assert 0.05 < float(lev.spline_delta.detach().std()) < 0.2  # spline_init_std 0.1
    assert 0.01 < float(lev.codebooks.detach().std()) < 0.04  # init_std 0.02


def test_export_code_is_the_package_source_with_local_imports():
    sources = remote_code_sources()
    assert sorted(sources) == sorted(f"{name}.py" for name in REMOTE_CODE_FILES.values())
    for name, text in sources.items():
        compile(text, name, "exec")
        for line in text.splitlines():
            assert not line.lstrip().startswith(("from megatron", "import megatron")), (name, line)
    assert "from .lev_math import" in sources["modeling_leviathan.py"]
    assert (
        "from .configuration_leviathan import LeviathanConfig" in sources["modeling_leviathan.py"]
    )
    with pytest.raises(RuntimeError, match="megatron_ext.lev.layer, which a Hugging Face export"):
        _localise("x", "from megatron_ext.lev.layer import LEVEmbedding\n")
