"""Flags: Megatron-LM's names, derived values, and one-line errors for impossible settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_ext.config.arguments import (
    ArgumentError,
    parse_config,
    run_config_from_args_json,
)
from tests.support.runs import run_command

pytestmark = pytest.mark.integration

BASE = [
    "--micro-batch-size", "2", "--seq-length", "32", "--lr", "1e-3", "--train-iters", "100",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
]  # fmt: skip


def _parse(*extra: str, world_size: int = 1):
    return parse_config([*BASE, *extra], world_size=world_size)


def _without(flag: str) -> list[str]:
    i = BASE.index(flag)
    return BASE[:i] + BASE[i + 2 :]


def test_megatron_flags_fill_the_configs():
    args = _parse(
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--sequence-parallel", "--use-distributed-optimizer", "--global-batch-size", "16",
        "--lr-warmup-fraction", "0.1", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
        "--weight-decay", "0.1", "--adam-beta1", "0.8", "--adam-beta2", "0.95",
        "--clip-grad", "0.5", "--bf16", "--save", "ckpt", "--save-interval", "10",
        world_size=8,
    )  # fmt: skip
    cfg = run_config_from_args_json(args.args_json())  # what a checkpoint's args.json rebuilds
    assert cfg == args
    assert cfg.parallel.data_parallel_size == 2 and cfg.parallel.sequence_parallel
    assert cfg.parallel.use_distributed_optimizer
    assert cfg.num_microbatches == 4  # 16 / (2 x DP 2)
    assert cfg.precision.bf16 and cfg.optim.adam_beta2 == 0.95 and cfg.optim.clip_grad == 0.5
    assert cfg.model.seq_length == 32 and cfg.seed == 1234 and cfg.eval.eval_iters == 100
    # Megatron steps the schedule in samples: decay over 100 iterations x 16, warmup 10%.
    assert cfg.optim.lr_decay_steps == 1600 and cfg.optim.lr_warmup_steps == 160
    assert cfg.ckpt.save == "ckpt" and cfg.ckpt.save_interval == 10
    # args.json keeps every flag and derived value, as before the configs existed.
    assert cfg.args_json()["lr_decay_steps"] == 1600
    assert cfg.args_json()["seq_length"] == 32 and cfg.args_json()["bf16"] is True


def test_defaults_follow_megatron():
    run = _parse(world_size=2)
    assert run.batch.global_batch_size == 4  # micro-batch x DP
    assert run.optim.lr_decay_style == "linear" and run.optim.clip_grad == 1.0
    assert run.data.make_vocab_size_divisible_by == 128 and run.log.log_interval == 100
    assert run.model.hidden_dropout == run.model.attention_dropout == 0.1
    assert run.eval.eval_interval is None
    assert (run.precision.fp8_amax_history_len, run.precision.fp8_amax_compute_algo) == (
        1, "most_recent"
    )  # fmt: skip


def test_train_samples_derive_iterations():
    run = parse_config(
        [*_without("--train-iters"), "--train-samples", "1000", "--global-batch-size", "8"], 1
    )
    assert run.batch.train_iters == 125 and run.optim.lr_decay_steps == 1000


@pytest.mark.parametrize(
    "argv,world,message",
    [
        (["--global-batch-size", "6"], 2, "--global-batch-size 6 is not divisible by"),
        (["--train-samples", "800"], 1, "exactly one of --train-iters and --train-samples"),
        (["--tensor-model-parallel-size", "3"], 4, "not divisible by tensor x pipeline"),
        (["--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"], 1, "are exclusive"),
        (["--lr-warmup-iters", "200"], 1, "warmup is not shorter than the decay"),
        (["--save-interval", "10"], 1, "--save-interval needs --save"),
        (["--min-lr", "1"], 1, "--min-lr"),
        (["--finetune"], 1, "--finetune needs --load"),
        (["--context-parallel-size", "3"], 3, "--seq-length 32 is not divisible by 2 x"),
    ],
)
def test_bad_flags_fail_with_one_line(argv, world, message):
    with pytest.raises(ArgumentError) as info:
        _parse(*argv, world_size=world)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_required_flags():
    with pytest.raises(ArgumentError, match="--micro-batch-size is required"):
        parse_config(_without("--micro-batch-size"), 1)
    with pytest.raises(ArgumentError, match="--lr is required"):
        parse_config(_without("--lr"), 1)
    with pytest.raises(ArgumentError, match="--seq-length is required"):
        parse_config(_without("--seq-length"), 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_precision_errors_come_from_the_configs():
    """Each precision check lives in one place: FP8 needing Transformer Engine in
    `config.layout.check_layout` (it needs the model's --transformer-impl, and the run checks
    it while parsing), --fp8-format needing --bf16 and --bf16 with --fp16 in PrecisionConfig,
    the one precision type of the run and the model."""
    from megatron_ext.config.layout import PrecisionConfig, check_layout
    from megatron_ext.config.model import ModelConfig

    with pytest.raises(ArgumentError, match="FP8 is not available on CPU"):
        _parse("--fp8-format", "hybrid", "--bf16")
    with pytest.raises(ValueError, match="FP8 is not available on CPU"):
        precision = PrecisionConfig(bf16=True, fp8_format="hybrid")
        check_layout(ModelConfig(vocab_size=128), None, precision)
    with pytest.raises(ArgumentError, match="--bf16 and --fp16 are exclusive"):
        _parse("--bf16", "--fp16")
    with pytest.raises(ValueError, match="--bf16 and --fp16 are exclusive"):
        PrecisionConfig(bf16=True, fp16=True)
    with pytest.raises(ArgumentError, match="--fp8-format needs --bf16"):
        _parse("--fp8-format", "hybrid")


@pytest.mark.parametrize(
    "extra, world_size, error",
    [
        (
            ["--global-batch-size", "3"],
            1,
            "--global-batch-size 3 is not divisible by --micro-batch-size 2 x data-parallel "
            "size 1 = 2; change one of them",
        ),
        # A layout the model cannot take (`config.layout.check_layout`, before any rank starts).
        (
            ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "48",
             "--num-attention-heads", "3", "--global-batch-size", "2"],
            2,
            "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2; "
            "change one of them",
        ),
    ],
)  # fmt: skip
def test_entry_point_prints_one_error_line(extra, world_size, error):
    """The CLI turns a bad setting into `error: ...` and exit code 2, no traceback."""
    repo = Path(__file__).resolve().parents[2]
    proc = run_command(str(repo / "pretrain_leviathan.py"), BASE + extra, repo,
                       env={"WORLD_SIZE": str(world_size)}, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {error}"]
    assert "Traceback" not in proc.stderr


def test_use_checkpoint_args_takes_the_model_flags(tmp_path, caplog):
    ckpt = tmp_path / "iter_0000040"
    ckpt.mkdir()
    saved = {
        "num_layers": 6, "hidden_size": 96, "num_attention_heads": 6, "embedding_type": "albert",
        "lev_rank": 7,
    }  # fmt: skip
    (ckpt / "args.json").write_text(json.dumps({**saved, "lr": 123.0}))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("40\n")
    with caplog.at_level("WARNING"):
        run = _parse("--load", str(tmp_path), "--use-checkpoint-args", "--num-layers", "2")
    # Megatron-LM: a flag given on the command line wins, with a warning; the rest is restored.
    model = run.model
    assert (model.num_layers, model.hidden_size) == (2, 96)
    assert model.embedding.embedding_type == "albert"
    assert "--num-layers 2 from the command line overrides the checkpoint's 6" in caplog.text
    assert "hidden-size" not in caplog.text
    assert run.lev.rank == 7 and model.embedding.lev.rank == 7
    assert run.optim.lr == 1e-3  # training flags stay the command line's
    with pytest.raises(ArgumentError, match="needs --load"):
        _parse("--use-checkpoint-args")


def test_lev_training_controls_reach_args_json_and_back(tmp_path):
    """--lev-init-output-std / --lev-weight-decay-groups / --lev-lr-mult are stored in a
    checkpoint's args.json (the config dump prints the same dict) and restored from it."""
    args = _parse(
        "--lev-init-output-std", "0.02", "--lev-weight-decay-groups", "out_proj", "seed_norm",
        "--lev-lr-mult", "0.5",
    )  # fmt: skip
    saved = args.args_json()
    assert saved["lev_init_output_std"] == 0.02 and saved["lev_lr_mult"] == 0.5
    assert saved["lev_weight_decay_groups"] == ["out_proj", "seed_norm"]
    ckpt = tmp_path / "iter_0000010"
    ckpt.mkdir()
    (ckpt / "args.json").write_text(json.dumps(saved))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10\n")
    restored = _parse("--load", str(tmp_path), "--use-checkpoint-args")
    lev = restored.model.embedding.lev
    assert (lev.init_output_std, lev.lr_mult) == (0.02, 0.5)
    assert lev.weight_decay_groups == ("out_proj", "seed_norm")


# The command line of data/args_json_format1_oldest.json, the oldest args.json of checkpoint
# format 1 that must keep loading: written by commit c8cae8e (before FeatureConfig's fields
# moved to the configs that own them), it lacks the keys of the flags added since.
OLD_LAYOUT_ARGV = [
    *BASE, "--min-lr", "1e-5", "--num-layers", "3", "--hidden-size", "96",
    "--num-attention-heads", "6", "--save", "ckpt", "--load", "ckpt", "--async-save",
    "--decoupled-lr", "5e-3", "--calculate-per-token-loss", "--grad-reduce-in-bf16",
    "--skip-train", "--manual-gc", "--manual-gc-interval", "4", "--no-manual-gc-eval",
    "--empty-unused-memory-level", "1", "--profile", "--profile-step-start", "2",
    "--profile-step-end", "5", "--profile-ranks", "0", "1", "--log-params-norm",
    "--log-num-zeros-in-grad", "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard",
    "--no-log-loss-scale-to-tensorboard", "--logging-level", "20",
    "--wandb-project", "lev", "--wandb-exp-name", "run1", "--wandb-save-dir", "wb",
    "--wandb-entity", "team",
]  # fmt: skip


def test_args_json_written_before_the_feature_split_still_loads(tmp_path):
    """args.json is flat (one key per flag or derived field), so a checkpoint's args.json from
    before FeatureConfig was split rebuilds the same RunConfig, each moved field at its
    owner, and --use-checkpoint-args reads it."""
    import dataclasses
    import importlib.util
    import logging

    old = json.loads((Path(__file__).parent / "data" / "args_json_format1_oldest.json").read_text())
    cfg = run_config_from_args_json(old)
    assert cfg.ckpt.async_save and cfg.exit.skip_train and cfg.ckpt.no_load_optim
    assert (cfg.optim.decoupled_lr, cfg.optim.decoupled_min_lr) == (5e-3, 1e-5)
    assert cfg.engine.calculate_per_token_loss and cfg.precision.grad_reduce_in_bf16
    m = cfg.memory
    assert (m.manual_gc, m.manual_gc_interval, m.manual_gc_eval) == (True, 4, False)
    assert m.empty_unused_memory_level == 1
    log = cfg.log
    assert (log.profile, log.profile_step_start, log.profile_step_end) == (True, 2, 5)
    assert log.profile_ranks == [0, 1] and log.logging_level == 20
    assert log.log_params_norm and log.log_num_zeros_in_grad and log.log_memory_to_tensorboard
    assert log.log_world_size_to_tensorboard and not log.log_loss_scale_to_tensorboard
    assert (log.wandb_project, log.wandb_exp_name, log.wandb_save_dir, log.wandb_entity) == (
        "lev", "run1", "wb", "team"
    )  # fmt: skip

    # Parity: today's parser writes the same args.json and builds the same config from the flags.
    argv, keep = OLD_LAYOUT_ARGV, lambda key: True
    if importlib.util.find_spec("wandb") is None:  # --wandb-project needs the package
        argv = argv[: argv.index("--wandb-project")]
        keep = lambda key: not key.startswith("wandb_")  # noqa: E731
    # Megatron-LM's defaults since (issue 47), given as the old run had them.
    argv = [*argv, "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "1000"]
    level = logging.getLogger().level
    try:
        args = parse_config(argv, world_size=1)
    finally:  # --logging-level sets the root logger's level
        logging.getLogger().setLevel(level)
    written = args.args_json()
    # Flags added since that checkpoint appear with their defaults: off, except those that are
    # on unless turned off (an old run resumed gets them, benchmarks/RESULTS.md 4.3; checkpoint
    # digests are checked unless --no-verify-checkpoint, the CPU accelerations used unless
    # --no-cpu-accel); every old key agrees but FP8's recipe
    # defaults, Megatron-LM's since issue 47 (no --fp8-format here).
    on_by_default = {
        "lev_dedup_global_batch": True,
        "retain_host_memory": True,
        "verify_checkpoint": True,
        "cpu_accel": True,
    }
    added = set(written) - set(old)
    assert all(written[k] is on_by_default.get(k) for k in added), {k: written[k] for k in added}
    fp8 = {"fp8_amax_history_len": (1024, 1), "fp8_amax_compute_algo": ("max", "most_recent")}
    assert {k: (old[k], written[k]) for k in fp8} == fp8
    assert {k: v for k, v in written.items() if keep(k) and k not in added and k not in fp8} == {
        k: v for k, v in old.items() if keep(k) and k not in fp8
    }
    new = dataclasses.replace(args, precision=cfg.precision, compat_flags=cfg.compat_flags)
    if keep("wandb_project"):
        assert new == cfg

    # --use-checkpoint-args takes the model flags from it.
    (tmp_path / "iter_0000100").mkdir()
    (tmp_path / "iter_0000100" / "args.json").write_text(json.dumps(old))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("100\n")
    restored = _parse("--load", str(tmp_path), "--use-checkpoint-args").model
    assert (restored.num_layers, restored.hidden_size, restored.num_attention_heads) == (3, 96, 6)


def test_the_data_flags_are_checked_while_parsing():
    """DataConfig is a part of the RunConfig: its refusals are the command line's one line."""
    argv = [a for a in BASE if a != "--mock-data"]
    with pytest.raises(ArgumentError, match="no training data: pass --data-path"):
        parse_config(argv, 1)
    with pytest.raises(ArgumentError, match="choose one of --data-path"):
        parse_config([*BASE, "--data-path", "x"], 1)
