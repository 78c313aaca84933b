"""Parameter names of the Transformer Engine spec <-> the local spec, so checkpoints cross specs.

megatron-core's TE decoder layer fuses each RMSNorm into the following linear layer
(TELayerNormColumnParallelLinear), so the two norms of a layer are named differently::

    local spec                         Transformer Engine spec
    input_layernorm.weight             self_attention.linear_qkv.layer_norm_weight
    pre_mlp_layernorm.weight           mlp.linear_fc1.layer_norm_weight

Every other parameter has the same name in both. The mapping is megatron-core's own
(`sharded_state_dict_keys_map` of its local GPT layer spec); checkpoints store the local
("canonical") names, so either spec loads the other's checkpoints at any layout.
"""

from __future__ import annotations

import functools
import re

import megatron_ext.megatron_import  # noqa: F401

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

__all__ = ["LAYER_NAME", "te_to_local_prefixes", "canonical_param_name", "te_param_name"]

# A decoder layer's parameter: (prefix ending in "decoder.layers.", layer index, the rest).
LAYER_NAME = re.compile(r"^((?:.*\.)?decoder\.layers\.)(\d+)\.(.*)$")


@functools.lru_cache(maxsize=1)
def te_to_local_prefixes() -> dict[str, str]:
    """{TE name prefix: local name prefix} inside a decoder layer, from megatron-core."""
    keys_map = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    # e.g. {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}: local -> TE.
    return {te: local for local, te in keys_map.items()}


def _rename(name: str, to_local: bool) -> str:
    match = LAYER_NAME.match(name)
    if match is None:
        return name
    prefix, index, rest = match.groups()
    for te_prefix, local_prefix in te_to_local_prefixes().items():
        old, new = (te_prefix, local_prefix) if to_local else (local_prefix, te_prefix)
        if rest.startswith(old):
            return f"{prefix}{index}.{new}{rest[len(old) :]}"
    return name


def canonical_param_name(name: str) -> str:
    """The local-spec name of a parameter (TE-spec names mapped; local names unchanged)."""
    return _rename(name, to_local=True)


def te_param_name(name: str) -> str:
    """The TE-spec name of a local-spec parameter (inverse of `canonical_param_name`)."""
    return _rename(name, to_local=False)
