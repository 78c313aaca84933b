"""Command-line flags of `pretrain_leviathan.py` (Megatron-LM's names and meanings) and the
`TrainingConfig` they fill.

The parser is built from the groups below plus the model (`megatron_ext.models`) and data
(`megatron_ext.data`) flag groups. `parse_args` parses, optionally replaces the model flags with
the ones stored in a checkpoint (`--use-checkpoint-args`), applies Megatron-LM's flag-level
rewrites, and builds the `config.TrainingConfig` dataclasses from the flags: they check
themselves, and their one-line ValueError (naming the flag to change) becomes `ArgumentError`.
The values they derive (data-parallel size, iterations from samples, schedule lengths in
samples, ...) are written back to the namespace, which args.json records. The model's own checks
are `ModelConfig`'s. The library never reads the namespace: `training_config_from_args` turns it
into the `TrainingConfig` that is all `pretrain` receives.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
from dataclasses import fields
from typing import Optional, Sequence

import torch

from megatron_ext.training.config import (
    BatchConfig,
    CheckpointConfig,
    EngineConfig,
    EvalConfig,
    ExitConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainingConfig,
)
from megatron_ext.training.megatron_features import FeatureConfig

logger = logging.getLogger(__name__)

__all__ = [
    "ArgumentError",
    "build_parser",
    "parse_args",
    "validate_args",
    "training_config_from_args",
    "args_to_json",
    "checkpoint_args_path",
]

# Flags restored by --use-checkpoint-args: everything that shapes the model's parameters.
MODEL_ARG_NAMES = (
    "model_size",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "seq_length",
    "max_position_embeddings",
    "rotary_base",
    "rotary_percent",
    "kv_channels",
    "norm_epsilon",
    "qk_layernorm",
    "embedding_type",
    "untie_embeddings_and_output_weights",
    "albert_dim",
    "flat_mlp_seed_dim",
    "embedding_mlp_hidden",
    "make_vocab_size_divisible_by",
    "tokenizer_type",
    "tokenizer_model",
    "vocab_size",
)


class ArgumentError(ValueError):
    """An impossible or contradictory combination of flags (the message names the flag)."""


def _fill(cls, args: argparse.Namespace, **values):
    """Build dataclass `cls` from the namespace attributes of the same names (and `values`)."""
    taken = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return cls(**{**taken, **values})


def _configs_from(args: argparse.Namespace, **given) -> TrainingConfig:
    parts = dict(
        batch=BatchConfig,
        parallel=ParallelConfig,
        precision=PrecisionConfig,
        exit=ExitConfig,
        eval=EvalConfig,
        optim=OptimizerConfig,
        log=LoggingConfig,
        features=FeatureConfig,
        engine=EngineConfig,
    )
    built = {name: given.get(name) or _fill(cls, args) for name, cls in parts.items()}
    ckpt = _fill(CheckpointConfig, args, args_json=args_to_json(args))
    return TrainingConfig(**built, ckpt=ckpt, seed=args.seed)


def training_config_from_args(args: argparse.Namespace) -> TrainingConfig:
    """The `TrainingConfig` of a namespace that went through `parse_args` (validated, derived).

    Every field is taken from the flag (or derived value) of the same name; `ckpt.args_json` is
    the whole command line as args.json records it.
    """
    return _configs_from(args)


# --------------------------------------------------------------------------------------------
# Flag groups


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard optimizer states across data-parallel ranks (ZeRO-1)",
    )
    g.add_argument(
        "--distributed-backend",
        choices=("nccl", "gloo"),
        default=None,
        help="default: nccl on CUDA, gloo on CPU",
    )
    g.add_argument("--distributed-timeout-minutes", type=float, default=10)
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this times the TP size",
    )


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="default: micro-batch size x data-parallel size (no accumulation)",
    )
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true", help="BF16 autocast (fp32 master weights)")
    g.add_argument("--fp16", action="store_true", help="FP16 autocast with dynamic loss scaling")
    g.add_argument(
        "--fp8-format",
        choices=("e4m3", "hybrid"),
        default=None,
        help="FP8 GEMMs through Transformer Engine (CUDA only; with --bf16)",
    )
    g.add_argument("--loss-scale", type=float, default=None, help="static FP16 loss scale")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--exit-interval", type=int, default=None, help="exit at a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on SIGTERM, save a checkpoint and exit cleanly at the end of the iteration",
    )
    g.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop (or skip, see --skip-nonfinite-steps) on a non-finite loss or grad norm",
    )
    g.add_argument(
        "--skip-nonfinite-steps",
        action="store_true",
        help="skip the optimizer step of a non-finite iteration instead of stopping",
    )
    g.add_argument("--max-nonfinite-steps", type=int, default=10)
    g.add_argument(
        "--dataloader-type",
        choices=("single",),
        default="single",
        help="Megatron-LM's sequential pretraining sampler (resumes at the consumed sample)",
    )


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("optimizer and learning-rate schedule")
    g.add_argument(
        "--optimizer", choices=("adam", "adamw"), default="adam", help="AdamW (decoupled WD)"
    )
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style",
        choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
        default="linear",
    )
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument(
        "--lr-wsd-decay-style",
        choices=("exponential", "linear", "cosine", "minus_sqrt"),
        default="exponential",
    )
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument(
        "--weight-decay-incr-style", choices=("constant", "linear", "cosine"), default="constant"
    )
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--override-opt_param-scheduler", action="store_true")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true")


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory of iter_XXXXXXX/ checkpoints")
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument(
        "--ckpt-keep-last",
        type=int,
        default=None,
        help="keep only the newest N checkpoints in --save (default: keep all)",
    )
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration")
    g.add_argument(
        "--ckpt-format",
        choices=("torch_dcp", "torch_dist"),
        default="torch_dcp",
        help="plain torch.distributed.checkpoint (DCP) with DTensor tensor-parallel shards; "
        "not Megatron's torch_dist format (tools/convert_checkpoint.py export-megatron writes "
        "a checkpoint Megatron-LM loads). torch_dist, which Megatron-LM launch scripts pass, "
        "is accepted with a logged note and means torch_dcp",
    )
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument(
        "--finetune",
        action="store_true",
        help="load weights only; reset iteration, optimizer, scheduler and RNG",
    )
    g.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="take the model flags from the checkpoint in --load",
    )
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging and validation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-throughput", action="store_true", help="TFLOP/s per GPU in the line")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0)
    g.add_argument("--peak-tflops", type=float, default=None, help="per-GPU peak for MFU")
    g.add_argument(
        "--log-jsonl",
        default=None,
        help="append one JSON line per iteration (full-precision loss, grad norm, lr, time)",
    )
    g.add_argument("--no-loss-curve", dest="loss_curve", action="store_false")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)


def build_parser() -> argparse.ArgumentParser:
    """The full parser: distributed, training, optimizer, checkpoint, logging, model, data."""
    from megatron_ext.data.loading import add_data_arguments
    from megatron_ext.models import add_model_arguments
    from megatron_ext.training.gpu_arguments import add_gpu_arguments

    parser = argparse.ArgumentParser(
        description="Pretrain Leviathan models and the paper's baselines (Megatron-LM flags)",
        allow_abbrev=False,
    )
    _add_distributed_args(parser)
    _add_training_args(parser)
    _add_optimizer_args(parser)
    _add_checkpoint_args(parser)
    _add_logging_args(parser)
    add_model_arguments(parser)
    add_data_arguments(parser)
    add_gpu_arguments(parser)
    from megatron_ext.training.megatron_compat import add_megatron_compat_arguments

    add_megatron_compat_arguments(parser)  # last: answers every remaining Megatron-LM flag
    return parser


# --------------------------------------------------------------------------------------------
# --use-checkpoint-args


def checkpoint_args_path(load_dir: str, iteration: Optional[int] = None) -> Optional[str]:
    """The args.json of the latest (or `iteration`) checkpoint in `load_dir`, if any."""
    from megatron_ext.training.checkpointing import checkpoint_dir, read_latest_iteration

    if iteration is None:
        iteration = read_latest_iteration(load_dir)
    if iteration is None:
        return None
    path = os.path.join(checkpoint_dir(load_dir, iteration), "args.json")
    return path if os.path.isfile(path) else None


def _explicit_dests(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> set[str]:
    """The destinations of the flags given on the command line (not left at their default)."""
    explicit = argparse.ArgumentParser(add_help=False, allow_abbrev=parser.allow_abbrev)
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            kwargs: dict = dict(dest=action.dest, default=argparse.SUPPRESS)
            if action.nargs == 0:  # switches
                kwargs.update(action="store_const", const=True)
            elif action.nargs is not None:
                kwargs["nargs"] = action.nargs
            explicit.add_argument(*action.option_strings, **kwargs)
    namespace, _ = explicit.parse_known_args(argv)
    return set(vars(namespace))


def _apply_checkpoint_args(args: argparse.Namespace, explicit: set[str]) -> None:
    """Take the model flags from the checkpoint's args.json, except those given explicitly on
    the command line (Megatron-LM: the command line wins), warning about each such one."""
    if not args.load:
        raise ArgumentError("--use-checkpoint-args needs --load")
    path = checkpoint_args_path(args.load, args.ckpt_step)
    if path is None:
        raise ArgumentError(f"--use-checkpoint-args: no checkpoint with args.json in {args.load}")
    with open(path) as handle:
        saved = json.load(handle)
    names = [n for n in MODEL_ARG_NAMES if n in saved]
    names += [n for n in saved if n.startswith("lev_") and n not in names]
    for name in names:
        if name in explicit:
            if getattr(args, name, None) != saved[name]:
                logger.warning(
                    "--use-checkpoint-args: --%s %s from the command line overrides the "
                    "checkpoint's %s",
                    name.replace("_", "-"),
                    getattr(args, name),
                    saved[name],
                )
            continue
        setattr(args, name, saved[name])
    logger.info("model flags taken from %s", path)


# --------------------------------------------------------------------------------------------
# Validation

# OptimizerConfig's schedule lengths in samples (`OptimizerConfig.from_schedule` derives them).
_SCHEDULE_IN_SAMPLES = ("lr_warmup_steps", "lr_decay_steps", "lr_wsd_decay_steps", "wd_incr_steps")
# Values the configs derive that args.json records beside the flags (config -> fields).
_DERIVED = {
    "parallel": ("data_parallel_size",),
    "batch": ("global_batch_size", "train_iters"),
    "optim": (*_SCHEDULE_IN_SAMPLES, "start_weight_decay", "end_weight_decay"),
    "features": ("decoupled_min_lr",),
    "ckpt": ("no_load_optim",),
}


def _build_training_config(args: argparse.Namespace, world_size: int) -> TrainingConfig:
    """The `TrainingConfig` of the flags as typed, Megatron-LM's derivations included."""
    parallel = _fill(ParallelConfig, args).resolve(world_size)
    batch = BatchConfig.from_run_length(
        parallel.data_parallel_size,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        train_iters=args.train_iters,
        train_samples=args.train_samples,
        rampup_batch_size=args.rampup_batch_size,
        num_workers=args.num_workers,
    )
    schedule = (
        "lr_decay_iters",
        "lr_decay_samples",
        "lr_warmup_iters",
        "lr_warmup_samples",
        "lr_warmup_fraction",
        "lr_wsd_decay_iters",
        "lr_wsd_decay_samples",
    )
    optim_fields = [f.name for f in fields(OptimizerConfig) if f.name not in _SCHEDULE_IN_SAMPLES]
    optim = OptimizerConfig.from_schedule(
        global_batch_size=batch.global_batch_size,
        train_iters=args.train_iters,
        train_samples=args.train_samples,
        **{name: getattr(args, name) for name in schedule},
        **{name: getattr(args, name) for name in optim_fields},
    )
    return _configs_from(args, batch=batch, parallel=parallel, optim=optim)


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Apply the flag-level conveniences, build the configs (which check themselves) and write
    what they derive back to the namespace for args.json (in place).

    Raises:
        ArgumentError: the one-line message of the config that refused a value.
    """
    cuda = torch.cuda.is_available()
    # What this machine must have (the configs check values, not the machine).
    if args.distributed_backend == "nccl" and not cuda:
        raise ArgumentError("--distributed-backend nccl needs CUDA; drop it (gloo is used on CPU)")
    if args.transformer_impl == "transformer_engine" and not cuda:
        raise ArgumentError("--transformer-impl transformer_engine needs a CUDA GPU; use local")
    # Megatron-LM's flag-level rewrites, so that its launch scripts run.
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        logger.warning("--sequence-parallel is off: --tensor-model-parallel-size is 1")
        args.sequence_parallel = False
    if args.ckpt_format == "torch_dist":
        logger.info(
            "--ckpt-format torch_dist: checkpoints are written as torch_dcp (this project's DCP "
            "layout, not Megatron's torch_dist); tools/convert_checkpoint.py export-megatron "
            "writes a checkpoint Megatron-LM loads"
        )
        args.ckpt_format = "torch_dcp"
    try:
        cfg = _build_training_config(args, world_size)
    except ValueError as error:
        raise ArgumentError(str(error)) from None
    for part, names in _DERIVED.items():
        for name in names:
            setattr(args, name, getattr(getattr(cfg, part), name))
    if args.exit_signal_handler and not args.save:
        logger.warning("--exit-signal-handler without --save: SIGTERM exits without a checkpoint")
    from megatron_ext.training.gpu_arguments import validate_gpu_args

    validate_gpu_args(args, cuda)
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ArgumentError(
            "--wandb-project needs the optional package wandb: pip install "
            "'megatron-ext-leviathan[wandb]' (or drop the flag)"
        )
    if args.empty_unused_memory_level and not cuda:
        logger.info("--empty-unused-memory-level: no CUDA caching allocator on CPU, no effect")
    if args.tokenizer_type is None and args.vocab_file and args.merge_file:
        args.tokenizer_type = "GPT2BPETokenizer"
        logger.info("--vocab-file and --merge-file given: --tokenizer-type GPT2BPETokenizer")
    if args.logging_level is not None:
        logging.getLogger().setLevel(args.logging_level)
    return args


def parse_args(
    argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None
) -> argparse.Namespace:
    """Parse and validate `argv` (default sys.argv) for `world_size` ranks (default torchrun's
    WORLD_SIZE, else 1)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.use_checkpoint_args:
        _apply_checkpoint_args(args, _explicit_dests(parser, argv))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    from megatron_ext.training.megatron_compat import apply_megatron_compat

    apply_megatron_compat(args, error=ArgumentError)
    return validate_args(args, world_size)


def args_to_json(args: argparse.Namespace) -> dict:
    """The namespace as JSON-safe values (stored beside each checkpoint as args.json)."""
    out = {}
    for key, value in sorted(vars(args).items()):
        if isinstance(value, (str, int, float, bool, type(None))):
            out[key] = value
        elif isinstance(value, (list, tuple)):
            out[key] = list(value)
        elif dataclasses.is_dataclass(value):
            out[key] = dataclasses.asdict(value)
        else:
            out[key] = str(value)
    return out
