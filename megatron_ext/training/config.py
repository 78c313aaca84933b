"""`TrainingConfig`: every setting of a training run, one small dataclass per concern.

`pretrain(cfg)` reads these and nothing else (no argparse namespace). Each field has one owner:
the layout in `ParallelConfig`, batch sizes and run length in `BatchConfig`, numerics in
`PrecisionConfig`, when to stop in `ExitConfig`, and so on. The command line fills them in
`arguments.training_config_from_args` after `arguments.validate_args` checked the flags and
derived the values Megatron-LM derives (data-parallel size, iterations from samples, schedule
lengths in samples); a library user can also build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_ext.training.megatron_features import FeatureConfig

__all__ = [
    "ParallelConfig",
    "BatchConfig",
    "PrecisionConfig",
    "ExitConfig",
    "EvalConfig",
    "OptimizerConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "EngineConfig",
    "TrainingConfig",
]


@dataclass
class ParallelConfig:
    """Process layout: TP x CP x PP x DP ranks (DP is derived from the world size)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    """Split norm/dropout activations over the sequence across TP ranks (Megatron-LM's SP)."""
    use_distributed_optimizer: bool = False
    """Shard Adam states across data-parallel ranks (ZeRO-1)."""
    distributed_backend: Optional[str] = None
    """nccl | gloo; None picks nccl when CUDA is available, gloo otherwise."""
    distributed_timeout_minutes: int = 10
    data_parallel_size: int = 1
    """Derived: world size / (TP x CP x PP)."""


@dataclass
class BatchConfig:
    """Batch sizes and run length."""

    seq_length: int
    """Tokens per sample (--seq-length, the length the model is built for)."""
    micro_batch_size: int = 1
    global_batch_size: int = 1
    """At the end of --rampup-batch-size (`FeatureConfig`), if any."""
    train_iters: int = 0
    """Iterations to train (derived from --train-samples when that is given)."""
    num_workers: int = 0
    """DataLoader worker processes (the data flag --num-workers)."""


@dataclass
class PrecisionConfig:
    """Autocast precision of the portable engine and FP16 loss scaling (see `precision.py`)."""

    bf16: bool = False
    fp16: bool = False
    fp8_format: Optional[str] = None
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    loss_scale: Optional[float] = None
    """Static FP16 loss scale (None: dynamic)."""
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


@dataclass
class ExitConfig:
    """When the run stops early: exit conditions (each saves first) and non-finite steps."""

    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    check_for_nan_in_loss_and_grad: bool = True
    skip_nonfinite_steps: bool = False
    """Skip the optimizer step of an iteration whose loss or grad norm is not finite (instead of
    stopping); the run still stops after --max-nonfinite-steps such iterations in a row."""
    max_nonfinite_steps: int = 10


@dataclass
class EvalConfig:
    """Validation during training (and the test set at the end)."""

    eval_interval: int = 1000
    eval_iters: int = 100
    """Global batches per evaluation (0: no evaluation)."""


@dataclass
class OptimizerConfig:
    """AdamW and Megatron's learning-rate / weight-decay schedule (in samples)."""

    optimizer: str = "adam"
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    weight_decay: float = 0.01
    start_weight_decay: Optional[float] = None
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: str = "constant"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    # Derived, in samples (Megatron-LM steps its scheduler by the global batch size).
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 1
    lr_wsd_decay_steps: Optional[int] = None
    wd_incr_steps: int = 1


@dataclass
class CheckpointConfig:
    """torch.distributed.checkpoint directories `<save>/iter_0000100/` + the latest marker."""

    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    ckpt_keep_last: Optional[int] = None
    """Delete all but the newest N checkpoints after each successful save (None: keep all)."""
    ckpt_step: Optional[int] = None
    """Load this iteration instead of the latest."""
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    exit_on_missing_checkpoint: bool = False
    args_json: dict = field(default_factory=dict)
    """The run's flags, written as args.json beside each checkpoint (--use-checkpoint-args
    reads the model flags back from it) and logged at start."""


@dataclass
class LoggingConfig:
    """What the loop logs, where, and how often (Megatron-LM's logging flags)."""

    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    log_throughput: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_timers_to_tensorboard: bool = False
    timing_log_level: int = 0
    peak_tflops: Optional[float] = None
    """Per-GPU peak TFLOP/s for MFU (default: looked up from the GPU name)."""
    log_jsonl: Optional[str] = None
    """Append one JSON record per iteration (full-precision loss, grad norm, lr) to this file."""
    loss_curve: bool = True
    """Write loss_curve.png beside the TensorBoard events (or the checkpoints) at the end."""


@dataclass
class EngineConfig:
    """Which training engine runs the step: the portable one (`loop._Trainer`, gloo and NCCL)
    or megatron-core's (`--ddp-impl megatron`, CUDA only) and its DDP settings."""

    ddp_impl: str = "portable"
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: Optional[int] = None


@dataclass
class TrainingConfig:
    """Every training setting, one dataclass per concern."""

    batch: BatchConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    exit: ExitConfig = field(default_factory=ExitConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LoggingConfig = field(default_factory=LoggingConfig)
    features: FeatureConfig = field(default_factory=FeatureConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    seed: int = 1234
    """Seeds Python, NumPy and torch (offset by the pipeline rank, as Megatron-LM does)."""

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per data-parallel rank per iteration (gradient accumulation steps)."""
        b = self.batch
        return b.global_batch_size // (b.micro_batch_size * self.parallel.data_parallel_size)
