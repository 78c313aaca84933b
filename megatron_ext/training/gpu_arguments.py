"""Megatron-LM's GPU-only flags: FP8 recipe and megatron-core's DDP engine.

All GPU flags of the GPU path are defined here, in `add_gpu_arguments`, and checked in
`validate_gpu_args` (both called from `training.arguments`) where they need CUDA or the engine;
the FP8 recipe's values are checked by `training.config.PrecisionConfig`. A flag that another
module already defined (e.g. the Megatron-LM compatibility layer) is left as it is: every flag
has one definition, whatever the order in which the two were added.

    --ddp-impl portable|megatron                  the training engine (megatron: CUDA only)
    --overlap-grad-reduce, --overlap-param-gather, --ddp-bucket-size
                                                  megatron-core DDP options (--ddp-impl megatron;
                                                  ignored with a logged note by the portable engine)
    --fp8-margin, --fp8-amax-history-len, --fp8-amax-compute-algo
                                                  Transformer Engine's DelayedScaling recipe
    --fp8-param-gather                            FP8 weights all-gathered (distributed optimizer)
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import torch

from megatron_ext.config_flags import ArgumentError

logger = logging.getLogger(__name__)

__all__ = [
    "GPU_FLAGS",
    "add_gpu_arguments",
    "validate_gpu_args",
    "fp8_recipe_kwargs",
    "megatron_engine_model_config",
]

DDP_IMPLS = ("portable", "megatron")

# flag -> add_argument keyword arguments (the dest is argparse's default for the flag).
GPU_FLAGS: dict[str, dict[str, Any]] = {
    "--ddp-impl": dict(
        choices=DDP_IMPLS,
        default="portable",
        help="training engine: portable (CPU and GPU; the default) or megatron (megatron-core's "
        "DistributedDataParallel, distributed optimizer and pipeline schedules; CUDA only)",
    ),
    "--overlap-grad-reduce": dict(
        action="store_true", help="overlap the DP gradient reduce with backward (megatron DDP)"
    ),
    "--overlap-param-gather": dict(
        action="store_true",
        help="overlap the distributed optimizer's parameter all-gather with forward",
    ),
    "--ddp-bucket-size": dict(
        type=int, default=None, help="parameters per DDP bucket (default: megatron-core's)"
    ),
    "--fp8-margin": dict(type=int, default=0, help="FP8 scaling margin (DelayedScaling)"),
    "--fp8-amax-history-len": dict(
        type=int, default=1024, help="amax history length of FP8 delayed scaling"
    ),
    "--fp8-amax-compute-algo": dict(
        choices=("most_recent", "max"), default="max", help="amax from the history"
    ),
    "--fp8-param-gather": dict(
        action="store_true", help="keep FP8 weights and all-gather them in FP8 (megatron engine)"
    ),
}


def add_gpu_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the GPU flags missing from `parser` (see the module docstring); return `parser`."""
    group = parser.add_argument_group("GPU", "Transformer Engine FP8 and megatron-core's engine")
    existing = set(parser._option_string_actions)
    for flag, kwargs in GPU_FLAGS.items():
        if flag not in existing:
            group.add_argument(flag, **kwargs)
    return parser


def _fail(message: str) -> None:
    raise ArgumentError(message)


def validate_gpu_args(args: argparse.Namespace, cuda: bool | None = None) -> argparse.Namespace:
    """Refuse GPU-only flags where they cannot work, with one line naming the flag."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    megatron = getattr(args, "ddp_impl", "portable") == "megatron"
    if megatron and not cuda:
        _fail(
            "--ddp-impl megatron needs CUDA (megatron-core's DDP keeps its buffers on the GPU); "
            "use --ddp-impl portable on CPU"
        )
    for flag in ("--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size"):
        # Megatron-LM launch scripts pass these routinely: the portable engine notes and
        # ignores them (it all-reduces bucketed gradients after backward).
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value not in (None, False) and not megatron:
            where = "on CPU" if not cuda else "by --ddp-impl portable"
            logger.info(
                "%s: ignored %s (it tunes megatron-core's DDP; use --ddp-impl megatron on CUDA)",
                flag,
                where,
            )
    if getattr(args, "fp8_param_gather", False) and not megatron:
        _fail(
            "--fp8-param-gather needs --ddp-impl megatron (the portable engine has no such option)"
        )
    if getattr(args, "fp8_param_gather", False) and getattr(args, "fp8_format", None) is None:
        _fail("--fp8-param-gather needs --fp8-format")
    if megatron and getattr(args, "fp8_param_gather", False):
        _fail("--fp8-param-gather is not supported by --ddp-impl megatron yet; drop it")
    # The values (--fp8-margin without --fp8-format, --overlap-param-gather without the
    # distributed optimizer, the megatron engine with --save/--load or --fp16) are checked by
    # PrecisionConfig and TrainingConfig.
    return args


def megatron_engine_model_config(model_config, args: argparse.Namespace):
    """The ModelConfig for --ddp-impl megatron: BF16 parameters (megatron's mixed precision
    keeps float32 master weights in the optimizer) and the FP8 recipe in TransformerConfig."""
    extra = dict(model_config.extra_transformer_config)
    if getattr(args, "fp8_format", None):
        extra.update(
            fp8_margin=args.fp8_margin,
            fp8_amax_history_len=args.fp8_amax_history_len,
            fp8_amax_compute_algo=args.fp8_amax_compute_algo,
        )
    return model_config.replace(bf16=bool(args.bf16), fp16=False, extra_transformer_config=extra)


def fp8_recipe_kwargs(args: Any) -> dict[str, Any]:
    """DelayedScaling keyword arguments from the flags (or a config with the same fields)."""
    return dict(
        margin=getattr(args, "fp8_margin", 0),
        amax_history_len=getattr(args, "fp8_amax_history_len", 1024),
        amax_compute_algo=getattr(args, "fp8_amax_compute_algo", "max"),
    )
