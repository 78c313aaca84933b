"""Build a Leviathan model or any baseline arm from a `ModelConfig`.

    tied          VocabParallelEmbedding shared with the output head (Megatron's mechanism)
    untied        VocabParallelEmbedding + separate ColumnParallelLinear head
    albert        V x m table -> m x D projection          + untied head
    flat-mlp      V x d table -> LayerNorm -> MLP -> D      + untied head
    factored-mlp  LEV digit codebooks -> LayerNorm -> MLP   + untied head
    lev           LEV generator                             + untied head

`build_model(model_cfg, parallel=..., precision=...)` applies the layout after the model is
described (torchtitan's `parallelize_llama(model, parallel_dims, ...)`): megatron's
`TransformerConfig` is composed from the three (`models.layout.compose_transformer_config`).
Under pipeline parallelism the input module lives on the first stage, the head on the last.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

from megatron_ext.lev.layer import LEVEmbedding
from megatron_ext.models.config import ModelConfig
from megatron_ext.models.embeddings import DigitSeedEmbedding, LookupSeedEmbedding
from megatron_ext.models.layout import ParallelConfig, PrecisionConfig, compose_transformer_config
from megatron_ext.models.leviathan_model import LeviathanModel
from megatron_ext.models.param_count import resolve_embedding_sizes

if TYPE_CHECKING:
    from megatron_ext.parallel import ProcessGroups

__all__ = ["build_model", "input_embedding_builder"]


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
    `parallel` and `precision`.

    `parallel` (required, as `precision`: the caller says which layout it builds): the run's
    `ParallelConfig` (its TP, PP, CP sizes and sequence parallelism); None: one rank.
    `precision`: the run's `PrecisionConfig` (its `params_dtype`, FP8 recipe); None: float32.
    A layout the model cannot take raises ValueError naming the flag
    (`models.layout.check_layout`).
    `pg`: the process groups the model communicates over (`LeviathanModel`); None keeps
    megatron's default for its own layers (its `parallel_state` groups).
    `vp_stage`/`vp_size`: build model chunk `vp_stage` of `vp_size` on this pipeline rank.
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
