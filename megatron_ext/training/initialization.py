"""Layout-invariant initial weights under pipeline parallelism.

With `use_cpu_initialization` any TP size draws the same model, but a pipeline stage constructs
its layers from another point of the CPU stream (and another seed), so a PP=2 run would start
from other weights than PP=1. `initialize_like_single_stage` rebuilds the whole model as one
stage from --seed and copies this stage's parameters from it by global name; the RNG state is
then put back, so dropout streams keep Megatron's per-stage offsets.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from megatron_ext.models.full_state_dict import layout_free_name

logger = logging.getLogger(__name__)

__all__ = ["initialize_like_single_stage"]


@torch.no_grad()
def initialize_like_single_stage(
    stage_model: torch.nn.Module, full_model_provider: Callable[[], torch.nn.Module], seed: int
) -> None:
    """Overwrite `stage_model`'s parameters with those of the whole model built from `seed`."""
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    try:
        torch.manual_seed(seed)
        full_model = full_model_provider()
        full = dict(full_model.named_parameters())
        for name, param in stage_model.named_parameters():
            key = layout_free_name(stage_model, name)
            source = full.get(key)
            if source is None or source.shape != param.shape:
                raise RuntimeError(
                    f"single-stage twin has no parameter {key} of shape {tuple(param.shape)}"
                )
            param.copy_(source.to(param.device))
        del full, full_model
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)
