"""The `--lev-*` flags generated from LEVConfig's fields, and the config they fill."""

import argparse
import dataclasses

import pytest

from megatron_ext.lev import LEVConfig, add_lev_arguments, lev_config_from_args


def test_flags_fill_the_config():
    parser = add_lev_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        "--lev-num-digits 2 --lev-base 300 --lev-seed-dim 32 --lev-num-knots 8 --lev-rank 16 "
        "--lev-num-heads 4 --lev-temperature 1.5 --lev-codebook-combine concat "
        "--no-lev-normalize-basis --no-lev-dedup".split()
    )
    assert args.lev_num_digits == 2 and args.lev_normalize_basis is False
    cfg = lev_config_from_args(args, vocab_size=50_000, hidden_size=64)
    assert (cfg.num_digits, cfg.base, cfg.seed_dim, cfg.num_knots, cfg.rank) == (2, 300, 32, 8, 16)
    assert (cfg.num_heads, cfg.temperature, cfg.codebook_combine) == (4, 1.5, "concat")
    assert cfg.normalize_basis is False and cfg.dedup is False and cfg.kernel == "auto"
    defaults = lev_config_from_args(parser.parse_args([]), vocab_size=50_000, hidden_size=64)
    assert defaults == LEVConfig(vocab_size=50_000, hidden_size=64)
    assert parser.parse_args(["--lev-normalize-basis"]).lev_normalize_basis is True


def test_flag_errors_surface_at_config_time():
    parser = add_lev_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--lev-num-knots", "2"])
    with pytest.raises(ValueError, match="--lev-num-knots"):
        lev_config_from_args(args, vocab_size=100, hidden_size=8)


def test_training_control_flags_fill_the_config():
    parser = add_lev_arguments(argparse.ArgumentParser())
    defaults = lev_config_from_args(parser.parse_args([]), vocab_size=100, hidden_size=8)
    assert defaults.init_output_std is None and defaults.lr_mult == 1.0
    assert defaults.weight_decay_groups == ("codebooks", "seed_proj", "spline_delta", "out_proj")
    args = parser.parse_args(
        "--lev-init-output-std 0.02 --lev-weight-decay-groups out_proj seed_norm "
        "--lev-lr-mult 0.5".split()
    )
    cfg = lev_config_from_args(args, vocab_size=100, hidden_size=8)
    assert cfg.init_output_std == 0.02 and cfg.lr_mult == 0.5
    assert cfg.weight_decay_groups == ("out_proj", "seed_norm")
    none = parser.parse_args(["--lev-weight-decay-groups"])
    assert lev_config_from_args(none, vocab_size=100, hidden_size=8).weight_decay_groups == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["--lev-weight-decay-groups", "seed_norm_weight"])


def test_every_field_but_v_and_d_has_its_generated_flag():
    parser = add_lev_arguments(argparse.ArgumentParser())
    flags = {o: a for a in parser._actions for o in a.option_strings}
    for field in dataclasses.fields(LEVConfig):
        flag = "--lev-" + field.name.replace("_", "-")
        if field.name in ("vocab_size", "hidden_size"):
            assert "flag" not in field.metadata and flag not in flags
            continue
        assert field.metadata["flag"] == flag and field.metadata["help"]
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
    cfg = lev_config_from_args(old, vocab_size=100, hidden_size=8)
    assert (cfg.num_knots, cfg.weight_decay_groups) == (5, ("out_proj",))
    assert (cfg.lr_mult, cfg.kernel) == (1.0, "auto")


def test_deprecated_lev_fused_maps_onto_lev_kernel_with_one_warning(monkeypatch):
    from megatron_ext.lev import arguments

    monkeypatch.setattr(arguments, "_warned_fused", False)
    parser = add_lev_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).lev_fused is None  # new args.json: no mapping, no warning
    with pytest.warns(FutureWarning, match="--lev-kernel reference"):
        cfg = lev_config_from_args(
            parser.parse_args(["--no-lev-fused"]), vocab_size=100, hidden_size=8
        )
    assert cfg.kernel == "reference"
    # Old args.json (lev_fused stored, no lev_kernel): mapped, and no second warning.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        old_unfused = argparse.Namespace(lev_fused=False, lev_num_knots=5)
        assert lev_config_from_args(old_unfused, 100, 8).kernel == "reference"
        old_fused = argparse.Namespace(lev_fused=True, lev_kernel="cpu")
        assert lev_config_from_args(old_fused, 100, 8).kernel == "cpu"
        assert lev_config_from_args(argparse.Namespace(lev_fused=True), 100, 8).kernel == "auto"
    with pytest.raises(ValueError, match="drop --no-lev-fused"):
        lev_config_from_args(
            parser.parse_args(["--no-lev-fused", "--lev-kernel", "triton"]), 100, 8
        )
