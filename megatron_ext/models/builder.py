"""Build a Leviathan model or any baseline arm from a `ModelConfig`.

    tied          VocabParallelEmbedding shared with the output head (Megatron's mechanism)
    untied        VocabParallelEmbedding + separate ColumnParallelLinear head
    albert        V x m table -> m x D projection          + untied head
    flat-mlp      V x d table -> LayerNorm -> MLP -> D      + untied head
    factored-mlp  LEV digit codebooks -> LayerNorm -> MLP   + untied head
    lev           LEV generator                             + untied head

The layout is applied after the model is described: megatron's `TransformerConfig` is composed
from the model, parallel and precision configs (`compose_transformer_config`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import megatron_ext.megatron_import  # noqa: F401

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from megatron_ext.config.layout import ParallelConfig, PrecisionConfig, check_layout
from megatron_ext.config.model import ModelConfig
from megatron_ext.lev.layer import LEVEmbedding
from megatron_ext.models.embeddings import DigitSeedEmbedding, LookupSeedEmbedding
from megatron_ext.models.leviathan_model import LeviathanModel
from megatron_ext.models.param_count import resolve_embedding_sizes

if TYPE_CHECKING:
    from megatron_ext.parallel import ProcessGroups

__all__ = ["build_model", "compose_transformer_config", "input_embedding_builder"]


def compose_transformer_config(
    model_cfg: ModelConfig,
    parallel: Optional[ParallelConfig] = None,
    precision: Optional[PrecisionConfig] = None,
):
    """megatron-core's `TransformerConfig` of `model_cfg` built at `parallel` and `precision`
    (checked by `check_layout` first); `model_cfg.extra_transformer_config` is applied last."""
    parallel, precision = parallel or ParallelConfig(), precision or PrecisionConfig()
    check_layout(model_cfg, parallel, precision)
    dtype = getattr(torch, str(precision.params_dtype).removeprefix("torch."))  # or its name
    fp8 = {}
    if precision.fp8_format is not None:
        fp8 = {f"fp8_{k}": v for k, v in precision.fp8_recipe().items()}
        fp8.update(fp8=precision.fp8_format, fp8_param=precision.fp8_param_gather)
    kwargs = dict(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        kv_channels=model_cfg.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model_cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=model_cfg.qk_layernorm,
        hidden_dropout=model_cfg.hidden_dropout,
        attention_dropout=model_cfg.attention_dropout,
        init_method_std=model_cfg.init_method_std,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=model_cfg.use_cpu_initialization,
        perform_initialization=model_cfg.perform_initialization,
        recompute_granularity=model_cfg.recompute_granularity,
        recompute_method=model_cfg.recompute_method,
        recompute_num_layers=model_cfg.recompute_num_layers,
        # Fusions that need apex or CUDA kernels stay off; TE fuses on its own.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **fp8,
    )
    kwargs.update(model_cfg.extra_transformer_config)
    return TransformerConfig(**kwargs)


def input_embedding_builder(cfg: ModelConfig):
    """The `LeviathanModel.input_embedding_builder` of an arm (None: keep the lookup table)."""
    emb = cfg.embedding
    kind = emb.embedding_type
    if kind in ("tied", "untied"):
        return None
    if kind == "lev":
        return functools.partial(LEVEmbedding, emb.lev)
    if kind == "albert":
        return functools.partial(LookupSeedEmbedding, cfg.vocab_size, emb.albert_dim, None)
    if kind == "flat-mlp":
        return functools.partial(
            LookupSeedEmbedding, cfg.vocab_size, emb.flat_mlp_seed_dim, emb.mlp_hidden
        )
    return functools.partial(DigitSeedEmbedding, emb.lev, emb.mlp_hidden)  # factored-mlp


def build_model(
    cfg: ModelConfig,
    *,
    parallel: Optional[ParallelConfig],
    precision: Optional[PrecisionConfig],
    pre_process: bool = True,
    post_process: bool = True,
    pg: Optional["ProcessGroups"] = None,
    vp_stage: Optional[int] = None,
    vp_size: Optional[int] = None,
) -> LeviathanModel:
    """The model (or this pipeline stage of it) for `cfg.embedding.embedding_type`, built at
    `parallel` (None: one rank) and `precision` (None: float32), both required so that the
    caller says which layout it builds; a layout the model cannot take raises ValueError naming
    the flag (`config.layout.check_layout`). `pg`, `vp_stage`, `vp_size`: as `LeviathanModel`'s.
    """
    cfg = resolve_embedding_sizes(cfg)
    return LeviathanModel(
        cfg,
        compose_transformer_config(cfg, parallel, precision),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=cfg.embedding.tied,
        input_embedding_builder=input_embedding_builder(cfg),
        pg=pg,
        vp_stage=vp_stage,
        vp_size=vp_size,
    )
