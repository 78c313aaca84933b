"""RunConfig built in code: each dataclass checks itself with the command line's one-line
message, and derives what Megatron-LM derives; the flags reach args.json unchanged."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from megatron_ext.config.arguments import ArgumentError, parse_config, run_config_from_args_json
from megatron_ext.config.model import ModelConfig
from megatron_ext.config.run import (
    BatchConfig,
    CheckpointConfig,
    EngineConfig,
    EvalConfig,
    ExitConfig,
    LoggingConfig,
    MemoryConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
)


def _run(**parts) -> RunConfig:
    """A valid one-rank run with `parts` replaced."""
    parts.setdefault("batch", BatchConfig(micro_batch_size=2, global_batch_size=4, train_iters=3))
    parts.setdefault("optim", OptimizerConfig(lr=1e-4))
    parts.setdefault("model", ModelConfig(seq_length=32))
    return RunConfig(**parts)


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: ParallelConfig(tensor_model_parallel_size=0),
            "--tensor-model-parallel-size must be >= 1, got 0",
        ),
        (
            lambda: ParallelConfig(distributed_backend="mpi"),
            "--distributed-backend must be nccl or gloo",
        ),
        (lambda: BatchConfig(micro_batch_size=None), "--micro-batch-size is required"),
        (lambda: ModelConfig(seq_length=0), "--seq-length must be >= 1, got 0"),
        (lambda: BatchConfig(global_batch_size=0), "--global-batch-size must be >= 1, got 0"),
        (
            lambda: PrecisionConfig(bf16=True, fp16=True),
            "--bf16 and --fp16 are exclusive; pick one",
        ),
        (lambda: PrecisionConfig(fp8_format="hybrid"), "--fp8-format needs --bf16"),
        (
            lambda: PrecisionConfig(fp8_amax_history_len=16),
            "--fp8-amax-history-len needs --fp8-format",
        ),
        (lambda: PrecisionConfig(fp8_margin=1), "--fp8-margin needs --fp8-format"),
        (
            lambda: PrecisionConfig(bf16=True, fp8_format="e4m3", fp8_amax_history_len=0),
            "--fp8-amax-history-len must be >= 1",
        ),
        (lambda: ExitConfig(exit_interval=0), "--exit-interval must be >= 1, got 0"),
        (lambda: ExitConfig(exit_duration_in_mins=0), "--exit-duration-in-mins must be > 0"),
        (lambda: ExitConfig(max_nonfinite_steps=0), "--max-nonfinite-steps must be >= 1, got 0"),
        (lambda: EvalConfig(eval_iters=-1), "--eval-iters must be >= 0, got -1"),
        (lambda: EvalConfig(eval_interval=0), "--eval-interval must be >= 1, got 0"),
        (lambda: OptimizerConfig(lr=None), "--lr is required"),
        (
            lambda: OptimizerConfig(lr=1e-3, min_lr=1.0),
            "need 0 <= --min-lr (1.0) <= --lr (0.001), --lr > 0",
        ),
        (
            lambda: OptimizerConfig(lr=1e-4, lr_warmup_init=1.0),
            "--lr-warmup-init must not exceed --lr",
        ),
        (lambda: OptimizerConfig(lr=1e-4, clip_grad=-1.0), "--clip-grad must be >= 0, got -1.0"),
        (
            lambda: OptimizerConfig(lr=1e-4, adam_beta2=1.0),
            "--adam-beta1 and --adam-beta2 must be in [0, 1)",
        ),
        (lambda: OptimizerConfig(lr=1e-4, weight_decay=-0.1), "--weight-decay must be >= 0"),
        (
            lambda: OptimizerConfig(
                lr=1e-4, override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True
            ),
            "conflict",
        ),
        (
            lambda: OptimizerConfig(lr=1e-4, lr_warmup_steps=10, lr_decay_steps=10),
            "the warmup is not shorter than the decay",
        ),
        (
            lambda: OptimizerConfig(lr=1e-4, lr_decay_style="WSD"),
            "--lr-decay-style WSD needs --lr-wsd-decay-iters/-samples",
        ),
        (
            lambda: OptimizerConfig(lr=1e-4, start_weight_decay=0.0, end_weight_decay=0.1),
            "needs --weight-decay-incr-style linear or cosine",
        ),
        (lambda: CheckpointConfig(save_interval=10), "--save-interval needs --save"),
        (
            lambda: CheckpointConfig(save="s", save_interval=0),
            "--save-interval must be >= 1, got 0",
        ),
        (lambda: CheckpointConfig(ckpt_keep_last=0), "--ckpt-keep-last must be >= 1, got 0"),
        (lambda: CheckpointConfig(finetune=True), "--finetune needs --load"),
        (lambda: CheckpointConfig(ckpt_step=5), "--ckpt-step needs --load"),
        (lambda: LoggingConfig(log_interval=0), "--log-interval must be >= 1, got 0"),
        (
            lambda: LoggingConfig(tensorboard_log_interval=0),
            "--tensorboard-log-interval must be >= 1",
        ),
        (lambda: EngineConfig(ddp_impl="fsdp"), "--ddp-impl must be portable or megatron"),
        (
            lambda: OptimizerConfig(lr=1e-3, decoupled_min_lr=1e-5),
            "--decoupled-min-lr needs --decoupled-lr",
        ),
        (
            lambda: OptimizerConfig(lr=1e-3, decoupled_lr=1e-4, decoupled_min_lr=1e-3),
            "need 0 <= --decoupled-min-lr (0.001)",
        ),
        (lambda: MemoryConfig(manual_gc_interval=-1), "--manual-gc-interval must be >= 0, got -1"),
        (
            lambda: LoggingConfig(profile=True, profile_step_start=3, profile_step_end=3),
            "need 0 <= --profile-step-start (3)",
        ),
        (lambda: CheckpointConfig(async_save=True), "--async-save needs --save"),
        (
            # --decoupled-min-lr defaults to --min-lr, and the default is checked too.
            lambda: OptimizerConfig(lr=1e-3, min_lr=1e-3, decoupled_lr=1e-4),
            "need 0 <= --decoupled-min-lr (0.001) <= --decoupled-lr (0.0001)",
        ),
        # Checks across two configs: RunConfig's.
        (
            lambda: _run(batch=BatchConfig(micro_batch_size=2, global_batch_size=3)),
            "--global-batch-size 3 is not divisible by --micro-batch-size 2 x data-parallel size 1",
        ),
        (
            lambda: _run(
                parallel=ParallelConfig(context_parallel_size=4), model=ModelConfig(seq_length=12)
            ),
            "--seq-length 12 is not divisible by 2 x --context-parallel-size 4",
        ),
        (
            lambda: _run(
                batch=BatchConfig(
                    micro_batch_size=2,
                    global_batch_size=8,
                    rampup_batch_size=[2, 4, 100],
                ),
            ),  # fmt: skip
            "minus START 2 must be a non-negative multiple of INCREMENT 4",
        ),
        (
            lambda: _run(engine=EngineConfig(overlap_param_gather=True)),
            "--overlap-param-gather needs --use-distributed-optimizer",
        ),
        (
            lambda: _run(exit=ExitConfig(skip_train=True)),
            "--skip-train evaluates a checkpoint: pass --load",
        ),
        (
            lambda: _run(
                engine=EngineConfig(ddp_impl="megatron"),
                parallel=ParallelConfig(use_distributed_optimizer=True),
                ckpt=CheckpointConfig(save="ckpt"),
            ),
            "--ddp-impl megatron with --use-distributed-optimizer cannot save or load optimizer",
        ),
        (
            lambda: _run(
                engine=EngineConfig(ddp_impl="megatron"), precision=PrecisionConfig(fp16=True)
            ),
            "--ddp-impl megatron supports --bf16 (or float32), not --fp16",
        ),
        (
            lambda: _run(log=LoggingConfig(profile=True)),
            "--profile writes its trace beside the TensorBoard logs",
        ),
        (
            lambda: _run(parallel=ParallelConfig(tensor_model_parallel_size=4)).resolve(6),
            "world size 6 is not divisible by tensor x pipeline x context parallel size 4x1x1=4",
        ),
    ],
)
def test_each_config_refuses_bad_values_with_the_flag_line(build, message):
    with pytest.raises(ValueError) as info:
        build()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_command_line_prints_the_configs_messages():
    """The flags go through the same checks: ArgumentError carries the config's line."""
    base = BASE[:6] + ["--train-iters", "10"] + BASE[8:]
    for extra, message in (
        (["--eval-iters", "-1"], "--eval-iters must be >= 0, got -1"),
        (["--fp8-margin", "1"], "--fp8-margin needs --fp8-format"),
        (["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive; pick one"),
        (["--async-save"], "--async-save needs --save"),
        (["--seq-length", "0"], "--seq-length must be >= 1, got 0"),
    ):
        with pytest.raises(ArgumentError) as info:
            parse_config([*base, *extra], world_size=1)
        assert str(info.value).startswith(message)


def test_the_run_holds_one_seq_length():
    """--seq-length has one field in the run's tree of configs, the model's: the engines, the
    datasets and the metrics read `run.model.seq_length`; args.json records it once."""

    def fields(cls):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield cls.__name__, f.name
            for part in (hints[f.name], *typing.get_args(hints[f.name])):
                if dataclasses.is_dataclass(part):
                    yield from fields(part)

    tree = list(fields(RunConfig))
    assert {"BatchConfig", "DataConfig", "LEVConfig", "EmbeddingConfig"} <= {c for c, _ in tree}
    assert [c for c, name in tree if name == "seq_length"] == ["ModelConfig"]
    run = parse_config([*BASE, "--seq-length", "48"], world_size=1)
    assert run.model.seq_length == 48 and run.args_json()["seq_length"] == 48


def test_batch_from_run_length_derives_megatron_values():
    b = BatchConfig.from_run_length(4, micro_batch_size=2, train_iters=10)
    assert (b.global_batch_size, b.train_iters) == (8, 10)  # micro x DP, no accumulation
    b = BatchConfig.from_run_length(1, micro_batch_size=2, global_batch_size=8, train_samples=1001)
    assert b.train_iters == 125
    # A ramp 2 -> 8 by 2 over 100 samples consumes 1000 samples in more, smaller iterations.
    b = BatchConfig.from_run_length(
        1, micro_batch_size=2, global_batch_size=8, train_samples=1000,
        rampup_batch_size=[2, 2, 100],
    )  # fmt: skip
    assert b.train_iters == 143
    for kwargs, message in (
        (dict(train_iters=1, train_samples=8), "give exactly one of --train-iters and"),
        (dict(), "give exactly one of --train-iters and --train-samples"),
        (dict(train_iters=0), "--train-iters must be >= 1, got 0"),
        (dict(train_samples=1), "--train-samples 1 is less than one global batch (2)"),
    ):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            BatchConfig.from_run_length(1, micro_batch_size=2, **kwargs)


def test_optimizer_from_schedule_counts_in_samples():
    # In iterations: x the global batch; a warmup fraction is a fraction of the decay.
    o = OptimizerConfig.from_schedule(
        global_batch_size=16, train_iters=100, lr_warmup_fraction=0.1, lr=1e-3
    )
    assert (o.lr_decay_steps, o.lr_warmup_steps, o.wd_incr_steps) == (1600, 160, 1600)
    o = OptimizerConfig.from_schedule(
        global_batch_size=8, train_iters=100, lr_decay_iters=80, lr_warmup_iters=5,
        lr_wsd_decay_iters=20, lr_decay_style="WSD", lr=1e-3,
    )  # fmt: skip
    assert (o.lr_decay_steps, o.lr_warmup_steps, o.lr_wsd_decay_steps) == (640, 40, 160)
    # In samples: taken as they are; the weight-decay ramp spans whole global batches.
    o = OptimizerConfig.from_schedule(
        global_batch_size=8,
        train_samples=1001,
        lr_decay_samples=800,
        lr_warmup_samples=100,
        lr=1e-3,
    )
    assert (o.lr_decay_steps, o.lr_warmup_steps, o.wd_incr_steps) == (800, 100, 1000)
    # --start/--end-weight-decay default to --weight-decay.
    assert (o.start_weight_decay, o.end_weight_decay) == (0.01, 0.01)
    for kwargs, message in (
        (dict(train_iters=10, lr_decay_samples=5), "with --train-iters give the schedule in"),
        (dict(train_samples=80, lr_warmup_iters=1), "with --train-samples give the schedule in"),
        (dict(train_iters=10, lr_warmup_iters=1, lr_warmup_fraction=0.1), "are exclusive"),
        (dict(train_iters=10, lr_warmup_fraction=1.0), "--lr-warmup-fraction must be in [0, 1)"),
    ):
        with pytest.raises(ValueError) as info:
            OptimizerConfig.from_schedule(global_batch_size=8, **kwargs)
        assert message in str(info.value)


def test_training_config_derives_across_configs():
    cfg = _run(
        exit=ExitConfig(skip_train=True),
        optim=OptimizerConfig(lr=1e-3, min_lr=1e-5, decoupled_lr=5e-3),
        ckpt=CheckpointConfig(load="ckpt"),
    )
    assert cfg.optim.decoupled_min_lr == 1e-5  # Megatron-LM: --min-lr
    assert cfg.ckpt.no_load_optim  # --skip-train evaluates the weights only
    # resolve: the data-parallel size of the world, and the batch checked against it.
    assert cfg.resolve(1) is cfg
    two = dataclasses.replace(cfg, parallel=ParallelConfig(tensor_model_parallel_size=2))
    assert two.resolve(4).parallel.data_parallel_size == 2 and two.resolve(4).num_microbatches == 1
    with pytest.raises(ValueError, match="--global-batch-size 4 is not divisible by .* = 8"):
        two.resolve(8)


BASE = ["--micro-batch-size", "2", "--seq-length", "32", "--lr", "1e-3", "--train-iters", "100",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]  # fmt: skip
SAMPLES = BASE[:6] + BASE[8:]

# Derived values args.json held before the configs checked themselves (pinned from that code).
ARGS_JSON_CASES = [
    (
        [*BASE, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--sequence-parallel", "--global-batch-size", "16", "--lr-warmup-fraction", "0.1",
         "--weight-decay", "0.1"],
        8,
        dict(data_parallel_size=2, global_batch_size=16, train_iters=100, lr_warmup_steps=160,
             lr_decay_steps=1600, lr_wsd_decay_steps=None, wd_incr_steps=1600,
             start_weight_decay=0.1, end_weight_decay=0.1, sequence_parallel=True),
    ),
    (
        [*SAMPLES, "--train-samples", "1000", "--global-batch-size", "8", "--lr-warmup-samples",
         "100", "--lr-decay-samples", "800", "--lr-decay-style", "WSD",
         "--lr-wsd-decay-samples", "200"],
        1,
        dict(data_parallel_size=1, global_batch_size=8, train_iters=125, lr_warmup_steps=100,
             lr_decay_steps=800, lr_wsd_decay_steps=200, wd_incr_steps=1000),
    ),
    (
        [*SAMPLES, "--train-samples", "1000", "--global-batch-size", "8", "--rampup-batch-size",
         "2", "2", "100"],
        1,
        dict(train_iters=143, lr_decay_steps=1000, wd_incr_steps=1000),
    ),
    (
        [*BASE, "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "20", "--lr-warmup-iters",
         "5", "--lr-decay-iters", "80"],
        4,
        dict(data_parallel_size=4, global_batch_size=8, lr_warmup_steps=40, lr_decay_steps=640,
             lr_wsd_decay_steps=160, wd_incr_steps=800),
    ),
    (
        [*BASE, "--decoupled-lr", "5e-3", "--min-lr", "1e-5", "--skip-train", "--load", "x",
         "--sequence-parallel", "--ckpt-format", "torch_dist", "--start-weight-decay", "0.0",
         "--end-weight-decay", "0.1", "--weight-decay-incr-style", "linear"],
        1,
        dict(decoupled_min_lr=1e-5, no_load_optim=True, sequence_parallel=False,
             ckpt_format="torch_dcp", start_weight_decay=0.0, end_weight_decay=0.1,
             lr_decay_steps=200, wd_incr_steps=200),
    ),
]  # fmt: skip


@pytest.mark.parametrize("argv, world, derived", ARGS_JSON_CASES)
def test_args_json_keeps_the_derived_values(argv, world, derived):
    run = parse_config(argv, world_size=world)
    saved = run.args_json()
    assert {k: saved[k] for k in derived} == derived
    cfg = run_config_from_args_json(saved)
    assert cfg == run and cfg.args_json() == saved  # args.json rebuilds the same config
    assert cfg.optim.lr_decay_steps == saved["lr_decay_steps"]
    assert cfg.batch.train_iters == saved["train_iters"]
    assert cfg.parallel.data_parallel_size == saved["data_parallel_size"]
