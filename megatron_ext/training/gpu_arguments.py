"""The checks of the GPU-only flags that need this machine: CUDA for megatron-core's engine,
what each engine supports (`validate_gpu_args`), and the FP8 recipe's keywords.

The flags themselves are fields: the FP8 recipe on `training.config.PrecisionConfig`, the
engine and its DDP options on `training.config.EngineConfig`; their values are checked there.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

import torch

from megatron_ext.config_flags import ArgumentError
from megatron_ext.models.layout import ModelPrecision

if TYPE_CHECKING:
    from megatron_ext.training.config import TrainingConfig

logger = logging.getLogger(__name__)

__all__ = [
    "validate_gpu_args",
    "fp8_recipe_kwargs",
    "megatron_engine_model_precision",
    "engine_model_precision",
]


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
    # distributed optimizer, the megatron engine with --fp16 or with distributed-optimizer
    # state to save/load) are checked by PrecisionConfig and TrainingConfig.
    return args


def megatron_engine_model_precision(precision: Any) -> ModelPrecision:
    """The model precision for --ddp-impl megatron: BF16 parameters with --bf16 (megatron's
    mixed precision keeps float32 master weights in the optimizer) and the FP8 recipe in
    TransformerConfig. `precision`: a `PrecisionConfig` (or a namespace with its fields)."""
    fp8 = getattr(precision, "fp8_format", None)
    recipe = {}
    if fp8:
        recipe = dict(
            fp8_margin=precision.fp8_margin,
            fp8_amax_history_len=precision.fp8_amax_history_len,
            fp8_amax_compute_algo=precision.fp8_amax_compute_algo,
        )
    return ModelPrecision(bf16=bool(precision.bf16), fp16=False, fp8_format=fp8, **recipe)


def engine_model_precision(cfg: "TrainingConfig") -> ModelPrecision:
    """The precision the run's engine builds the model at (the one place the engine shapes
    it): float32 parameters for the portable engine, which runs --bf16/--fp16 as autocast
    (`training.precision`); megatron's for --ddp-impl megatron. --fp8-format reaches the
    model's TransformerConfig either way."""
    if cfg.engine.ddp_impl == "megatron":
        return megatron_engine_model_precision(cfg.precision)
    return ModelPrecision(fp8_format=cfg.precision.fp8_format)


def fp8_recipe_kwargs(args: Any) -> dict[str, Any]:
    """DelayedScaling keyword arguments from the flags (or a config with the same fields)."""
    return dict(
        margin=getattr(args, "fp8_margin", 0),
        amax_history_len=getattr(args, "fp8_amax_history_len", 1024),
        amax_compute_algo=getattr(args, "fp8_amax_compute_algo", "max"),
    )
