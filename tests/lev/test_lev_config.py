import dataclasses

import pytest

from megatron_ext.lev import (
    LEVConfig,
    LEVEmbedding,
    smallest_base,
)


def test_defaults_and_derived_base():
    cfg = LEVConfig(vocab_size=200_000, hidden_size=2048)
    assert (cfg.num_digits, cfg.seed_dim, cfg.num_knots, cfg.rank, cfg.num_heads) == (
        3,
        128,
        16,
        64,
        8,
    )
    assert cfg.temperature == 2.0 and cfg.codebook_combine == "sum" and cfg.normalize_basis
    assert cfg.base == 59  # 58**3 = 195112 < 200000 <= 59**3
    # docs/lev.md section 2's example: k=3, b=59, defaults, D=2048 -> 2.25M.
    assert round(cfg.num_parameters() / 1e6, 2) == 2.25


@pytest.mark.parametrize("vocab,k", [(1, 1), (2, 1), (8, 3), (9, 3), (50_257, 3), (10**6, 2)])
def test_smallest_base(vocab, k):
    b = smallest_base(vocab, k)
    assert b >= 2 and b**k >= vocab and (b == 2 or (b - 1) ** k < vocab)


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        (dict(base=10), "--lev-base"),  # 10**3 < 5000
        (dict(num_knots=2), "--lev-num-knots"),
        (dict(hidden_size=0), "--hidden-size"),
        (dict(num_digits=0), "--lev-num-digits"),
        (dict(seed_dim=0), "--lev-seed-dim"),
        (dict(rank=0), "--lev-rank"),
        (dict(num_heads=0), "--lev-num-heads"),
        (dict(temperature=0.0), "--lev-temperature"),
        (dict(codebook_combine="mean"), "--lev-codebook-combine"),
        (dict(base=1), "--lev-base"),
    ],
)
def test_impossible_hyper_parameters_name_the_flag(kwargs, flag):
    args = {**dict(vocab_size=5000, hidden_size=8), **kwargs}
    with pytest.raises(ValueError, match=flag):
        LEVConfig(**args)


def test_base_too_small_says_what_would_work():
    with pytest.raises(ValueError, match=r"--lev-base to >= 18.*--lev-num-digits to >= 4"):
        LEVConfig(vocab_size=5000, hidden_size=8, base=10)


def test_config_is_frozen():
    cfg = LEVConfig(vocab_size=100, hidden_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kernel = "reference"
    assert dataclasses.replace(cfg, kernel="torch").kernel == "torch" and cfg.kernel == "auto"


def test_heads_not_divisible_by_tp_fails_at_construction():
    cfg = LEVConfig(vocab_size=100, hidden_size=8, num_heads=3)
    with pytest.raises(ValueError, match="--lev-num-heads 3 .*--tensor-model-parallel-size 2"):
        cfg.parameter_shapes(tp_size=2)


def test_hidden_size_must_match_model(lev):
    cfg = LEVConfig(vocab_size=100, hidden_size=8, seed_dim=4, rank=2, num_knots=3)
    with pytest.raises(ValueError, match="--hidden-size 16"):
        LEVEmbedding(cfg, config=lev.transformer_config(16))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(vocab_size=50, hidden_size=6, seed_dim=4, num_knots=5, rank=3, num_heads=2),
        dict(vocab_size=1000, hidden_size=16, num_digits=2, seed_dim=8, num_knots=3, rank=2),
        dict(
            vocab_size=777,
            hidden_size=12,
            seed_dim=5,
            rank=4,
            num_heads=3,
            codebook_combine="concat",
        ),
        dict(
            vocab_size=300,
            hidden_size=10,
            num_digits=4,
            base=7,
            seed_dim=6,
            num_knots=7,
            rank=5,
            num_heads=1,
            normalize_basis=False,
        ),
    ],
)
def test_parameter_count_matches_formula_and_module(kwargs, lev):
    cfg = LEVConfig(**kwargs)
    k, b, d, kappa, r, h = (
        cfg.num_digits,
        cfg.base,
        cfg.seed_dim,
        cfg.num_knots,
        cfg.rank,
        cfg.num_heads,
    )
    d_in = k * d if cfg.codebook_combine == "concat" else d
    formula = k * b * d + h * (d_in * d + 2 * d + d * kappa * r + r * cfg.hidden_size)
    if cfg.codebook_combine == "sum":  # the formula of docs/lev.md section 2 verbatim
        assert formula == k * b * d + h * (d * d + 2 * d + d * kappa * r + r * cfg.hidden_size)
    assert cfg.num_parameters() == formula
    module = LEVEmbedding(cfg, config=lev.transformer_config(cfg.hidden_size))
    assert sum(p.numel() for p in module.parameters()) == formula
    assert {n: tuple(p.shape) for n, p in module.named_parameters()} == cfg.parameter_shapes()


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        (dict(init_output_std=0.0), "--lev-init-output-std"),
        (dict(init_output_std=-0.1), "--lev-init-output-std"),
        (dict(weight_decay_groups=("codebooks", "norm")), "--lev-weight-decay-groups"),
        (dict(lr_mult=0.0), "--lev-lr-mult"),
    ],
)
def test_training_controls_are_validated(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        LEVConfig(vocab_size=100, hidden_size=8, **kwargs)
