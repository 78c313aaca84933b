"""Parameter names of the Transformer Engine spec <-> the local spec, so checkpoints cross specs.

megatron-core's TE decoder layer fuses each RMSNorm into the following linear layer
(TELayerNormColumnParallelLinear), so the two norms of a layer are named differently::

    local spec                         Transformer Engine spec
    input_layernorm.weight             self_attention.linear_qkv.layer_norm_weight
    pre_mlp_layernorm.weight           mlp.linear_fc1.layer_norm_weight

Every other parameter has the same name in both (FP8 state is `_extra_state`). The mapping is
megatron-core's own (`sharded_state_dict_keys_map` of its local GPT layer spec). Checkpoints
store the local ("canonical") names (`full_state_dict` passes names through
`canonical_param_name`), so a TE-trained checkpoint loads into the local spec and a local one
into the TE spec, at any layout.
"""

from __future__ import annotations

import functools
import logging

__all__ = [
    "te_to_local_prefixes",
    "canonical_param_name",
    "te_param_name",
]

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def te_to_local_prefixes() -> dict[str, str]:
    """{TE name prefix: local name prefix} inside a decoder layer, from megatron-core."""
    # deferred: keeps megatron.core (slow) out of this module's import
    import megatron_ext.megatron_import  # noqa: F401

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    # e.g. {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}: local -> TE.
    return {te: local for local, te in keys_map.items()}


def _split_layer(name: str) -> tuple[str, str]:
    """("...decoder.layers.N.", rest) for a layer parameter, ("", name) otherwise."""
    marker = "decoder.layers."
    at = name.find(marker)
    if at < 0:
        return "", name
    start = at + len(marker)
    dot = name.find(".", start)
    if dot < 0 or not name[start:dot].isdigit():
        return "", name
    return name[: dot + 1], name[dot + 1 :]


def canonical_param_name(name: str) -> str:
    """The local-spec name of a parameter (TE-spec names mapped; local names unchanged)."""
    head, rest = _split_layer(name)
    if not head:
        return name
    for te_prefix, local_prefix in te_to_local_prefixes().items():
        if rest.startswith(te_prefix):
            return head + local_prefix + rest[len(te_prefix) :]
    return name


def te_param_name(name: str) -> str:
    """The TE-spec name of a local-spec parameter (inverse of `canonical_param_name`)."""
    head, rest = _split_layer(name)
    if not head:
        return name
    for te_prefix, local_prefix in te_to_local_prefixes().items():
        if rest.startswith(local_prefix):
            return head + te_prefix + rest[len(local_prefix) :]
    return name
