"""CPU-safe twins of the few megatron-core leaves that assume CUDA, chosen by the local layer
spec or by `LeviathanModel` (megatron-core itself is never patched): `SDPACoreAttention`,
`SequenceParallelNorm` (`WrappedTorchNorm` refuses sequence parallelism),
`PortableRotaryEmbedding`, `PortableTransformerBlock` (recompute without the CUDA RNG state),
`SwiGLUMLP` (one pass fewer over [s, b, ffn]) and `CachedSelfAttention` (KV cache on its
weights' device, keys rotated once).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional

import megatron_ext.megatron_import  # noqa: F401

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _rotate_half
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor

from megatron_ext.rng import checkpoint

__all__ = [
    "CachedSelfAttention",
    "SDPACoreAttention",
    "SequenceParallelNorm",
    "SwiGLUMLP",
    "PortableRotaryEmbedding",
    "PortableTransformerBlock",
]


class SDPACoreAttention(MegatronModule):
    """Core attention through `torch.nn.functional.scaled_dot_product_attention`.

    Same constructor and forward contract as megatron's `DotProductAttention`:
    query [sq, b, np, hn], key/value [sk, b, ng, hn] (np and ng per TP partition) ->
    context [sq, b, np * hn]. Grouped-query attention is handled by SDPA's `enable_gqa`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "the local (CPU) attention does not support context parallelism; use "
                "--transformer-impl transformer_engine or --context-parallel-size 1"
            )
        self.attn_mask_type = attn_mask_type
        tp_size = config.tensor_model_parallel_size
        self.num_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.hidden_size_per_partition = self.num_heads_per_partition * config.kv_channels
        scale = softmax_scale if softmax_scale is not None else config.softmax_scale
        self.softmax_scale = scale if scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.recompute = False  # selective recompute on CPU (set by LeviathanModel)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        """SDPA (causal or masked, GQA) over q, k, v [s, b, n, hn] -> context [s, b, n*hn]."""
        args = query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._attend, *args)
        return self._attend(*args)

    def _attend(
        self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
    ) -> Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "packed sequences and attention bias need --transformer-impl transformer_engine"
            )
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        # [s, b, n, hn] -> [b, n, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # Megatron's masks are True where attention is *forbidden*; SDPA's the opposite.
        sdpa_mask = None if attention_mask is None else ~attention_mask.bool()
        is_causal = attention_mask is None and mask_type == AttnMaskType.causal
        dropout_p = self.dropout_p if self.training else 0.0
        # As megatron's DotProductAttention: the heads are split over TP ranks, so their dropout
        # draws from the model-parallel stream (per TP rank), which sequence parallelism has
        # already forked for the whole block.
        forked = dropout_p and not self.config.sequence_parallel
        with get_cuda_rng_tracker().fork() if forked else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=sdpa_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=self.num_heads_per_partition != self.num_query_groups_per_partition,
            )
        # [b, np, sq, hn] -> [sq, b, np * hn]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), self.hidden_size_per_partition)


class SequenceParallelNorm(torch.nn.Module):
    """RMSNorm or LayerNorm (per `config.normalization`) that works under sequence parallelism.

    Built by the layer spec with megatron's norm signature. Input [s(/tp), b, h] -> same shape.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ):
        super().__init__()
        self.normalization = config.normalization
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(
                f"--normalization {self.normalization} is not supported by the local norm; "
                "use RMSNorm or LayerNorm"
            )
        if config.layernorm_zero_centered_gamma:
            raise ValueError("--apply-layernorm-1p needs --transformer-impl transformer_engine")
        self.eps = eps
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else None
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=device)
        )
        self.bias = (
            torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=device))
            if self.normalization == "LayerNorm"
            else None
        )
        for param in self.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: Tensor) -> Tensor:
        """RMSNorm (or LayerNorm) over the last dim of x [s(/tp), b, h]."""
        if self.normalization == "RMSNorm":
            if x.dtype != self.weight.dtype:
                # --bf16/--fp16 on CPU: torch's unfused path for mixed dtypes computes in float32
                # and casts back, as this does (same bits, forward and backward), but warns on
                # every call.
                return F.rms_norm(x.float(), (x.size(-1),), self.weight, self.eps).to(x.dtype)
            return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)
        return F.layer_norm(x, (x.size(-1),), self.weight, self.bias, self.eps)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of x [..., 2f] = [gate | up] -> [..., f]; the backward writes both
    halves of the gradient into one [..., 2f] tensor (autograd's would `cat` them), each with
    the operations autograd runs on `F.silu(gate) * up`, so the values are the same bits."""

    @staticmethod
    def forward(ctx, x):
        gate, up = torch.chunk(x, 2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(x, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad):
        x, activated = ctx.saved_tensors
        gate, up = torch.chunk(x, 2, dim=-1)
        grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
        grad_gate, grad_up = torch.chunk(grad_x, 2, dim=-1)
        torch.mul(grad, activated, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_x


class SwiGLUMLP(MLP):
    """megatron's MLP; its plain SwiGLU (gated silu, no bias, no clamp, no offset, unfused)
    runs through `_SwiGLU`, everything else through megatron's own forward.
    Input [s, b, h] -> (output [s, b, h], bias None)."""

    def _plain_swiglu(self) -> bool:
        c = self.config
        return (
            c.gated_linear_unit
            and self.activation_func is F.silu
            and not c.use_te_activation_func
            and not c.bias_activation_fusion
            and c.activation_func_clamp_value is None
            and not c.glu_linear_offset
            and not c.add_bias_linear
        )

    def forward(self, hidden_states: Tensor, per_token_scale=None, **kwargs):
        """fc1 -> SwiGLU -> fc2 ([s, b, h] -> [s, b, h])."""
        if per_token_scale is not None or not self._plain_swiglu():
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, _ = self.linear_fc1(hidden_states)  # no bias: add_bias_linear is off
        if torch.is_grad_enabled() and intermediate.requires_grad:
            intermediate = _SwiGLU.apply(intermediate)
        else:
            gate, up = torch.chunk(intermediate, 2, dim=-1)
            intermediate = F.silu(gate) * up
        return self.linear_fc2(intermediate)


class PortableRotaryEmbedding(RotaryEmbedding):
    """megatron's RotaryEmbedding, keeping `inv_freq` on CPU when CUDA is not available."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        """Rotary angles [s, 1, 1, dim] on the frequencies' device (CPU without CUDA)."""
        if torch.cuda.is_available():
            return super().get_emb(max_seq_len, offset)
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, dim / 2]
        if self.rotary_interleaved:
            return freqs.repeat_interleave(2, dim=-1)[:, None, None, :]
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


class PortableTransformerBlock(TransformerBlock):
    """megatron's TransformerBlock whose full recomputation (`recompute_method` uniform: chunks
    of `recompute_num_layers` layers; block: the first `recompute_num_layers` layers) runs
    through `rng.checkpoint`, which restores the CPU RNG states for the recomputation."""

    def _checkpointed_forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor,
        context: Tensor,
        context_mask: Tensor,
        rotary_pos_emb: Tensor,
        attention_bias: Tensor,
        packed_seq_params,
        use_inner_quantization_context: bool,
        padding_mask: Optional[Tensor] = None,
    ):
        def forward(start: int, end: int, hidden_states, context):
            for layer in self.layers[start:end]:
                hidden_states, context = layer(
                    hidden_states=hidden_states,
                    attention_mask=attention_mask,
                    context=context,
                    context_mask=context_mask,
                    rotary_pos_emb=rotary_pos_emb,
                    attention_bias=attention_bias,
                    inference_context=None,
                    packed_seq_params=packed_seq_params,
                    padding_mask=padding_mask,
                )
            return hidden_states, context

        count, step = self.num_layers_per_pipeline_rank, self.config.recompute_num_layers
        if self.config.recompute_method == "uniform":
            chunks = [(i, min(i + step, count), True) for i in range(0, count, step)]
        else:  # block
            chunks = [(i, i + 1, i < step) for i in range(count)]
        for start, end, recompute in chunks:
            run = functools.partial(forward, start, end)
            if recompute:
                hidden_states, context = checkpoint(run, hidden_states, context)
            else:
                hidden_states, context = run(hidden_states, context)
        return hidden_states


class _RopeTables:
    """cos and sin of megatron's rotary angles [s, 1, 1, d], computed once per angle tensor
    (megatron computes them twice per layer per forward; `RotaryEmbedding.forward` memoises the
    angles per sequence length, so a few entries keyed by that object serve every forward)."""

    _entries: dict = {}

    @classmethod
    def get(cls, freqs: Tensor, dtype: torch.dtype, mscale: float) -> tuple[Tensor, Tensor]:
        """(cos, sin) [s, 1, 1, d] of `freqs`, as megatron's `_apply_rotary_pos_emb_bshd`
        computes them (`(torch.cos(freqs) * mscale).to(dtype)`)."""
        key = (id(freqs), dtype, mscale, torch.is_inference_mode_enabled())
        entry = cls._entries.get(key)
        if entry is not None and entry[0] is freqs:
            return entry[1], entry[2]
        with torch.no_grad():
            cos = (torch.cos(freqs) * mscale).to(dtype)
            sin = (torch.sin(freqs) * mscale).to(dtype)
        if len(cls._entries) >= 8:
            cls._entries.clear()
        cls._entries[key] = (freqs, cos, sin)  # holds `freqs`, so its id is not reused
        return cos, sin


def _rotate(t: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """megatron's rotary embedding of t [s, b, n, hn] with cos/sin [s, 1, 1, d] (d <= hn; the
    rest of hn passes through), bit for bit. Non-interleaved it takes fewer passes over t:
    megatron's `t * cos + cat(-t2, t1) * sin` is, half by half, `t1 * c1 - t2 * s1` and
    `t2 * c2 + t1 * s2` (IEEE: `a + (-b) * c` equals `a - b * c` exactly)."""
    rot_dim = cos.size(-1)
    rest = t[..., rot_dim:]
    if interleaved:
        rotated = t[..., :rot_dim]
        return torch.cat((rotated * cos + _rotate_half(rotated, True) * sin, rest), dim=-1)
    half = rot_dim // 2
    t1, t2 = t[..., :half], t[..., half:rot_dim]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    return torch.cat((t1 * c1 - t2 * s1, t2 * c2 + t1 * s2, rest), dim=-1)


class CachedSelfAttention(SelfAttention):
    """megatron's SelfAttention with its inference KV cache ([max_s, max_b, ng, hn] per layer)
    on the weights' device, holding keys already rotated: each key is rotated once before it is
    stored (megatron's static path rotates the whole cached prefix at every decoding step), with
    the same numbers. Fused RoPE, MLA, flash decoding and dynamic batching take megatron's path.
    """

    def _rope_here(self, inference_context) -> bool:
        config = self.config
        return not (
            config.apply_rope_fusion
            or config.multi_latent_attention
            or config.flash_decode
            or (inference_context is not None and not inference_context.is_static_batching())
        )

    def _adjust_key_value_for_inference(
        self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs
    ):
        if rotary_pos_emb is None or not self._rope_here(inference_context):
            return super()._adjust_key_value_for_inference(
                inference_context, query, key, value, rotary_pos_emb, *args, **kwargs
            )
        q_pos_emb, k_pos_emb = rotary_pos_emb
        start = 0 if inference_context is None else inference_context.sequence_len_offset
        mscale = _yarn_get_concentration_factor_from_config(self.config)
        interleaved = self.config.rotary_interleaved
        if q_pos_emb is not None:
            cos, sin = _RopeTables.get(q_pos_emb, query.dtype, mscale)
            end = start + query.size(0)
            query = _rotate(query, cos[start:end], sin[start:end], interleaved)
        if k_pos_emb is not None:
            cos, sin = _RopeTables.get(k_pos_emb, key.dtype, mscale)
            end = start + key.size(0)
            key = _rotate(key, cos[start:end], sin[start:end], interleaved)
        # The cache (if any) now stores rotated keys, and nothing is left for the caller to rotate.
        return super()._adjust_key_value_for_inference(
            inference_context, query, key, value, None, *args, **kwargs
        )

    def _allocate_memory(self, inference_max_sequence_length, batch_size, dim, dtype):
        return torch.empty(
            inference_max_sequence_length,
            batch_size,
            self.num_query_groups_per_partition,
            dim,
            dtype=dtype,
            device=self.linear_qkv.weight.device,
        )
