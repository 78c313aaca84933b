"""Parameter arithmetic from the configuration alone (no model is allocated).

`count_parameters` splits a model into input embedding, output head and backbone, the way the
paper compares arms; `resolve_embedding_sizes` picks the widths of the ALBERT and MLP arms so
that their input side costs what LEV's does (within 2% at the paper's scales).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from megatron_ext.config.model import EmbeddingConfig, ModelConfig

logger = logging.getLogger(__name__)

__all__ = [
    "ParameterCount",
    "count_parameters",
    "layer_matmul_parameters",
    "resolve_embedding_sizes",
]

# FLAT-MLP's hidden width when neither it nor the table width is given: LEV's seed width.
_DEFAULT_FLAT_MLP_HIDDEN = 128


@dataclass(frozen=True)
class ParameterCount:
    """Parameters of a whole model (TP size 1), split the way the paper compares arms."""

    input_embedding: int
    output_head: int
    backbone: int

    @property
    def total(self) -> int:
        """Input embedding + output head + backbone."""
        return self.input_embedding + self.output_head + self.backbone


def layer_matmul_parameters(cfg: ModelConfig) -> int:
    """The weights of one decoder layer's GEMMs: QKV, the projection, SwiGLU's fc1 [2F, D] and
    fc2 [D, F]."""
    d, hd = cfg.hidden_size, cfg.kv_channels
    qkv = d * hd * (cfg.num_attention_heads + 2 * cfg.num_query_groups)
    return qkv + cfg.num_attention_heads * hd * d + 3 * d * cfg.ffn_hidden_size


def _seed_mlp(seed_dim: int, hidden: int, d: int) -> int:
    """LayerNorm(seed) -> Linear(seed, H) -> SiLU -> Linear(H, D)."""
    return 2 * seed_dim + seed_dim * hidden + hidden * d


def _input_parameters(cfg: ModelConfig, emb: EmbeddingConfig) -> int:
    v, d = cfg.vocab_size, cfg.hidden_size
    kind = emb.embedding_type
    if kind in ("tied", "untied"):
        return v * d
    if kind == "lev":
        return emb.lev.num_parameters()
    if kind == "albert":
        return v * emb.albert_dim + emb.albert_dim * d
    if kind == "flat-mlp":
        return v * emb.flat_mlp_seed_dim + _seed_mlp(emb.flat_mlp_seed_dim, emb.mlp_hidden, d)
    lev = emb.lev  # factored-mlp: LEV's digit codebooks + an MLP
    return lev.num_codebook_parameters + _seed_mlp(lev.seed_in_dim, emb.mlp_hidden, d)


def resolve_embedding_sizes(cfg: ModelConfig, log: bool = True) -> ModelConfig:
    """Fill the None widths of the albert / flat-mlp / factored-mlp arms to match LEV's count.

    Returns a new ModelConfig; flags that were set are kept as given.
    """
    emb = cfg.embedding
    if emb.embedding_type not in ("albert", "flat-mlp", "factored-mlp"):
        return cfg
    v, d = cfg.vocab_size, cfg.hidden_size
    budget = emb.lev.num_parameters()
    changes: dict[str, int] = {}
    if emb.embedding_type == "albert" and emb.albert_dim is None:
        changes["albert_dim"] = max(1, round(budget / (v + d)))
    elif emb.embedding_type == "flat-mlp":
        seed, hidden = emb.flat_mlp_seed_dim, emb.mlp_hidden
        if seed is None:
            # The table dominates and moves in steps of V parameters: round its width down,
            # then let the MLP's hidden width (finer steps of d+D) take up the remainder.
            guess = hidden or _DEFAULT_FLAT_MLP_HIDDEN
            seed = max(1, int((budget - guess * d) / (v + 2 + guess)))
        if hidden is None:
            hidden = max(1, round((budget - v * seed - 2 * seed) / (seed + d)))
        changes.update(flat_mlp_seed_dim=seed, mlp_hidden=hidden)
    elif emb.embedding_type == "factored-mlp" and emb.mlp_hidden is None:
        lev = emb.lev
        codebooks = lev.num_codebook_parameters
        d_in = lev.seed_in_dim
        changes["mlp_hidden"] = max(1, round((budget - codebooks - 2 * d_in) / (d_in + d)))
    if not changes:
        return cfg
    resolved = cfg.replace(embedding=dataclasses.replace(emb, **changes))
    if log:
        got = _input_parameters(resolved, resolved.embedding)
        logger.info(
            "%s input side sized to match LEV: %s -> %s parameters vs LEV's %s (%+.2f%%)",
            emb.embedding_type,
            ", ".join(f"{k}={val}" for k, val in changes.items()),
            f"{got:,}",
            f"{budget:,}",
            100.0 * (got - budget) / budget,
        )
    return resolved


def count_parameters(cfg: ModelConfig) -> ParameterCount:
    """Input embedding / output head / backbone parameters of the whole model (TP size 1).

    The TIED arm's one table is counted as input embedding; its head adds nothing. The backbone
    is the decoder layers and the final norm (RMSNorm: one weight vector, no biases).
    """
    cfg = resolve_embedding_sizes(cfg, log=False)
    emb, d = cfg.embedding, cfg.hidden_size
    norms = 2 * d + (2 * cfg.kv_channels if cfg.qk_layernorm else 0)
    return ParameterCount(
        input_embedding=_input_parameters(cfg, emb),
        output_head=0 if emb.tied else cfg.vocab_size * d,
        backbone=cfg.num_layers * (layer_matmul_parameters(cfg) + norms) + d,
    )
