"""A lean cached decode step for the local layer spec at TP=1: the same layers, plain torch ops.

`LeanDecoder` runs the local spec's computation on the model's own weights, batch-first, with
its own KV cache ([b, ng, max_s, hn] per layer, keys rotated)::

    decoder = LeanDecoder(model, batch=2, max_sequence_length=64)   # raises if not covered
    logits = decoder(tokens[:, :5])   # prefill: [b, 5] -> next-token logits [b, V]
    logits = decoder(tokens[:, 5:6])  # one decoding step

`lean_decode_unsupported` names what a model has that it does not cover (TP, biases, MoE...).
"""

from __future__ import annotations

from typing import Optional

import megatron_ext.megatron_import  # noqa: F401

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor

from megatron_ext.models.local_modules import (
    CachedSelfAttention,
    SDPACoreAttention,
    SequenceParallelNorm,
    SwiGLUMLP,
    _RopeTables,
    _rotate,
)

__all__ = ["LeanDecoder", "lean_decode_unsupported"]


def _config_unsupported(config) -> Optional[str]:
    checks = (
        (config.tensor_model_parallel_size != 1, "tensor parallelism (TP>1)"),
        (config.sequence_parallel, "sequence parallelism"),
        (config.add_bias_linear or config.add_qkv_bias, "linear biases"),
        (config.qk_layernorm, "qk layernorm"),
        (getattr(config, "multi_latent_attention", False), "multi-latent attention"),
        (getattr(config, "attention_output_gate", False), "gated attention output"),
        (getattr(config, "num_moe_experts", None), "mixture of experts"),
        (config.apply_rope_fusion, "fused RoPE"),
        (config.fp32_residual_connection, "fp32 residual connection"),
        (config.apply_residual_connection_post_layernorm, "residual after the layernorm"),
        (config.use_te_activation_func or config.bias_activation_fusion, "fused activations"),
        (getattr(config, "activation_func_clamp_value", None) is not None, "clamped GLU"),
        (getattr(config, "glu_linear_offset", 0.0) != 0.0, "GLU linear offset"),
        (config.fp16 or config.bf16, "fp16/bf16 mixed precision"),
    )
    for failed, what in checks:
        if failed:
            return what
    return None


def lean_decode_unsupported(model: torch.nn.Module) -> Optional[str]:
    """None when `LeanDecoder` computes exactly what `model`'s forward computes; otherwise what
    the model has that the lean step does not cover (for the caller's log line)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "decoder"):
        return "not a GPT model"
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        return "pipeline stages"
    if getattr(model, "position_embedding_type", None) != "rope":
        return f"position embedding {getattr(model, 'position_embedding_type', None)!r}"
    if getattr(model, "mtp_process", False):
        return "multi-token prediction"
    reason = _config_unsupported(config)
    if reason:
        return reason
    for layer in model.decoder.layers:
        attention = getattr(layer, "self_attention", None)
        if not (
            type(layer) is TransformerLayer
            and isinstance(layer.input_layernorm, SequenceParallelNorm)
            and isinstance(layer.pre_mlp_layernorm, SequenceParallelNorm)
            and type(attention) is CachedSelfAttention
            and type(attention.core_attention) is SDPACoreAttention
            and isinstance(attention.q_layernorm, IdentityOp)
            and isinstance(attention.k_layernorm, IdentityOp)
            and isinstance(layer.cross_attention, IdentityOp)
            and type(layer.mlp) in (MLP, SwiGLUMLP)  # the same function of the same weights
        ):
            return "a layer outside the local spec (Transformer Engine, MoE, custom modules)"
    if not isinstance(model.decoder.final_layernorm, SequenceParallelNorm):
        return "a final norm outside the local spec"
    return None


class LeanDecoder:
    """Cached next-token logits for `batch` rows of up to `max_sequence_length` positions: each
    call feeds the tokens [b, s] after those fed before and returns the logits [b, V] of the next.
    Run it under `torch.no_grad()` (LEV: `lev_eval_tables`) on an unchanging model.
    `transposed_weights`: [in, out] copies of the weights (None: on CPU), made per decoder."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: int,
        max_sequence_length: int,
        *,
        transposed_weights: Optional[bool] = None,
    ):
        reason = lean_decode_unsupported(model)
        if reason is not None:
            raise ValueError(f"the lean decode step does not cover {reason}")
        self.model = model
        config = model.config
        first = model.decoder.layers[0].self_attention
        self.heads = first.num_attention_heads_per_partition
        self.groups = first.num_query_groups_per_partition
        self.head_dim = first.hidden_size_per_attention_head
        self.scale = first.core_attention.softmax_scale
        self.activation = config.activation_func
        self.gated = config.gated_linear_unit
        self.interleaved = config.rotary_interleaved
        weight = model.decoder.layers[0].self_attention.linear_qkv.weight
        dtype, device = weight.dtype, weight.device
        freqs = model.rotary_pos_emb(max_sequence_length)  # [max_s, 1, 1, d]
        mscale = _yarn_get_concentration_factor_from_config(config)
        cos, sin = _RopeTables.get(freqs, dtype, mscale)  # the tables the local spec uses
        self.cos = cos.view(1, max_sequence_length, 1, -1)  # [1, max_s, 1, d]
        self.sin = sin.view(1, max_sequence_length, 1, -1)
        cache_shape = (batch, self.groups, max_sequence_length, self.head_dim)
        self.caches = [  # (keys, values) per layer
            tuple(torch.empty(cache_shape, dtype=dtype, device=device) for _ in range(2))
            for _ in model.decoder.layers
        ]
        self.max_sequence_length = max_sequence_length
        self.offset = 0
        output_weight = (
            model.shared_embedding_or_output_weight()
            if model.share_embeddings_and_output_weights
            else model.output_layer.weight
        )
        self._transposed = (
            device.type == "cpu" if transposed_weights is None else transposed_weights
        )
        # Per layer: the weights of linear_qkv, linear_proj, linear_fc1, linear_fc2.
        self.weights = [
            tuple(
                self._prepare(w)
                for w in (
                    layer.self_attention.linear_qkv.weight,
                    layer.self_attention.linear_proj.weight,
                    layer.mlp.linear_fc1.weight,
                    layer.mlp.linear_fc2.weight,
                )
            )
            for layer in model.decoder.layers
        ]
        self.output_weight = self._prepare(output_weight)

    def _prepare(self, weight: Tensor) -> Tensor:
        """A linear layer's weight [out, in] as `_linear` takes it ([in, out] on CPU)."""
        return weight.detach().t().contiguous() if self._transposed else weight.detach()

    def _linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """x [..., in] @ the `_prepare`d weight -> [..., out] (no bias: refused at init)."""
        return torch.matmul(x, weight) if self._transposed else F.linear(x, weight)

    def _attention(
        self, x: Tensor, qkv_weight: Tensor, proj_weight: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        """x [b, s, h] (normed) -> attention output [b, s, h] before the residual."""
        b, s, _ = x.shape
        start, end = self.offset, self.offset + s
        per_group = self.heads // self.groups
        mixed = self._linear(x, qkv_weight)  # [b, s, ng * (np/ng + 2) * hn]
        mixed = mixed.view(b, s, self.groups, (per_group + 2) * self.head_dim)
        query, key, value = torch.split(
            mixed, [per_group * self.head_dim, self.head_dim, self.head_dim], dim=3
        )
        query = query.reshape(b, s, self.heads, self.head_dim)
        cos, sin = self.cos[:, start:end], self.sin[:, start:end]
        query = _rotate(query, cos, sin, self.interleaved)
        key = _rotate(key, cos, sin, self.interleaved)
        k_cache[:, :, start:end] = key.transpose(1, 2)
        v_cache[:, :, start:end] = value.transpose(1, 2)
        mask, causal = None, False
        if s > 1 and start == 0:
            causal = True
        elif s > 1:
            rows = torch.arange(start, end, device=x.device)[:, None]
            mask = torch.arange(end, device=x.device)[None, :] <= rows  # True: may attend
        context = F.scaled_dot_product_attention(
            query.transpose(1, 2),
            k_cache[:, :, :end],
            v_cache[:, :, :end],
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=self.heads != self.groups,
        )  # [b, np, s, hn]
        context = context.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self._linear(context, proj_weight)

    def _mlp(self, x: Tensor, fc1_weight: Tensor, fc2_weight: Tensor) -> Tensor:
        hidden = self._linear(x, fc1_weight)
        if self.gated:
            gate, linear = torch.chunk(hidden, 2, dim=-1)
            hidden = self.activation(gate) * linear
        else:
            hidden = self.activation(hidden)
        return self._linear(hidden, fc2_weight)

    def __call__(self, tokens: Tensor) -> Tensor:
        """tokens [b, s] after the ones already fed -> next-token logits [b, V]."""
        s = tokens.size(1)
        if self.offset + s > self.max_sequence_length:
            raise ValueError(
                f"{self.offset + s} positions exceed the cache's {self.max_sequence_length}"
            )
        model = self.model
        hidden = model.embedding(input_ids=tokens, position_ids=None).transpose(0, 1)
        for layer, (qkv, proj, fc1, fc2), (k_cache, v_cache) in zip(
            model.decoder.layers, self.weights, self.caches
        ):
            hidden = hidden + self._attention(
                layer.input_layernorm(hidden), qkv, proj, k_cache, v_cache
            )
            hidden = hidden + self._mlp(layer.pre_mlp_layernorm(hidden), fc1, fc2)
        self.offset += s
        last = model.decoder.final_layernorm(hidden[:, -1])  # [b, h]
        logits = self._linear(last, self.output_weight)  # [b, V]
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
