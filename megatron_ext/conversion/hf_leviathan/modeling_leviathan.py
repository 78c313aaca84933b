"""`LeviathanForCausalLM`: transformers' Llama whose input embedding is LEV.

The backbone, head, attention masks, cache and `generate()` are transformers' `LlamaModel` and
`LlamaForCausalLM`; only `model.embed_tokens` differs: a `LeviathanEmbedding` that computes
each id's row from LEV's parameters (docs/lev.md section 2) with `megatron_ext.lev.math`, the
package's definition of the LEV forward, under plain autograd, so fine-tuning trains LEV's
generator, never a [V, D] table. Parameter names are those of the training checkpoints'
`LEVEmbedding` under `model.embed_tokens.` (codebooks, seed_proj, ...).

This file is copied into every `--hf-format leviathan` export with `lev/math.py` beside it as
lev_math.py (`remote_code.py` rewrites the two package imports below into local ones), so that
`AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)` needs only torch and
transformers.

Shapes: input_ids [B, S] -> distinct ids [U] -> LEV rows [U, D] -> embeddings [B, S, D].
"""

import math

import torch
from torch import nn
from transformers import initialization as init
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from megatron_ext.conversion.hf_leviathan.configuration_leviathan import LeviathanConfig
from megatron_ext.lev.math import check_ids, compute_dtype, lev_embed, lev_modes, seed, to_digits

__all__ = ["LeviathanEmbedding", "LeviathanModel", "LeviathanForCausalLM"]


class LeviathanEmbedding(nn.Module):
    """LEV: token ids -> embeddings, with `nn.Embedding`'s call signature.

    Parameters (`LeviathanConfig.lev_parameter_shapes`): codebooks [k, b, d_seed],
    seed_proj [h, d_seed, d_in], seed_norm_weight / seed_norm_bias [h, d_seed],
    spline_delta [h, d_seed, kappa, r], out_proj [h, r, D].
    """

    def __init__(self, config: LeviathanConfig):
        super().__init__()
        self.config = config
        for name, shape in config.lev_parameter_shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[...] ids in [0, vocab_size) -> [..., D] in the parameters' dtype.

        Each distinct id is computed once, in float32 (float64 parameters: float64) whatever
        the autocast state, as in training.
        """
        c = self.config
        check_ids(input_ids, c.vocab_size)
        unique, inverse = torch.unique(input_ids.reshape(-1), return_inverse=True)
        cdt = compute_dtype(self.codebooks.dtype)
        with torch.autocast(device_type=input_ids.device.type, enabled=False):
            digits = to_digits(unique, c.lev_base, c.lev_num_digits)
            z = seed(self.codebooks.to(cdt), digits, c.lev_codebook_combine)
            modes = lev_modes(
                z,
                self.seed_proj,
                self.seed_norm_weight,
                self.seed_norm_bias,
                self.spline_delta,
                temperature=c.lev_temperature,
                num_knots=c.lev_num_knots,
                normalize_basis=c.lev_normalize_basis,
                norm_eps=c.lev_norm_eps,
                product_eps=c.lev_product_eps,
            )
            rows = lev_embed(modes, self.out_proj)  # [U, D]
        return rows[inverse].reshape(*input_ids.shape, -1).to(self.out_proj.dtype)


class _LeviathanInit:
    """`_init_weights` for the LEV module (docs/lev.md section 2), Llama's for the rest."""

    def _init_weights(self, module):
        if isinstance(module, LeviathanEmbedding):
            c = self.config
            init.normal_(module.codebooks, mean=0.0, std=c.lev_init_std)
            init.normal_(module.seed_proj, mean=0.0, std=c.lev_init_std)
            init.ones_(module.seed_norm_weight)
            init.zeros_(module.seed_norm_bias)
            init.normal_(module.spline_delta, mean=0.0, std=c.lev_spline_init_std)
            std = c.lev_init_std / math.sqrt(c.lev_num_heads)
            init.normal_(module.out_proj, mean=0.0, std=std)
        else:
            super()._init_weights(module)


class LeviathanModel(_LeviathanInit, LlamaModel):
    """`LlamaModel` (its forward) with `embed_tokens` a `LeviathanEmbedding`.

    `__init__` builds the modules itself rather than calling `LlamaModel.__init__`, which would
    allocate a [V, D] table only to drop it (1.6 GB at V = 200k, D = 2048).
    """

    config_class = LeviathanConfig

    def __init__(self, config: LeviathanConfig):
        LlamaPreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = LeviathanEmbedding(config)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class LeviathanForCausalLM(_LeviathanInit, LlamaForCausalLM):
    """`LlamaForCausalLM` over a `LeviathanModel`; the head is never tied (LEV has no table)."""

    config_class = LeviathanConfig
    _tied_weights_keys = {}

    def __init__(self, config: LeviathanConfig):
        LlamaPreTrainedModel.__init__(self, config)
        self.model = LeviathanModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
