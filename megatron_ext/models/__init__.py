"""Leviathan models on megatron-core: the LLaMA-style backbone and every input-embedding arm."""

from megatron_ext.models.arguments import add_model_arguments, model_config_from_args
from megatron_ext.models.builder import build_model
from megatron_ext.models.config import (
    EMBEDDING_TYPES,
    MODEL_SIZE_PRESETS,
    EmbeddingConfig,
    ModelConfig,
)
from megatron_ext.models.leviathan_model import LeviathanModel
from megatron_ext.models.param_count import ParameterCount, count_parameters

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
