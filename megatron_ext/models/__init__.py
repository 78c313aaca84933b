"""Leviathan models on megatron-core: the LLaMA-style backbone and every input-embedding arm."""

from megatron_ext._lazy import lazy_exports
from megatron_ext.models.param_count import ParameterCount, count_parameters

# Their modules import megatron-core: loaded on first use (see megatron_ext/_lazy.py).
_LAZY = {
    "LeviathanModel": "megatron_ext.models.leviathan_model",
    "build_model": "megatron_ext.models.builder",
    "compose_transformer_config": "megatron_ext.models.builder",
}

__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "LeviathanModel",
    "ParameterCount",
    "build_model",
    "compose_transformer_config",
    "count_parameters",
]
