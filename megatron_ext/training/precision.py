"""Mixed precision of the portable training path.

DECISION: parameters, gradients and optimizer states stay float32 on CPU and GPU alike;
--bf16 / --fp16 run forward and backward under `torch.autocast` (matmuls in the low precision,
reductions and norms in float32), and --fp8-format adds Transformer Engine's `fp8_autocast`
(DelayedScaling, HYBRID = E4M3 forward / E5M2 backward) around the forward on CUDA. This keeps
one code path for CPU and GPU, needs no separate master copy (the fp32 weights are the master),
and reduces gradients in fp32 across data-parallel ranks. The model is therefore built at a
float32 (`PrecisionConfig.params_dtype`; `config.run.RunConfig` keeps it so).

Where the low precision starts, the same for every embedding arm: the input module runs in fp32
(a lookup table is not autocast; LEV and the ALBERT / MLP seed networks disable autocast), so
every arm sums its partial embeddings across TP in fp32 and hands layer 0 fp32 [s, b, h].
Inside the decoder, megatron's bias-dropout-add casts the residual to the dtype of the
sublayer output (bf16 under autocast), so the residual stream is bf16 from layer 0's first
residual add on, as in Megatron-LM's --bf16 without --fp32-residual-connection. Norms and the
loss are computed in fp32 (autocast's policy). Pipeline stages exchange fp32 activations
(`pipeline_dtype`): a bf16 hidden state converts to fp32 exactly, so a pipelined run computes
what a single-stage run does.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch

from megatron_ext.config.layout import PrecisionConfig

__all__ = ["autocast_factory", "pipeline_dtype"]


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


def pipeline_dtype(cfg: PrecisionConfig) -> torch.dtype:
    """dtype of activations sent between pipeline stages: float32, which holds the fp32
    embeddings and the bf16/fp16 residual stream exactly (see the module docstring)."""
    return torch.float32
