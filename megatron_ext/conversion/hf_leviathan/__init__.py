"""A Hugging Face transformers model that keeps LEV: `LeviathanConfig` (model_type "leviathan")
and `LeviathanForCausalLM` (Llama with a LEV input embedding), registered with `AutoConfig` and
`AutoModelForCausalLM` when this subpackage is imported.

Importing it imports transformers (a few seconds), so nothing imports it at module level but
the `--hf-format leviathan` paths of `tools/convert_checkpoint.py`; `import megatron_ext` does
not. In a process without this package, an export loads through its own copy of the code
(`remote_code.py`) with `trust_remote_code=True`. See docs/convert.md.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from megatron_ext.conversion.hf_leviathan.configuration_leviathan import LeviathanConfig
from megatron_ext.conversion.hf_leviathan.modeling_leviathan import (
    LeviathanEmbedding,
    LeviathanForCausalLM,
    LeviathanModel,
)

__all__ = ["LeviathanConfig", "LeviathanEmbedding", "LeviathanForCausalLM", "LeviathanModel"]

AutoConfig.register(LeviathanConfig.model_type, LeviathanConfig, exist_ok=True)
AutoModelForCausalLM.register(LeviathanConfig, LeviathanForCausalLM, exist_ok=True)
