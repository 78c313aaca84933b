"""The `--lev-*` flags: generated from LEVConfig's fields by the one flag mechanism
(`config.flags`), and the config they fill."""

import argparse
import dataclasses

import pytest

from megatron_ext.config.flags import add_flags, flag_name, flag_values
from megatron_ext.lev import LEVConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_flags(parser, LEVConfig)
    return parser


def _config(args: argparse.Namespace, vocab_size: int, hidden_size: int) -> LEVConfig:
    return LEVConfig(vocab_size=vocab_size, hidden_size=hidden_size, **flag_values(LEVConfig, args))


def test_flags_fill_the_config():
    parser = _parser()
    args = parser.parse_args(
        "--lev-num-digits 2 --lev-base 300 --lev-seed-dim 32 --lev-num-knots 8 --lev-rank 16 "
        "--lev-num-heads 4 --lev-temperature 1.5 --lev-codebook-combine concat "
        "--no-lev-normalize-basis --no-lev-dedup".split()
    )
    assert args.lev_num_digits == 2 and args.lev_normalize_basis is False
    cfg = _config(args, vocab_size=50_000, hidden_size=64)
    assert (cfg.num_digits, cfg.base, cfg.seed_dim, cfg.num_knots, cfg.rank) == (2, 300, 32, 8, 16)
    assert (cfg.num_heads, cfg.temperature, cfg.codebook_combine) == (4, 1.5, "concat")
    assert cfg.normalize_basis is False and cfg.dedup is False and cfg.kernel == "auto"
    defaults = _config(parser.parse_args([]), vocab_size=50_000, hidden_size=64)
    assert defaults == LEVConfig(vocab_size=50_000, hidden_size=64)
    assert parser.parse_args(["--lev-normalize-basis"]).lev_normalize_basis is True
    assert parser.parse_args(["--no-lev-eval-table"]).lev_eval_table is False


def test_flag_errors_surface_at_config_time():
    args = _parser().parse_args(["--lev-num-knots", "2"])
    with pytest.raises(ValueError, match="--lev-num-knots"):
        _config(args, vocab_size=100, hidden_size=8)
    # Before the model's size is known, the checks that need no V or D run already.
    with pytest.raises(ValueError, match="--lev-num-knots"):
        LEVConfig(**flag_values(LEVConfig, args))
    unsized = LEVConfig(num_digits=2)
    assert (unsized.vocab_size, unsized.base) == (None, None)
    assert dataclasses.replace(unsized, vocab_size=100, hidden_size=8).base == 10


def test_training_control_flags_fill_the_config():
    parser = _parser()
    defaults = _config(parser.parse_args([]), vocab_size=100, hidden_size=8)
    assert defaults.init_output_std is None and defaults.lr_mult == 1.0
    assert defaults.weight_decay_groups == ("codebooks", "seed_proj", "spline_delta", "out_proj")
    args = parser.parse_args(
        "--lev-init-output-std 0.02 --lev-weight-decay-groups out_proj seed_norm "
        "--lev-lr-mult 0.5".split()
    )
    cfg = _config(args, vocab_size=100, hidden_size=8)
    assert cfg.init_output_std == 0.02 and cfg.lr_mult == 0.5
    assert cfg.weight_decay_groups == ("out_proj", "seed_norm")
    none = parser.parse_args(["--lev-weight-decay-groups"])
    assert _config(none, vocab_size=100, hidden_size=8).weight_decay_groups == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["--lev-weight-decay-groups", "seed_norm_weight"])


def test_every_field_but_v_and_d_has_its_generated_flag():
    flags = {o: a for a in _parser()._actions for o in a.option_strings}
    for field in dataclasses.fields(LEVConfig):
        flag = "--lev-" + field.name.replace("_", "-")
        if field.name in ("vocab_size", "hidden_size"):
            assert "flag" not in field.metadata and flag not in flags
            continue
        assert flag_name(field) == flag and field.metadata["help"]
        action = flags[flag]
        assert action.dest == f"lev_{field.name}" and action.help == field.metadata["help"]
        default = action.default
        assert (tuple(default) if isinstance(default, list) else default) == field.default
        if field.type == "bool":
            assert flags["--no-lev-" + flag[6:]] is action
    assert flags["--lev-kernel"].choices == ("auto", "reference", "torch", "triton", "cpu")
    assert flags["--lev-base"].type is int and flags["--lev-init-output-std"].type is float


def test_a_flag_missing_from_old_args_keeps_its_default():
    # The args.json of a checkpoint written before --lev-lr-mult / --lev-kernel existed.
    old = argparse.Namespace(lev_num_knots=5, lev_weight_decay_groups=["out_proj"])
    cfg = _config(old, vocab_size=100, hidden_size=8)
    assert (cfg.num_knots, cfg.weight_decay_groups) == (5, ("out_proj",))
    assert (cfg.lr_mult, cfg.kernel) == (1.0, "auto")


RUN = ["--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--seq-length", "32",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]  # fmt: skip


def test_deprecated_lev_fused_maps_onto_lev_kernel_with_one_warning(monkeypatch):
    from megatron_ext.config import arguments
    from megatron_ext.config.arguments import ArgumentError, parse_config

    monkeypatch.setattr(arguments, "_warned_fused", False)
    assert arguments.build_parser().parse_args([]).lev_fused is None  # no mapping, no warning
    with pytest.warns(FutureWarning, match="--lev-kernel reference"):
        run = parse_config([*RUN, "--no-lev-fused"], world_size=1)
    assert run.lev.kernel == "reference" and run.model.embedding.lev.kernel == "reference"
    assert run.args_json()["lev_fused"] is None  # recorded as mapped
    # Old args.json (lev_fused stored, no lev_kernel): mapped, and no second warning.
    import warnings

    saved = run.args_json()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for fused, kernel, expected in (
            (False, None, "reference"),
            (True, "cpu", "cpu"),
            (True, None, "auto"),
        ):
            old = {k: v for k, v in saved.items() if k != "lev_kernel"}
            old.update(lev_fused=fused, **({"lev_kernel": kernel} if kernel else {}))
            assert arguments.run_config_from_args_json(old).lev.kernel == expected
    with pytest.raises(ArgumentError, match="drop --no-lev-fused"):
        parse_config([*RUN, "--no-lev-fused", "--lev-kernel", "triton"], world_size=1)
