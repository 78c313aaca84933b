"""Layout-invariant initial weights under pipeline parallelism: a pipeline stage draws its layers
from another point of the CPU stream (and another seed) than the whole model does, so it copies
them from the whole model built from --seed, by global name. The RNG state is then put back, so
dropout streams keep Megatron's per-stage offsets.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_ext.models.full_state_dict import layout_free_name

__all__ = ["initialize_like_single_stage"]


@torch.no_grad()
def initialize_like_single_stage(
    stage_model: torch.nn.Module, full_model_provider: Callable[[], torch.nn.Module], seed: int
) -> None:
    """Overwrite `stage_model`'s parameters with those of the whole model built from `seed`."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices):
        torch.manual_seed(seed)
        full = dict(full_model_provider().named_parameters())
        for name, param in stage_model.named_parameters():
            key = layout_free_name(stage_model, name)
            source = full.get(key)
            if source is None or source.shape != param.shape:
                raise RuntimeError(
                    f"single-stage twin has no parameter {key} of shape {tuple(param.shape)}"
                )
            param.copy_(source.to(param.device))
