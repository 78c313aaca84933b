"""Layer specs of the LLaMA-style decoder layer: one wiring diagram, two backends.

    input_layernorm -> self_attention(linear_qkv -> core_attention -> linear_proj) -> + residual
    pre_mlp_layernorm -> mlp(linear_fc1 [SwiGLU: gate|up] -> linear_fc2)          -> + residual

`--transformer-impl` picks the local spec (megatron-core's parallel linears in their portable
form, with the CPU-safe twins of `local_modules`) or megatron-core's own Transformer Engine spec.
"""

from __future__ import annotations

import megatron_ext.megatron_import  # noqa: F401

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron_ext.config.model import transformer_engine_available
from megatron_ext.models.local_modules import (
    CachedSelfAttention,
    SDPACoreAttention,
    SequenceParallelNorm,
)
from megatron_ext.tensor_parallel import PortableColumnParallelLinear, PortableRowParallelLinear

__all__ = ["get_layer_spec", "get_decoder_block_spec", "transformer_engine_available"]


def get_layer_spec(transformer_impl: str, qk_layernorm: bool = False) -> ModuleSpec:
    """The decoder-layer spec of `--transformer-impl`: local (megatron-core modules that also run
    on CPU) or transformer_engine (megatron-core's own TE spec; needs TE and CUDA)."""
    if transformer_impl == "transformer_engine":
        if not transformer_engine_available():
            raise RuntimeError(
                "--transformer-impl transformer_engine needs Transformer Engine and a CUDA GPU "
                "(pip install 'megatron-ext-leviathan[gpu]' in the NGC container); use "
                "--transformer-impl local on CPU"
            )
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=SequenceParallelNorm,
            self_attention=ModuleSpec(
                module=CachedSelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=PortableColumnParallelLinear,
                    core_attention=SDPACoreAttention,
                    linear_proj=PortableRowParallelLinear,
                    q_layernorm=SequenceParallelNorm if qk_layernorm else IdentityOp,
                    k_layernorm=SequenceParallelNorm if qk_layernorm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=SequenceParallelNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=PortableColumnParallelLinear, linear_fc2=PortableRowParallelLinear
                ),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def get_decoder_block_spec(
    config: TransformerConfig, transformer_impl: str, qk_layernorm: bool = False
) -> ModuleSpec:
    """This pipeline stage's decoder block: its layers plus the final norm.

    A block spec (rather than a bare layer spec) names the final norm, which megatron otherwise
    defaults to a norm that refuses sequence parallelism.
    """
    layer = get_layer_spec(transformer_impl, qk_layernorm)
    if transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm  # optional: TE

        final_norm = TENorm
    else:
        final_norm = SequenceParallelNorm
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(
            layer_specs=[layer] * get_num_layers_to_build(config),
            layer_norm=final_norm,
        ),
    )
