"""Mixed precision of the portable training path: parameters, gradients and optimizer states
stay float32; --bf16 / --fp16 run forward and backward under `torch.autocast`, and --fp8-format
adds Transformer Engine's `fp8_autocast` around the forward on CUDA. Every input arm hands
layer 0 fp32 [s, b, h]; the residual stream is bf16 from layer 0's first add (Megatron-LM's
--bf16 without --fp32-residual-connection). Pipeline stages exchange fp32 activations, which
hold both exactly, so a pipelined run computes what a single-stage run does.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch

from megatron_ext.config.layout import PrecisionConfig

__all__ = ["autocast_factory"]


def _fp8_context(fmt: str, recipe_kwargs: dict) -> Callable[[], ContextManager]:
    try:
        # optional: the [gpu] extra
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling, Format
    except ImportError as error:  # pragma: no cover - GPU only
        raise RuntimeError(
            "--fp8-format needs Transformer Engine (pip install 'megatron-ext-leviathan[gpu]')"
        ) from error
    recipe = DelayedScaling(
        fp8_format=Format.HYBRID if fmt == "hybrid" else Format.E4M3, **recipe_kwargs
    )
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe)  # pragma: no cover


def autocast_factory(cfg: PrecisionConfig) -> Callable[[], ContextManager]:
    """A zero-argument callable returning the forward's precision context."""
    if not (cfg.bf16 or cfg.fp16):
        return contextlib.nullcontext
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if cfg.bf16 else torch.float16
    fp8 = _fp8_context(cfg.fp8_format, cfg.fp8_recipe()) if cfg.fp8_format else None

    @contextlib.contextmanager
    def context():
        with torch.autocast(device_type=device, dtype=dtype):
            if fp8 is None:
                yield
            else:  # pragma: no cover - GPU only
                with fp8():
                    yield

    return context
