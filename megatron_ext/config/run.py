"""`RunConfig`: every setting of a run in one frozen dataclass, one part per concern: batch and
run length, optimizer, exit, evaluation, checkpoint, logging, memory and engine (here), layout
and precision (`config.layout`), the model (`config.model`, `config.lev`) and the data
(`config.data`). Each part declares its flags on its fields and checks itself; `RunConfig`
checks and derives across parts, and `args_json()` is args.json (docs/architecture.md "One flag,
end to end").
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Optional

from megatron_ext.config.data import DataConfig, padded_vocab_size
from megatron_ext.config.flags import flag, flag_dataclass, flag_dest, flag_fields
from megatron_ext.config.layout import ParallelConfig, PrecisionConfig, check_layout
from megatron_ext.config.lev import LEVConfig
from megatron_ext.config.model import ModelConfig
from megatron_ext.config.rampup import BatchSizeRampup

__all__ = [
    "BatchConfig",
    "CheckpointConfig",
    "EngineConfig",
    "EvalConfig",
    "ExitConfig",
    "LoggingConfig",
    "MemoryConfig",
    "OptimizerConfig",
    "RunConfig",
]


@flag_dataclass
class BatchConfig:
    """Batch sizes and run length (Megatron-LM's flags). The command line leaves the global
    batch and the run length unset and `from_run_length` derives them; a library user gives
    them directly. A sample is `model.seq_length` tokens."""

    micro_batch_size: Optional[int] = flag(
        1,
        "sequences per forward and backward on one rank (required)",
        command_line_default=None,
        required=True,
        minimum=1,
    )
    global_batch_size: Optional[int] = flag(
        1,
        "sequences per optimizer step, at the end of --rampup-batch-size if any (default: "
        "micro-batch size x data-parallel size, no accumulation)",
        command_line_default=None,
        required=True,
        minimum=1,
    )
    train_iters: Optional[int] = flag(
        0,
        "iterations to train (or --train-samples)",
        command_line_default=None,
        required=True,
        minimum=0,
    )
    train_samples: Optional[int] = flag(
        None, "samples to train (or --train-iters, which it derives)", minimum=1
    )
    rampup_batch_size: Optional[list[int]] = flag(
        None,
        "grow the global batch from START by INCREMENT over SAMPLES consumed samples",
        nargs=3,
        type=int,
        metavar=("START", "INCREMENT", "SAMPLES"),
    )
    num_workers: int = flag(0, "dataloader workers", command_line_default=2)
    """Megatron-LM's 2 on the command line; 0 (in-process) for a config built in code."""
    dataloader_type: str = flag(
        "single",
        "Megatron-LM's sequential pretraining sampler (resumes at the consumed sample)",
        choices=("single",),
    )

    def rampup(self, data_parallel_size: int) -> Optional[BatchSizeRampup]:
        """The --rampup-batch-size schedule at `data_parallel_size` (None without the flag);
        ValueError for a ramp that does not reach the global batch or does not split."""
        if not self.rampup_batch_size:
            return None
        start, increment, samples = self.rampup_batch_size
        micro_times_dp = self.micro_batch_size * data_parallel_size
        return BatchSizeRampup(start, increment, samples, self.global_batch_size, micro_times_dp)

    @classmethod
    def from_run_length(
        cls,
        data_parallel_size: int,
        *,
        micro_batch_size: int,
        global_batch_size: Optional[int] = None,
        train_iters: Optional[int] = None,
        train_samples: Optional[int] = None,
        **flags,
    ) -> "BatchConfig":
        """Megatron-LM's batch flags at `data_parallel_size`: the global batch defaults to
        micro-batch x DP; the run length is one of `train_iters` and `train_samples` (iterations
        derived, through --rampup-batch-size if any). `flags`: the other fields."""
        if (train_iters is None) == (train_samples is None):
            raise ValueError("give exactly one of --train-iters and --train-samples")
        if train_iters is not None and train_iters < 1:
            raise ValueError(f"--train-iters must be >= 1, got {train_iters}")
        if global_batch_size is None and micro_batch_size is not None:
            global_batch_size = micro_batch_size * data_parallel_size
        batch = cls(
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            train_iters=train_iters or 0,
            train_samples=train_samples,
            **flags,
        )  # checks the batch sizes and --train-samples
        if train_samples is None:
            return batch
        if train_samples < global_batch_size:
            raise ValueError(
                f"--train-samples {train_samples} is less than one global batch "
                f"({global_batch_size})"
            )
        ramp, gbs = batch.rampup(data_parallel_size), global_batch_size
        iters = ramp.iterations_for(train_samples) if ramp else train_samples // gbs
        return dataclasses.replace(batch, train_iters=iters)


@flag_dataclass
class ExitConfig:
    """When the run stops early: exit conditions (each saves first), non-finite steps, and
    --skip-train (evaluate a checkpoint, train nothing; `RunConfig` checks it has --load)."""

    exit_interval: Optional[int] = flag(None, "exit at a multiple of this", minimum=1)
    exit_duration_in_mins: Optional[float] = flag(
        None, "exit after this many minutes of training", above=0
    )
    exit_signal_handler: bool = flag(
        False, "on SIGTERM, save a checkpoint and exit cleanly at the end of the iteration"
    )
    check_for_nan_in_loss_and_grad: bool = flag(
        True, "stop (or skip, see --skip-nonfinite-steps) on a non-finite loss or grad norm"
    )
    skip_nonfinite_steps: bool = flag(
        False, "skip the optimizer step of a non-finite iteration instead of stopping"
    )
    max_nonfinite_steps: int = flag(
        10, "stop after this many non-finite iterations in a row", minimum=1
    )
    skip_train: bool = flag(
        False, "load --load, run validation and test, exit (implies --no-load-optim)"
    )


@flag_dataclass
class EvalConfig:
    """Validation during training (and the test set at the end)."""

    eval_interval: Optional[int] = flag(
        None, "iterations between validations (default: only after training)", minimum=1
    )
    eval_iters: int = flag(100, "global batches per evaluation (0: no evaluation)", minimum=0)


@flag_dataclass
class OptimizerConfig:
    """AdamW and Megatron's learning-rate / weight-decay schedule (in samples)."""

    optimizer: str = flag("adam", "AdamW (decoupled WD)", choices=("adam", "adamw"))
    lr: Optional[float] = flag(
        None, "peak learning rate (no default, as in Megatron-LM)", required=True
    )
    min_lr: float = flag(0.0, "learning rate at the end of the decay")
    lr_decay_style: str = flag(
        "linear",
        "learning-rate decay after the warmup",
        choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    )
    lr_warmup_init: float = flag(0.0, "learning rate at the warmup's start")
    lr_wsd_decay_style: str = flag(
        "exponential",
        "the WSD schedule's final decay",
        choices=("exponential", "linear", "cosine", "minus_sqrt"),
    )
    weight_decay: float = flag(0.01, "AdamW weight decay", minimum=0)
    start_weight_decay: Optional[float] = flag(
        None, "weight decay at the start (default: --weight-decay)"
    )
    end_weight_decay: Optional[float] = flag(
        None, "weight decay at the end (default: --weight-decay)"
    )
    weight_decay_incr_style: str = flag(
        "constant",
        "how weight decay goes from start to end",
        choices=("constant", "linear", "cosine"),
    )
    adam_beta1: float = flag(0.9, "Adam's first-moment decay, in [0, 1)")
    adam_beta2: float = flag(0.999, "Adam's second-moment decay, in [0, 1)")
    adam_eps: float = flag(1e-8, "Adam's denominator epsilon")
    clip_grad: float = flag(1.0, "0 disables clipping", minimum=0)
    # Megatron-LM spells these two both ways.
    override_opt_param_scheduler: bool = flag(
        False,
        "take the schedule from the flags, not from the checkpoint loaded",
        aliases=("--override-opt-param-scheduler",),
        name="--override-opt_param-scheduler",
    )
    use_checkpoint_opt_param_scheduler: bool = flag(
        False,
        "take the schedule from the checkpoint loaded, not from the flags",
        aliases=("--use-checkpoint-opt-param-scheduler",),
        name="--use-checkpoint-opt_param-scheduler",
    )
    decoupled_lr: Optional[float] = flag(
        None, "peak LR of the input embedding (for LEV: the LEV generator) and the output head"
    )
    decoupled_min_lr: Optional[float] = flag(
        None, "minimum LR of those parameters (default: --min-lr)", needs="decoupled_lr"
    )
    # The schedule as typed, in iterations or samples; `from_schedule` derives the *_steps below
    # from them (Megatron-LM steps its scheduler in samples). A config built in code sets those.
    lr_decay_iters: Optional[int] = flag(None, "iterations of decay (default: --train-iters)")
    lr_decay_samples: Optional[int] = flag(None, "samples of decay (default: --train-samples)")
    lr_warmup_iters: int = flag(0, "iterations of linear warmup")
    lr_warmup_samples: int = flag(0, "samples of linear warmup")
    lr_warmup_fraction: Optional[float] = flag(None, "warmup as a fraction of the decay, in [0, 1)")
    lr_wsd_decay_iters: Optional[int] = flag(None, "iterations of WSD's final decay")
    lr_wsd_decay_samples: Optional[int] = flag(None, "samples of WSD's final decay")
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 1
    lr_wsd_decay_steps: Optional[int] = None
    wd_incr_steps: int = 1

    @classmethod
    def derive(cls, values: dict) -> dict:
        """The weight decay at start and end default to --weight-decay; with --decoupled-lr,
        its minimum to --min-lr (Megatron-LM's)."""
        for name in ("start_weight_decay", "end_weight_decay"):
            if values[name] is None:
                values[name] = values["weight_decay"]
        if values["decoupled_lr"] is not None and values["decoupled_min_lr"] is None:
            values["decoupled_min_lr"] = values["min_lr"]
        return values

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr}), --lr > 0")
        if self.lr_warmup_init > self.lr:
            raise ValueError("--lr-warmup-init must not exceed --lr")
        if not (0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0):
            raise ValueError("--adam-beta1 and --adam-beta2 must be in [0, 1)")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError(
                "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler conflict"
            )
        if self.lr_warmup_steps >= self.lr_decay_steps:
            raise ValueError(
                "the warmup is not shorter than the decay; lower --lr-warmup-* or raise "
                "--lr-decay-iters/--train-iters"
            )
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_steps is None:
            raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters/-samples")
        if self.weight_decay_incr_style == "constant" and (
            self.start_weight_decay != self.end_weight_decay
        ):
            raise ValueError(
                "--start-weight-decay != --end-weight-decay needs --weight-decay-incr-style "
                "linear or cosine"
            )
        if self.decoupled_lr is not None:
            if self.decoupled_lr <= 0 or not 0 <= self.decoupled_min_lr <= self.decoupled_lr:
                raise ValueError(
                    f"need 0 <= --decoupled-min-lr ({self.decoupled_min_lr}) <= --decoupled-lr "
                    f"({self.decoupled_lr}), --decoupled-lr > 0"
                )

    @classmethod
    def from_schedule(
        cls,
        *,
        global_batch_size: int,
        train_iters: Optional[int] = None,
        train_samples: Optional[int] = None,
        **fields,
    ) -> "OptimizerConfig":
        """Megatron-LM's schedule flags -> the lengths in samples: in iterations (x
        `global_batch_size`) for a run given in `train_iters`, in samples for `train_samples`.
        The decay defaults to the whole run; the weight-decay ramp spans it. `fields`: the rest."""
        # The unit the run is given in, its scale to samples, and the other unit (refused).
        unit, scale, other, length = "iters", global_batch_size, "samples", train_iters
        if train_samples is not None:
            unit, scale, other, length = "samples", 1, "iters", train_samples
        given = {name: fields.get(f"lr_{name}_{unit}") for name in ("decay", "warmup", "wsd_decay")}
        if fields.get(f"lr_decay_{other}") is not None or fields.get(f"lr_warmup_{other}"):
            words = {"iters": "iterations", "samples": "samples"}
            raise ValueError(
                f"with --train-{unit} give the schedule in {words[unit]} (--lr-decay-{unit}, "
                f"--lr-warmup-{unit}), not {words[other]}"
            )
        decay = (given["decay"] or length) * scale
        warmup = (given["warmup"] or 0) * scale
        fraction = fields.get("lr_warmup_fraction")
        if fraction is not None:
            if given["warmup"]:
                raise ValueError(
                    "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive"
                )
            if not 0.0 <= fraction < 1.0:
                raise ValueError("--lr-warmup-fraction must be in [0, 1)")
            warmup = int(fraction * decay)
        wsd_decay = None if given["wsd_decay"] is None else given["wsd_decay"] * scale
        iterations = train_iters if train_samples is None else train_samples // global_batch_size
        return cls(
            **fields,
            lr_warmup_steps=warmup,
            lr_decay_steps=decay,
            lr_wsd_decay_steps=wsd_decay,
            wd_incr_steps=iterations * global_batch_size,
        )


@flag_dataclass
class CheckpointConfig:
    """torch.distributed.checkpoint directories `<save>/iter_0000100/` + the latest marker."""

    save: Optional[str] = flag(None, "directory of iter_XXXXXXX/ checkpoints")
    load: Optional[str] = flag(None, "directory of the checkpoints to resume from")
    save_interval: Optional[int] = flag(
        None, "iterations between checkpoints", minimum=1, needs="save"
    )
    ckpt_keep_last: Optional[int] = flag(
        None, "keep only the newest N checkpoints in --save (default: keep all)", minimum=1
    )
    ckpt_step: Optional[int] = flag(None, "load this iteration (default: the latest)", needs="load")
    no_save_optim: bool = flag(False, "save no optimizer state")
    no_save_rng: bool = flag(False, "save no RNG state")
    no_load_optim: bool = flag(False, "load no optimizer state")
    no_load_rng: bool = flag(False, "load no RNG state")
    finetune: bool = flag(
        False, "load weights only; reset iteration, optimizer, scheduler and RNG", needs="load"
    )
    exit_on_missing_checkpoint: bool = flag(False, "exit if --load holds no checkpoint")
    verify_checkpoint: bool = flag(
        True,
        "load without first checking every file of the checkpoint against the digests "
        "recorded when it was saved",
        action="store_false",
    )
    async_save: bool = flag(
        False,
        "write checkpoints in the background (torch.distributed.checkpoint async_save); "
        "the latest marker moves only once every rank's write completed",
        needs="save",
    )
    ckpt_format: str = flag(
        "torch_dcp",
        "plain torch.distributed.checkpoint (DCP) with DTensor tensor-parallel shards; "
        "not Megatron's torch_dist format (tools/convert_checkpoint.py export-megatron writes "
        "a checkpoint Megatron-LM loads). torch_dist, which Megatron-LM launch scripts pass, "
        "is accepted with a logged note and means torch_dcp",
        choices=("torch_dcp", "torch_dist"),
    )
    use_checkpoint_args: bool = flag(False, "take the model flags from the checkpoint in --load")


@flag_dataclass
class LoggingConfig:
    """What the loop logs, where, and how often (Megatron-LM's logging flags)."""

    log_interval: int = flag(100, "iterations between log lines", minimum=1)
    tensorboard_dir: Optional[str] = flag(None, "write TensorBoard events")
    tensorboard_log_interval: int = flag(1, "iterations between TensorBoard points", minimum=1)
    tensorboard_queue_size: int = flag(1000, "TensorBoard events queued before a flush")
    log_throughput: bool = flag(False, "TFLOP/s per GPU in the line")
    log_validation_ppl_to_tensorboard: bool = flag(False, "validation perplexity too")
    log_timers_to_tensorboard: bool = flag(False, "the --timing-log-level timers too")
    timing_log_level: int = flag(
        0,
        "1: a line of the time per part of the iteration; 2: also LEV's forwards and "
        "global-batch backward (parts of forward-backward)",
        choices=(0, 1, 2),
    )
    peak_tflops: Optional[float] = flag(
        None, "per-GPU peak for MFU (default: looked up from the GPU name)"
    )
    log_jsonl: Optional[str] = flag(
        None, "append one JSON line per iteration (full-precision loss, grad norm, lr, time)"
    )
    loss_curve: bool = flag(
        True,
        "write no loss_curve.png beside the TensorBoard events (or the --log-jsonl file) at "
        "the end",
        action="store_false",
    )
    log_params_norm: bool = flag(False, "L2 norm of all parameters")
    log_num_zeros_in_grad: bool = flag(False, "count of zero gradient entries")
    log_memory_to_tensorboard: bool = flag(
        False, "memory in use (CUDA allocator, or this process's RSS on CPU)"
    )
    log_world_size_to_tensorboard: bool = flag(False, "the number of ranks")
    log_loss_scale_to_tensorboard: bool = flag(
        True,
        "no FP16 loss scale in TensorBoard",
        aliases=("--disable-log-loss-scale-to-tensorboard",),
        action="store_false",
    )
    logging_level: Optional[int] = flag(None, "Python logging level (e.g. 10, 20)")
    profile: bool = flag(False, "torch.profiler trace beside the TensorBoard logs")
    profile_step_start: int = flag(10, "profile from the iteration after it")
    profile_step_end: int = flag(12, "last profiled iteration")
    profile_ranks: list[int] = flag([0], "ranks that profile", nargs="+")
    wandb_project: Optional[str] = flag(None, "Weights & Biases project")
    wandb_exp_name: Optional[str] = flag(None, "Weights & Biases run name")
    wandb_save_dir: Optional[str] = flag(None, "local W&B directory")
    wandb_entity: Optional[str] = flag(None, "Weights & Biases team or user")

    def __post_init__(self) -> None:
        if self.profile and not 0 <= self.profile_step_start < self.profile_step_end:
            raise ValueError(
                f"need 0 <= --profile-step-start ({self.profile_step_start}) < "
                f"--profile-step-end ({self.profile_step_end})"
            )


@flag_dataclass
class MemoryConfig:
    """Memory housekeeping around the steps: manual garbage collection (Python), keeping freed
    host memory (glibc's malloc) and emptying the CUDA caching allocator
    (`run_extras.RunExtras` applies them)."""

    manual_gc: bool = flag(False, "disable automatic gc; collect at fixed points")
    manual_gc_interval: int = flag(0, "collect every N iterations", minimum=0)
    manual_gc_eval: bool = flag(
        True, "no gc around evaluation", aliases=("--disable-manual-gc-eval",), action="store_false"
    )
    retain_host_memory: bool = flag(
        True,
        "return freed host memory to the OS between iterations (glibc's defaults) instead of "
        "keeping it for the next iteration",
        action="store_false",
    )
    empty_unused_memory_level: int = flag(
        0,
        "torch.cuda.empty_cache() after each training step (2: also around evaluation); CUDA only",
        choices=(0, 1, 2),
    )


@flag_dataclass
class EngineConfig:
    """Which training engine runs the step: the portable one (`engine_portable`, gloo and NCCL)
    or megatron-core's (`--ddp-impl megatron`, CUDA only), its DDP settings and the loss
    normalisation (both engines honour --calculate-per-token-loss)."""

    ddp_impl: str = flag(
        "portable",
        "training engine: portable (CPU and GPU) or megatron (megatron-core's "
        "DistributedDataParallel, distributed optimizer and pipeline schedules; CUDA only)",
        choices=("portable", "megatron"),
    )
    overlap_grad_reduce: bool = flag(
        False, "overlap the DP gradient reduce with backward (megatron DDP)"
    )
    overlap_param_gather: bool = flag(
        False, "overlap the distributed optimizer's parameter all-gather with forward"
    )
    ddp_bucket_size: Optional[int] = flag(
        None, "parameters per DDP bucket (default: megatron-core's)", minimum=1
    )
    calculate_per_token_loss: bool = flag(
        False, "normalise the loss by the global batch's token count (not per micro-batch)"
    )
    cpu_accel: bool = flag(
        True,
        "run without the CPU accelerations (compiled C++ kernels, host-memory tuning): the "
        "portable paths, same results; as MEGATRON_EXT_CPU_ACCEL=0",
        action="store_false",
    )


@flag_dataclass
class RunConfig:
    """Every setting of a run, one dataclass per concern."""

    batch: BatchConfig
    optim: OptimizerConfig
    model: ModelConfig
    """Its `seq_length` is the run's. From the command line its vocabulary is None until
    `with_tokenizer`."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    exit: ExitConfig = field(default_factory=ExitConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LoggingConfig = field(default_factory=LoggingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    seed: int = flag(1234, "seeds Python, NumPy and torch (offset by the pipeline rank)")
    lev: Optional[LEVConfig] = None
    """The --lev-* flags (args.json records them for every arm): for an arm that uses LEV,
    `model.embedding.lev` itself (at the model's V and D); given here only for the others."""
    data: Optional[DataConfig] = None
    compat_flags: dict[str, Any] = field(default_factory=dict)
    """The flags no config owns, by namespace name (`config.megatron_compat`'s, and the
    deprecated `lev_fused`: None, mapped onto --lev-kernel while parsing)."""

    @classmethod
    def derive(cls, values: dict) -> dict:
        """The values one part derives for another: a LEV arm's LEVConfig is the run's;
        megatron's engine keeps BF16 parameters; the model's depth gives the chunks per
        pipeline rank; --skip-train loads no optimizer state."""
        precision, model, ckpt = values["precision"], values["model"], values["ckpt"]
        if model.embedding.lev is not None:
            if values["lev"] not in (None, model.embedding.lev):
                raise ValueError("RunConfig: a LEV arm's run uses model.embedding.lev: lev=None")
            values["lev"] = model.embedding.lev
        if values["engine"].ddp_impl == "megatron" and precision.bf16:
            values["precision"] = dataclasses.replace(precision, params_dtype="bfloat16")
        values["parallel"] = values["parallel"].with_num_layers(model.num_layers)
        if values["exit"].skip_train and ckpt.load:
            values["ckpt"] = dataclasses.replace(ckpt, no_load_optim=True)
        return values

    def __post_init__(self) -> None:
        """The checks that span two parts."""
        if self.data is not None:
            self.data.check_sources()
        b, p = self.batch, self.parallel
        micro_times_dp = b.micro_batch_size * p.data_parallel_size
        if b.global_batch_size % micro_times_dp:
            raise ValueError(
                f"--global-batch-size {b.global_batch_size} is not divisible by "
                f"--micro-batch-size {b.micro_batch_size} x data-parallel size "
                f"{p.data_parallel_size} = {micro_times_dp}; change one of them"
            )
        b.rampup(p.data_parallel_size)  # checks --rampup-batch-size
        if p.num_layers_per_virtual_pipeline_stage:
            self._check_interleaved()
        if self.exit.skip_train and not self.ckpt.load:
            raise ValueError("--skip-train evaluates a checkpoint: pass --load")
        if self.engine.overlap_param_gather and not p.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
        megatron = self.engine.ddp_impl == "megatron"
        if self.precision.fp8_param_gather and not (
            megatron and p.use_distributed_optimizer and self.precision.fp8_format
        ):
            raise ValueError(
                "--fp8-param-gather needs megatron-core's distributed optimizer with FP8: "
                "--ddp-impl megatron --use-distributed-optimizer --fp8-format; drop it otherwise"
            )
        if megatron:
            ck = self.ckpt
            optim_state = (ck.save and not ck.no_save_optim) or (ck.load and not ck.no_load_optim)
            if p.use_distributed_optimizer and optim_state:
                raise ValueError(
                    "--ddp-impl megatron with --use-distributed-optimizer cannot save or load "
                    "optimizer state in the checkpoint format (megatron's distributed optimizer "
                    "keeps flat per-bucket shards that do not reshard); pass --no-save-optim "
                    "and --no-load-optim, or drop --use-distributed-optimizer"
                )
            if self.precision.fp16:
                raise ValueError("--ddp-impl megatron supports --bf16 (or float32), not --fp16")
        if self.log.profile and not (self.log.tensorboard_dir or self.ckpt.save):
            raise ValueError(
                "--profile writes its trace beside the TensorBoard logs: --tensorboard-dir"
            )
        check_layout(self.model, self.parallel, self.precision)

    def _check_interleaved(self) -> None:
        """What the interleaved 1F1B schedule (virtual pipeline stages) needs of the run."""
        p, b = self.parallel, self.batch
        flag_ = (
            "--num-layers-per-virtual-pipeline-stage (or --num-virtual-stages-per-pipeline-rank)"
        )
        if self.engine.ddp_impl != "portable":
            raise ValueError(
                f"{flag_} runs on the portable engine (megatron-core's interleaved schedule needs "
                "CUDA and is not tested here): drop --ddp-impl megatron"
            )
        pp = p.pipeline_model_parallel_size
        if b.rampup_batch_size:
            # Every ramp batch is START + k x INCREMENT, so both must split into a multiple of PP.
            per_pp = b.micro_batch_size * p.data_parallel_size * pp
            start, increment, _ = b.rampup_batch_size
            for name, value in (("START", start), ("INCREMENT", increment)):
                if value % per_pp:
                    raise ValueError(
                        f"{flag_} with --rampup-batch-size needs {name} {value} to be a multiple "
                        f"of --micro-batch-size x data-parallel size x "
                        f"--pipeline-model-parallel-size = {per_pp} (every ramp batch must split "
                        "into a multiple of PP micro-batches); change the ramp"
                    )
        if self.num_microbatches % pp:
            raise ValueError(
                f"{flag_} needs the number of micro-batches per iteration ({self.num_microbatches}"
                f" = --global-batch-size {b.global_batch_size} / (--micro-batch-size "
                f"{b.micro_batch_size} x data-parallel size {p.data_parallel_size})) to be a "
                f"multiple of --pipeline-model-parallel-size {pp}; change the global batch"
            )

    def resolve(self, world_size: int) -> "RunConfig":
        """This config on `world_size` ranks, the data-parallel size derived (self if it is);
        ValueError where the ranks or the global batch do not split."""
        parallel = self.parallel.resolve(world_size)
        return self if parallel is self.parallel else dataclasses.replace(self, parallel=parallel)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per data-parallel rank per iteration (gradient accumulation steps)."""
        b = self.batch
        return b.global_batch_size // (b.micro_batch_size * self.parallel.data_parallel_size)

    def with_tokenizer(self, tokenizer) -> "RunConfig":
        """This run once its tokenizer is built: the model's vocabulary the tokenizer's padded
        (Megatron-LM's), the data with the tokenizer's fingerprint (`data.fingerprint`)."""
        vocab = padded_vocab_size(
            tokenizer.vocab_size,
            self.data.make_vocab_size_divisible_by,
            self.parallel.tensor_model_parallel_size,
        )
        data = dataclasses.replace(self.data, tokenizer_fingerprint=tokenizer.fingerprint)
        model = self.model.replace(vocab_size=vocab)
        return dataclasses.replace(
            self, model=model, lev=None if model.embedding.lev else self.lev, data=data
        )

    def args_json(self) -> dict[str, Any]:
        """args.json: one key per flag (Megatron-LM's namespace names) and per value the
        training parts derive; the model and LEV flags as given (a preset's sizes stay None)."""
        out = dict(self.compat_flags)
        training = (self.batch, self.optim, self.parallel, self.precision, self.exit, self.eval)
        for part in (*training, self.ckpt, self.log, self.memory, self.engine):
            out.update(_recorded(part, derived=True))
        out.update(seed=self.seed, world_size=self.parallel.world_size)
        if self.lev is not None:
            out.update(_recorded(self.lev))
        given = {name: None for name in self.model.derived}
        out.update({**_recorded(self.model), **_recorded(self.model.embedding), **given})
        if self.data is not None:
            out.update(_recorded(self.data))
            if self.data.tokenizer_fingerprint is not None:
                out["tokenizer_fingerprint"] = self.data.tokenizer_fingerprint
        return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(out.items())}


def _recorded(part, derived: bool = False) -> dict[str, Any]:
    """A config's flags by namespace name (with `derived`, its other fields too, by their own
    names: the values it derives; the parameters' dtype is the engine's, not recorded)."""
    fields = dataclasses.fields(part) if derived else flag_fields(type(part))
    return {flag_dest(f): getattr(part, f.name) for f in fields if f.name != "params_dtype"}
