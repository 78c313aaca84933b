"""`LEVConfig`: the LEV hyper-parameters of docs/lev.md section 2, each with its `--lev-*` flag,
checked when the config is built (whole heads per TP rank: `heads_per_rank`). Parameter shapes
at TP size 1 (docs/design.md "Fixed contracts")::

    codebooks         [k, b, d_seed]
    seed_proj         [h, d_seed, d_in]      d_in = d_seed (sum) or k*d_seed (concat)
    seed_norm_weight  [h, d_seed]
    seed_norm_bias    [h, d_seed]
    spline_delta      [h, d_seed, kappa, r]
    out_proj          [h, r, D]
"""

from __future__ import annotations

import argparse
import functools
import math
from typing import Optional

from megatron_ext.config.flags import flag, flag_dataclass

__all__ = [
    "LEV_PARAMETER_GROUPS",
    "SPEC_WEIGHT_DECAY_GROUPS",
    "LEVConfig",
    "smallest_base",
]

_COMBINE_MODES = ("sum", "concat")
_KERNELS = ("auto", "reference", "torch", "triton", "cpu")

LEV_PARAMETER_GROUPS: dict[str, tuple[str, ...]] = {
    "codebooks": ("codebooks",),
    "seed_proj": ("seed_proj",),
    "seed_norm": ("seed_norm_weight", "seed_norm_bias"),
    "spline_delta": ("spline_delta",),
    "out_proj": ("out_proj",),
}
"""Optimizer-facing groups of LEV parameters (`--lev-weight-decay-groups`) -> parameter names."""

SPEC_WEIGHT_DECAY_GROUPS = ("codebooks", "seed_proj", "spline_delta", "out_proj")
"""Megatron's rule applied to LEV: every matrix decays, the seed LayerNorm does not."""


lev_flag = functools.partial(flag, prefix="lev-")
"""`config.flags.flag` for LEV's fields: the flag is `--lev-<field-name>`."""


def smallest_base(vocab_size: int, num_digits: int) -> int:
    """The smallest base b >= 2 with b**num_digits >= vocab_size (exact integer arithmetic)."""
    if vocab_size < 1 or num_digits < 1:
        raise ValueError(
            f"need vocab_size >= 1 and num_digits >= 1, got {vocab_size}, {num_digits}"
        )
    base = max(2, int(math.floor(vocab_size ** (1.0 / num_digits))) - 1)
    while base**num_digits < vocab_size:
        base += 1
    return base


@flag_dataclass
class LEVConfig:
    """Hyper-parameters of one LEV input generator: docs/lev.md's symbols first, then the
    numerical and implementation choices (eps values, initialisation, dedup, kernel, eval
    table). Every field but V and D has its `--lev-*` flag."""

    vocab_size: Optional[int] = None
    """V: number of token ids; ids must lie in [0, V). None (with `hidden_size`): the flags
    before the model's size is known; `config.model.EmbeddingConfig.at_model_size` sets both."""
    hidden_size: Optional[int] = None
    """D: model width, the size of each generated embedding."""
    num_digits: int = lev_flag(3, "k: base-b digits per token id (and codebooks)", minimum=1)
    base: Optional[int] = lev_flag(
        None, "b: digit base (default: smallest b with b^k >= V)", minimum=2
    )
    seed_dim: int = lev_flag(128, "d_seed: codebook row / seed width", minimum=1)
    num_knots: int = lev_flag(
        16, "kappa: knots j/(kappa-1) of the quadratic B-spline basis", minimum=3
    )
    rank: int = lev_flag(64, "r: separable modes per head", minimum=1)
    num_heads: int = lev_flag(8, "h: heads (divisible by the TP size)", minimum=1)
    temperature: float = lev_flag(2.0, "tau in sigmoid(LayerNorm(u) / tau)", above=0)
    codebook_combine: str = lev_flag(
        "sum",
        "how the k codebook rows form the seed: sum (width d_seed) or concat (k*d_seed)",
        choices=_COMBINE_MODES,
    )
    normalize_basis: bool = lev_flag(
        True, "renormalise the B-spline basis to sum 1 at every t (boundary knots lose mass)"
    )
    norm_eps: float = lev_flag(1e-5, "epsilon of the per-head seed LayerNorm", above=0)
    product_eps: float = lev_flag(1e-9, "eps in sign * exp(sum log(|phi| + eps))", above=0)
    init_std: float = lev_flag(
        0.02, "init std of codebooks and seed_proj (out_proj: init_std / sqrt(h))", minimum=0
    )
    spline_init_std: float = lev_flag(
        0.1, "init std of spline_delta (coefficients 1 + delta)", minimum=0
    )
    dedup: bool = lev_flag(True, "evaluate LEV once per distinct id of the micro-batch")
    dedup_global_batch: bool = lev_flag(
        True,
        "with --lev-dedup, evaluate LEV once per distinct id of the global batch: a micro-batch "
        "computes only ids no earlier micro-batch had, and LEV's backward runs once, after the "
        "last micro-batch (the portable engine)",
    )
    eval_table: bool = lev_flag(
        False,
        "in eval mode look ids up in a materialised [V, D] table (rebuilt when weights change)",
        action=argparse.BooleanOptionalAction,
    )
    chunk_size: int = lev_flag(
        0, "ids per chunk of the torch kernel (0: auto, ~2M spline values per chunk)", minimum=0
    )
    kernel: str = lev_flag(
        "auto",
        "LEV implementation: the readable math under plain autograd (reference), torch ops, "
        "Triton kernels, the C++ CPU kernel, or auto (triton on CUDA, cpu on CPU)",
        choices=_KERNELS,
    )
    """Steps 3a-3e (`lev.kernels`): `lev.math`, `lev.fused`, `lev.triton_kernel` or
    `cpu_accel.lev_kernel`; auto falls back to torch where triton or cpu cannot run."""
    init_output_std: Optional[float] = lev_flag(
        None,
        "rescale out_proj at init so the [V, D] embedding table has this std (default: the "
        "spec's init, std ~0.2 at small widths; the other arms start at 0.02)",
        above=0,
    )
    weight_decay_groups: tuple[str, ...] = lev_flag(
        SPEC_WEIGHT_DECAY_GROUPS,
        f"LEV parameter groups that get weight decay, any of {' '.join(LEV_PARAMETER_GROUPS)}"
        f" (none: no flag values; default: {' '.join(SPEC_WEIGHT_DECAY_GROUPS)})",
        choices=tuple(LEV_PARAMETER_GROUPS),
        metavar="GROUP",
    )
    lr_mult: float = lev_flag(1.0, "learning-rate multiplier of the LEV parameters", above=0)

    @classmethod
    def derive(cls, values: dict) -> dict:
        """The digit base, when not given: the smallest b with b^k >= V (at a known V)."""
        v, k = values["vocab_size"], values["num_digits"]
        if values["base"] is None and v is not None and v >= 1 and k >= 1:
            values["base"] = smallest_base(v, k)
        return {**values, "weight_decay_groups": tuple(values["weight_decay_groups"])}

    def __post_init__(self) -> None:
        """V and D, and a given digit base that covers V."""
        sized = self.vocab_size is not None
        if sized and self.vocab_size < 1:
            raise ValueError(
                f"LEVConfig: vocab_size must be >= 1, got {self.vocab_size} (check "
                "--vocab-size/tokenizer)"
            )
        if self.hidden_size is not None and self.hidden_size < 1:
            raise ValueError(
                f"LEVConfig: hidden_size D must be >= 1, got {self.hidden_size}; change "
                "--hidden-size"
            )
        if sized and self.base**self.num_digits < self.vocab_size:
            need_b = smallest_base(self.vocab_size, self.num_digits)
            need_k = 1
            while self.base**need_k < self.vocab_size:
                need_k += 1
            raise ValueError(
                f"LEVConfig: {self.num_digits} digits in base {self.base} cover only "
                f"{self.base}**{self.num_digits}={self.base**self.num_digits} ids, fewer than "
                f"vocab size {self.vocab_size}; raise --lev-base to >= {need_b}, or "
                f"--lev-num-digits to >= {need_k}, or omit --lev-base"
            )

    @property
    def seed_in_dim(self) -> int:
        """Width of the seed z: d_seed with "sum", k*d_seed with "concat"."""
        k = self.num_digits if self.codebook_combine == "concat" else 1
        return k * self.seed_dim

    @property
    def num_codebook_parameters(self) -> int:
        """k*b*d_seed: the digit codebooks (replicated on every TP rank; factored-mlp's too)."""
        return self.num_digits * self.base * self.seed_dim

    def projects_by_digit(self, num_ids: float) -> bool:
        """Whether `LEVEmbedding` projects the seeds of `num_ids` distinct ids by digit
        (`lev.kernels._project`): when they outnumber the k*b codebook rows."""
        return num_ids > self.num_digits * self.base

    def heads_per_rank(self, tp_size: int) -> int:
        """h / tp: the heads each rank of a TP group of `tp_size` owns (ValueError: not whole)."""
        if self.num_heads % tp_size != 0:
            raise ValueError(
                f"--lev-num-heads {self.num_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp_size}: every TP rank must own whole LEV heads; "
                f"change --lev-num-heads to a multiple of {tp_size}"
            )
        return self.num_heads // tp_size

    def parameter_shapes(self, tp_size: int = 1) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every LEV parameter on one rank of a TP group of `tp_size`."""
        h = self.heads_per_rank(tp_size)
        d, kappa, r = self.seed_dim, self.num_knots, self.rank
        return {
            "codebooks": (self.num_digits, self.base, d),
            "seed_proj": (h, d, self.seed_in_dim),
            "seed_norm_weight": (h, d),
            "seed_norm_bias": (h, d),
            "spline_delta": (h, d, kappa, r),
            "out_proj": (h, r, self.hidden_size),
        }

    def num_parameters(self) -> int:
        """Total LEV parameters (TP size 1), docs/lev.md section 2:
        k*b*d_seed + h*(d_in*d_seed + 2*d_seed + d_seed*kappa*r + r*D)."""
        d = self.seed_dim
        per_head = (
            self.seed_in_dim * d
            + 2 * d
            + d * self.num_knots * self.rank
            + self.rank * self.hidden_size
        )
        return self.num_codebook_parameters + self.num_heads * per_head
