"""`LeviathanConfig`: Llama's configuration plus the LEV hyper-parameters (model_type "leviathan").

The `lev_*` fields are `megatron_ext.lev.LEVConfig`'s fields of docs/lev.md section 2 under the
same names, prefixed (`lev_num_digits` is `LEVConfig.num_digits`, ...). LEV's V and D are the
model's `vocab_size` and `hidden_size`; `lev_base` is stored (a checkpoint's base was chosen for
its padded vocabulary, which an export trims). The input table is never tied to the head.

This file is copied into every `--hf-format leviathan` export (`remote_code.py`): it imports
only transformers and huggingface_hub.
"""

from typing import Optional

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

__all__ = ["LeviathanConfig"]

_COMBINE_MODES = ("sum", "concat")


@strict
class LeviathanConfig(LlamaConfig):
    """Llama's fields (vocab_size, hidden_size, layers, heads, rope, ...) and LEV's."""

    model_type = "leviathan"

    lev_num_digits: int = 3
    """k: base-b digits per token id (and codebooks)."""
    lev_base: Optional[int] = None
    """b: digit base; None: the smallest b with b**k >= vocab_size."""
    lev_seed_dim: int = 128
    """d_seed: codebook row / seed width."""
    lev_num_knots: int = 16
    """kappa: knots of the quadratic B-spline basis."""
    lev_rank: int = 64
    """r: separable modes per head."""
    lev_num_heads: int = 8
    """h: heads."""
    lev_temperature: float = 2.0
    """tau in sigmoid(LayerNorm(u) / tau)."""
    lev_codebook_combine: str = "sum"
    """How the k codebook rows form the seed: sum (width d_seed) or concat (k*d_seed)."""
    lev_normalize_basis: bool = True
    """Renormalise the B-spline basis to sum 1 at every t."""
    lev_norm_eps: float = 1e-5
    lev_product_eps: float = 1e-9
    lev_init_std: float = 0.02
    """Init std of codebooks and seed_proj (out_proj: lev_init_std / sqrt(h)); fresh models."""
    lev_spline_init_std: float = 0.1
    """Init std of spline_delta (coefficients 1 + delta); fresh models."""

    def __post_init__(self, **kwargs):
        if self.lev_base is None:
            base = 2
            while base**self.lev_num_digits < self.vocab_size:
                base += 1
            self.lev_base = base
        if self.lev_base**self.lev_num_digits < self.vocab_size:
            raise ValueError(
                f"LeviathanConfig: lev_num_digits {self.lev_num_digits} in lev_base "
                f"{self.lev_base} cover {self.lev_base**self.lev_num_digits} ids, fewer than "
                f"vocab_size {self.vocab_size}"
            )
        if self.lev_codebook_combine not in _COMBINE_MODES:
            raise ValueError(
                f"LeviathanConfig: lev_codebook_combine must be one of {_COMBINE_MODES}, got "
                f"{self.lev_codebook_combine!r}"
            )
        self.tie_word_embeddings = False  # LEV has no table to tie the head to
        super().__post_init__(**kwargs)

    @property
    def lev_parameter_shapes(self) -> dict:
        """Name -> shape of LEV's parameters (`LEVConfig.parameter_shapes` at TP=1)."""
        k, b, d = self.lev_num_digits, self.lev_base, self.lev_seed_dim
        h, kappa, r = self.lev_num_heads, self.lev_num_knots, self.lev_rank
        d_in = k * d if self.lev_codebook_combine == "concat" else d
        return {
            "codebooks": (k, b, d),
            "seed_proj": (h, d, d_in),
            "seed_norm_weight": (h, d),
            "seed_norm_bias": (h, d),
            "spline_delta": (h, d, kappa, r),
            "out_proj": (h, r, self.hidden_size),
        }
