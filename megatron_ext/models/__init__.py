"""Leviathan models on megatron-core: the LLaMA-style backbone and every input-embedding arm."""

from megatron_ext.models.config import (
    EMBEDDING_TYPES,
    MODEL_SIZE_PRESETS,
    EmbeddingConfig,
    ModelConfig,
)
from megatron_ext.models.param_count import ParameterCount, count_parameters

# These import megatron-core (slow to import): loaded on first use, so that configs and the
# parameter arithmetic (tools/count_params.py) need only torch.
_LAZY = {
    "LeviathanModel": "megatron_ext.models.leviathan_model",
    "build_model": "megatron_ext.models.builder",
    "add_model_arguments": "megatron_ext.models.arguments",
    "model_config_from_args": "megatron_ext.models.arguments",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value

__all__ = [
    "EMBEDDING_TYPES",
    "MODEL_SIZE_PRESETS",
    "EmbeddingConfig",
    "LeviathanModel",
    "ModelConfig",
    "ParameterCount",
    "add_model_arguments",
    "build_model",
    "count_parameters",
    "model_config_from_args",
]
