"""The command line of `pretrain_leviathan.py` (Megatron-LM's names and meanings): the parser
generated from the config fields and the `megatron_compat` rules; `parse_config`, argv to one
frozen `RunConfig` (--use-checkpoint-args, Megatron-LM's rewrites and derivations, this
machine's checks); `run_config_from_args_json`, a checkpoint's args.json to the same config.
The namespace does not leave this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
import re
import warnings
from typing import Any, Optional, Sequence

from megatron_ext.config.data import DataConfig, DataError
from megatron_ext.config.flags import (
    ArgumentError,
    ArgumentParser,
    add_flags,
    flag_dest,
    flag_fields,
    flag_values,
)
from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
from megatron_ext.config.lev import LEVConfig
from megatron_ext.config.megatron_compat import (
    _CompatAction,
    add_megatron_compat_arguments,
    apply_megatron_compat,
)
from megatron_ext.config.model import EmbeddingConfig, ModelConfig
from megatron_ext.config.run import (
    BatchConfig,
    CheckpointConfig,
    EngineConfig,
    EvalConfig,
    ExitConfig,
    LoggingConfig,
    MemoryConfig,
    OptimizerConfig,
    RunConfig,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ArgumentError",
    "build_parser",
    "args_json_of_flags",
    "check_machine",
    "data_config_from_args_json",
    "model_config_from_args_json",
    "model_shaping_dests",
    "parse_config",
    "run_config_from_args_json",
]

# (config, argument group title, description): the parser's groups, in --help order.
_GROUPS = (
    (ParallelConfig, "distributed", None),
    (BatchConfig, "training", "batch sizes and run length"),
    (RunConfig, "run", None),
    (PrecisionConfig, "precision", None),
    (ExitConfig, "exit conditions and non-finite steps", None),
    (EngineConfig, "engine", "the portable engine or megatron-core's"),
    (MemoryConfig, "memory", "manual garbage collection, CUDA cache"),
    (OptimizerConfig, "optimizer and learning-rate schedule", None),
    (CheckpointConfig, "checkpointing", None),
    (LoggingConfig, "logging", None),
    (EvalConfig, "validation", None),
    (ModelConfig, "model", "LLaMA-style backbone and input embedding"),
    (EmbeddingConfig, "embedding", "input embedding arm (docs/lev.md section 3)"),
    (LEVConfig, "LEV", "LEV input generator (docs/lev.md section 2)"),
    (DataConfig, "data and tokenizer", None),
)
# The training parts a run takes field by field (batch, optimizer and layout are derived).
_PARTS = dict(
    precision=PrecisionConfig,
    exit=ExitConfig,
    eval=EvalConfig,
    ckpt=CheckpointConfig,
    log=LoggingConfig,
    memory=MemoryConfig,
    engine=EngineConfig,
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser: one argument group per config, then Megatron-LM's other flags."""
    parser = ArgumentParser(
        usage="%(prog)s [options]  (Megatron-LM's flags; launch with torchrun)",
        description="Pretrain Leviathan models and the paper's baselines (Megatron-LM flags)",
        allow_abbrev=False,
    )
    for cls, title, description in _GROUPS:
        group = parser.add_argument_group(title, description)
        add_flags(group, cls)
        if cls is LEVConfig:  # its deprecated alias (old args.json hold it too: `_lev_flag_values`)
            group.add_argument(
                "--lev-fused",
                action=argparse.BooleanOptionalAction,
                help="deprecated: --no-lev-fused is --lev-kernel reference; --lev-fused is the "
                "default",
            )
    add_megatron_compat_arguments(parser)  # last: answers every remaining Megatron-LM flag
    return parser


def model_shaping_dests() -> list[str]:
    """The namespace names --use-checkpoint-args restores besides the --lev-* flags: every flag
    that shapes the model's parameters (`flag(..., shapes_model=True)` on the model, embedding
    and tokenizer fields)."""
    return [
        flag_dest(f)
        for cls in (ModelConfig, EmbeddingConfig, DataConfig)
        for f in flag_fields(cls)
        if f.metadata.get("shapes_model")
    ]


def _checkpoint_args_path(load_dir: str, iteration: Optional[int] = None) -> Optional[str]:
    """The args.json of the latest (or `iteration`) checkpoint in `load_dir`, if any: Megatron-LM's
    layout, `latest_checkpointed_iteration.txt` naming `iter_XXXXXXX/` (`checkpoint.format`'s)."""
    if iteration is None:
        tracker = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
        if not os.path.isfile(tracker):
            return None
        with open(tracker) as handle:
            text = handle.read().strip()
        if not text.isdigit():
            raise ArgumentError(f"{tracker} holds {text!r}, not an iteration number")
        iteration = int(text)
    path = os.path.join(load_dir, f"iter_{iteration:07d}", "args.json")
    return path if os.path.isfile(path) else None


def _explicit_dests(argv: Optional[Sequence[str]]) -> set[str]:
    """The destinations of the flags given on the command line (not left at their default)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return {dest for dest in vars(parser.parse_args(argv)) if not dest.startswith("_")}


def _apply_checkpoint_args(args: argparse.Namespace, explicit: set[str]) -> None:
    """Take the model flags from the checkpoint's args.json, except those given explicitly on
    the command line (Megatron-LM: the command line wins), warning about each such one."""
    if not args.load:
        raise ArgumentError("--use-checkpoint-args needs --load")
    path = _checkpoint_args_path(args.load, args.ckpt_step)
    if path is None:
        raise ArgumentError(f"--use-checkpoint-args: no checkpoint with args.json in {args.load}")
    with open(path) as handle:
        saved = json.load(handle)
    names = [n for n in model_shaping_dests() if n in saved]
    names += [n for n in saved if n.startswith("lev_") and n not in names]
    for name in names:
        if name not in explicit:
            setattr(args, name, saved[name])
        elif getattr(args, name, None) != saved[name]:
            logger.warning(
                "--use-checkpoint-args: --%s %s from the command line overrides the "
                "checkpoint's %s",
                name.replace("_", "-"),
                getattr(args, name),
                saved[name],
            )
    logger.info("model flags taken from %s", path)


def _run_config(values: dict[str, Any], world_size: Optional[int]) -> RunConfig:
    """The `RunConfig` of parsed flags (`world_size` ranks: Megatron-LM's derivations), or of a
    checkpoint's args.json (`world_size` None: the derived values as it recorded them)."""
    if world_size is None:
        parallel = ParallelConfig(**flag_values(ParallelConfig, values, derived=True))
        batch = BatchConfig(**flag_values(BatchConfig, values, derived=True))
        optim = OptimizerConfig(**flag_values(OptimizerConfig, values, derived=True))
    else:
        parallel = ParallelConfig(**flag_values(ParallelConfig, values)).resolve(world_size)
        batch = BatchConfig.from_run_length(
            parallel.data_parallel_size, **flag_values(BatchConfig, values)
        )
        optim = OptimizerConfig.from_schedule(
            global_batch_size=batch.global_batch_size,
            train_iters=values["train_iters"],
            train_samples=values["train_samples"],
            **flag_values(OptimizerConfig, values),
        )
    model = model_config_from_args_json(values)
    lev = None if model.embedding.uses_lev else LEVConfig(**_lev_flag_values(values))
    if world_size is not None:
        model.check_as_given()
    data = data_config_from_args_json(values)
    parts = {name: cls(**flag_values(cls, values, derived=True)) for name, cls in _PARTS.items()}
    return RunConfig(
        batch, optim, model, parallel, lev=lev, data=data, **parts, **flag_values(RunConfig, values)
    )


def _compat_flags(values: dict[str, Any], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The values of the flags no config owns (args.json records them; --lev-fused mapped)."""
    dests = {a.dest for a in parser._actions if isinstance(a, _CompatAction)}
    return {**{d: values[d] for d in dests if d in values}, "lev_fused": None}


_FP8_RECIPE = ("fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo")


def run_config_from_args_json(saved: dict[str, Any]) -> RunConfig:
    """The `RunConfig` a checkpoint's args.json records, at its layout and with the derived
    values it saved; a flag missing from an older args.json keeps its default, and so does the
    FP8 recipe of a run without --fp8-format (where it had no effect). ValueError: a value no
    config accepts (the file was not written by this package)."""
    if saved.get("fp8_format") is None:  # before issue 47 they were 1024 and max
        saved = {k: v for k, v in saved.items() if k not in _FP8_RECIPE}
    compat = _compat_flags(saved, build_parser())
    return dataclasses.replace(_run_config(saved, None), compat_flags=compat)


def data_config_from_args_json(saved: dict[str, Any]) -> DataConfig:
    """The data and tokenizer flags of parsed flags or of a checkpoint's args.json (any
    checkpoint: one that no training run wrote names no data, `DataConfig.check_sources`)."""
    values = flag_values(DataConfig, saved)
    if not values.get("tokenizer_type") and values.get("vocab_file") and values.get("merge_file"):
        logger.info("--vocab-file and --merge-file given: --tokenizer-type GPT2BPETokenizer")
        values["tokenizer_type"] = "GPT2BPETokenizer"  # Megatron-LM's
    return DataConfig(tokenizer_fingerprint=saved.get("tokenizer_fingerprint"), **values)


def model_config_from_args_json(saved: dict[str, Any]) -> ModelConfig:
    """The model of parsed flags or of a checkpoint's args.json (any checkpoint: also one no run
    wrote, `args_json_of_flags`), its vocabulary None (the tokenizer's, or the tensors').
    ValueError: a model no config accepts, naming the flag."""
    lev = LEVConfig(**_lev_flag_values(saved))
    embedding = EmbeddingConfig(**flag_values(EmbeddingConfig, saved), lev=lev)
    return ModelConfig(embedding=embedding, **flag_values(ModelConfig, saved))


_warned_fused = False


def _lev_flag_values(args: dict[str, Any]) -> dict[str, Any]:
    """The --lev-* values of parsed flags or of a checkpoint's args.json, the deprecated
    --lev-fused/--no-lev-fused (`lev_fused`, also in old args.json) mapped onto `kernel`: False is
    "reference" (with "auto"; refused with another kernel), True the default. Either warns once
    per process."""
    global _warned_fused
    values, fused = flag_values(LEVConfig, args), args.get("lev_fused")
    if fused is not None and not _warned_fused:
        _warned_fused = True
        warnings.warn(
            "--lev-fused/--no-lev-fused (lev_fused in args.json) is deprecated: use "
            "--lev-kernel (--no-lev-fused is --lev-kernel reference)",
            FutureWarning,
            stacklevel=3,
        )
    if fused is not None and not fused:
        if values.get("kernel", "auto") not in ("auto", "reference"):
            raise ValueError(
                f"--no-lev-fused (deprecated: --lev-kernel reference) contradicts "
                f"--lev-kernel {values['kernel']}; drop --no-lev-fused"
            )
        values["kernel"] = "reference"
    return values


def args_json_of_flags(argv: Sequence[str]) -> dict[str, Any]:
    """The args.json of flags that describe a model, not a run (tools/convert_checkpoint.py
    import-hf records its model and tokenizer flags so): parsed, every other flag at its
    default, not validated as a run."""
    args = build_parser().parse_args(list(argv))
    values = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(values.items())}


def check_machine(run: RunConfig, cuda: bool) -> None:
    """Refuse (ArgumentError) what this machine cannot run, and note the flags it ignores."""
    if run.parallel.distributed_backend == "nccl" and not cuda:
        raise ArgumentError("--distributed-backend nccl needs CUDA; drop it (gloo is used on CPU)")
    if run.model.transformer_impl == "transformer_engine" and not cuda:
        also = " and --context-parallel-size 1" if run.parallel.context_parallel_size > 1 else ""
        raise ArgumentError(
            f"--transformer-impl transformer_engine needs a CUDA GPU; use local{also}"
        )
    megatron = run.engine.ddp_impl == "megatron"
    if megatron and not cuda:
        raise ArgumentError(
            "--ddp-impl megatron needs CUDA (megatron-core's DDP keeps its buffers on the GPU); "
            "use --ddp-impl portable on CPU"
        )
    if run.log.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ArgumentError(
            "--wandb-project needs the optional package wandb: pip install "
            "'megatron-ext-leviathan[wandb]' (or drop the flag)"
        )
    # Megatron-LM launch scripts pass these routinely: the portable engine notes and ignores
    # them (it all-reduces bucketed gradients after backward).
    for name in ("overlap_grad_reduce", "overlap_param_gather", "ddp_bucket_size"):
        if getattr(run.engine, name) not in (None, False) and not megatron:
            logger.info(
                "--%s: ignored %s (it tunes megatron-core's DDP; use --ddp-impl megatron on CUDA)",
                name.replace("_", "-"),
                "by --ddp-impl portable" if cuda else "on CPU",
            )
    if run.exit.exit_signal_handler and not run.ckpt.save:
        logger.warning("--exit-signal-handler without --save: SIGTERM exits without a checkpoint")
    if run.memory.empty_unused_memory_level and not cuda:
        logger.info("--empty-unused-memory-level: no CUDA caching allocator on CPU, no effect")


def _load_iteration_directory(args: argparse.Namespace) -> None:
    """`--load ckpt/iter_0000030` (one checkpoint, as the tools take it): load that iteration,
    as Megatron-LM's `--load ckpt --ckpt-step 30` (its --load takes the run's directory)."""
    if not args.load:
        return
    path = os.path.normpath(args.load)
    match = re.match(r"^iter_(\d{7,})$", os.path.basename(path))
    if match is None or not os.path.isdir(path):
        return
    iteration, parent = int(match.group(1)), os.path.dirname(path) or "."
    if args.ckpt_step is not None and args.ckpt_step != iteration:
        raise ArgumentError(
            f"--load {args.load} is the checkpoint of iteration {iteration} but --ckpt-step "
            f"asks for {args.ckpt_step}; pass the run's directory: --load {parent} --ckpt-step "
            f"{args.ckpt_step}"
        )
    same = f"--load {parent} --ckpt-step {iteration}"
    logger.info("--load %s: loading iteration %d of %s (as %s)", args.load, iteration, parent, same)
    args.load, args.ckpt_step = parent, iteration


def _rewrite(args: argparse.Namespace) -> None:
    """Megatron-LM's flag-level rewrites, so that its launch scripts run."""
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


def parse_config(
    argv: Optional[Sequence[str]] = None,
    world_size: Optional[int] = None,
    *,
    cuda: Optional[bool] = None,
) -> RunConfig:
    """The `RunConfig` of `argv` (default sys.argv) for `world_size` ranks (default torchrun's
    WORLD_SIZE, else 1) with `cuda` or without (default: this machine's), its model's vocabulary
    None until `with_tokenizer`; sets --logging-level. ArgumentError: a refused flag (one line)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _load_iteration_directory(args)
    if args.use_checkpoint_args:
        _apply_checkpoint_args(args, _explicit_dests(argv))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cuda is None:
        import torch  # deferred: the configs import no torch; only this default asks it

        cuda = torch.cuda.is_available()
    _rewrite(args)
    try:
        run = _run_config(vars(args), world_size)
        apply_megatron_compat(args, cuda, fp8=run.precision.fp8_format is not None)
    except (ValueError, DataError) as error:  # DataConfig's: --data-path and the like
        raise ArgumentError(str(error)) from None
    check_machine(run, cuda)
    if run.log.logging_level is not None:
        logging.getLogger().setLevel(run.log.logging_level)
    return dataclasses.replace(run, compat_flags=_compat_flags(vars(args), parser))
