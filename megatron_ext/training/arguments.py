"""The command line of `pretrain_leviathan.py` (Megatron-LM's names and meanings): the parser
generated from the config tree, and the frozen `TrainingConfig` it fills, built once.

Every flag is declared on the field of the config that owns it (`config_flags.flag`; the
training configs, `ModelConfig`/`EmbeddingConfig`, `DataConfig`, `LEVConfig`) or answered by a
`megatron_compat` rule. `parse_config` parses, optionally restores the model-shaping flags from
a checkpoint's args.json (`--use-checkpoint-args`: the fields marked `shapes_model`), applies
Megatron-LM's flag-level rewrites and builds the `TrainingConfig` (derived values from
`BatchConfig.from_run_length`, `OptimizerConfig.from_schedule`, `ParallelConfig.resolve`). A
config's one-line ValueError becomes `ArgumentError`. The namespace, derived values written
back by field name, is what args.json records; `training_config_from_args` rebuilds the same
config from it (tools reading a checkpoint).
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

from megatron_ext.checkpoint.format import checkpoint_dir, read_latest_iteration
from megatron_ext.config_flags import (
    ArgumentError,
    add_config_arguments,
    config_flag_values,
    flag_dest,
    flag_fields,
)
from megatron_ext.data.loading import DataConfig, add_data_arguments
from megatron_ext.models.arguments import add_model_arguments
from megatron_ext.models.config import EmbeddingConfig, ModelConfig
from megatron_ext.training.config import (
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
    TrainingConfig,
)
from megatron_ext.training.gpu_arguments import validate_gpu_args
from megatron_ext.training.megatron_compat import (
    add_megatron_compat_arguments,
    apply_megatron_compat,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ArgumentError",
    "build_parser",
    "parse_args",
    "parse_config",
    "validate_args",
    "training_config_from_args",
    "args_to_json",
    "checkpoint_args_path",
    "model_shaping_dests",
]

# The configs whose flags (those marked `shapes_model`) --use-checkpoint-args restores.
_MODEL_SHAPING = (ModelConfig, EmbeddingConfig, DataConfig)


def model_shaping_dests() -> list[str]:
    """The namespace names --use-checkpoint-args restores: every flag that shapes the model's
    parameters (`flag(..., shapes_model=True)` on the model, embedding and tokenizer fields),
    and the `--lev-*` flags."""
    return [
        flag_dest(f)
        for cls in _MODEL_SHAPING
        for f in flag_fields(cls)
        if f.metadata.get("shapes_model")
    ]


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
        memory=MemoryConfig,
        engine=EngineConfig,
    )
    built = {name: given.get(name) or _fill(cls, args) for name, cls in parts.items()}
    ckpt = _fill(CheckpointConfig, args, args_json=args_to_json(args))
    return TrainingConfig(**built, ckpt=ckpt, seed=args.seed)


def training_config_from_args(args: argparse.Namespace) -> TrainingConfig:
    """The `TrainingConfig` of a namespace that went through `parse_args` (validated, derived),
    or of a checkpoint's args.json: every field is taken from the flag (or derived value) of
    the same name; `ckpt.args_json` is the whole command line as args.json records it. The
    entry point has it from `parse_config` already; this rebuilds the same config.
    """
    return _configs_from(args)


# --------------------------------------------------------------------------------------------
# Flag groups


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ParallelConfig, "distributed")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, BatchConfig, "training", "batch sizes and run length")
    add_config_arguments(parser, TrainingConfig, "run")  # --seed
    add_config_arguments(parser, PrecisionConfig, "precision")
    add_config_arguments(parser, ExitConfig, "exit conditions and non-finite steps")
    add_config_arguments(parser, EngineConfig, "engine", "the portable engine or megatron-core's")
    add_config_arguments(parser, MemoryConfig, "memory", "manual garbage collection, CUDA cache")


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, OptimizerConfig, "optimizer and learning-rate schedule")


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, CheckpointConfig, "checkpointing")


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, LoggingConfig, "logging")
    add_config_arguments(parser, EvalConfig, "validation")


def build_parser() -> argparse.ArgumentParser:
    """The full parser: distributed, training, optimizer, checkpoint, logging, model, data."""
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
    add_megatron_compat_arguments(parser)  # last: answers every remaining Megatron-LM flag
    return parser


# --------------------------------------------------------------------------------------------
# --use-checkpoint-args


def checkpoint_args_path(load_dir: str, iteration: Optional[int] = None) -> Optional[str]:
    """The args.json of the latest (or `iteration`) checkpoint in `load_dir`, if any."""
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
    names = [n for n in model_shaping_dests() if n in saved]
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


def _record_config(args: argparse.Namespace, cfg: TrainingConfig) -> None:
    """Write every field of `cfg`'s parts to the namespace (args.json records them): the values
    the configs derive (data-parallel size, iterations, schedule lengths in samples, ...) land
    beside the flags without a hand-kept list of names."""
    for part in fields(cfg):
        value = getattr(cfg, part.name)
        if not dataclasses.is_dataclass(value):
            continue
        for f in fields(value):
            if f.name != "args_json":
                setattr(args, f.name, getattr(value, f.name))


def _build_training_config(args: argparse.Namespace, world_size: int) -> TrainingConfig:
    """The `TrainingConfig` of the flags as typed, Megatron-LM's derivations included."""
    parallel = _fill(ParallelConfig, args).resolve(world_size)
    batch = BatchConfig.from_run_length(
        parallel.data_parallel_size,
        seq_length=args.seq_length,
        **config_flag_values(BatchConfig, args),
    )
    optim = OptimizerConfig.from_schedule(
        global_batch_size=batch.global_batch_size,
        train_iters=args.train_iters,
        train_samples=args.train_samples,
        **config_flag_values(OptimizerConfig, args),
    )
    return _configs_from(args, batch=batch, parallel=parallel, optim=optim)


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Apply the flag-level conveniences, build the configs (which check themselves) and write
    what they derive back to the namespace for args.json (in place).

    Raises:
        ArgumentError: the one-line message of the config that refused a value.
    """
    _validate(args, world_size)
    return args


def _validate(args: argparse.Namespace, world_size: int) -> TrainingConfig:
    """`validate_args`, returning the `TrainingConfig` it built (args.json: the final flags)."""
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
        cfg = dataclasses.replace(cfg, parallel=cfg.parallel.with_num_layers(args.num_layers))
    except ValueError as error:
        raise ArgumentError(str(error)) from None
    _record_config(args, cfg)
    if args.exit_signal_handler and not args.save:
        logger.warning("--exit-signal-handler without --save: SIGTERM exits without a checkpoint")
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
    ckpt = dataclasses.replace(cfg.ckpt, args_json=args_to_json(args))
    return dataclasses.replace(cfg, ckpt=ckpt)


def parse_config(
    argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None
) -> tuple[argparse.Namespace, TrainingConfig]:
    """Parse and validate `argv` (default sys.argv) for `world_size` ranks (default torchrun's
    WORLD_SIZE, else 1): the namespace (what args.json records) and the frozen `TrainingConfig`
    built from it once, its derived values included.

    Raises:
        ArgumentError: a refused flag or combination (one line naming the flag).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.use_checkpoint_args:
        _apply_checkpoint_args(args, _explicit_dests(parser, argv))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    apply_megatron_compat(args, error=ArgumentError)
    return args, _validate(args, world_size)


def parse_args(
    argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None
) -> argparse.Namespace:
    """`parse_config`'s namespace alone (tools and tests that read flags)."""
    return parse_config(argv, world_size)[0]


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
