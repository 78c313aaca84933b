"""LEV hyper-parameters: a dataclass that validates itself, and its command-line flags.

Every hyper-parameter of docs/lev.md section 2 is a field of `LEVConfig`; the command line
only fills it (`add_lev_arguments` + `LEVConfig.from_args`), the way Megatron fills a
`TransformerConfig` from args. Invalid combinations fail in `__post_init__` with a message that
names the flag to change.

Shapes of the parameters this config implies (TP size 1, docs/design.md "Fixed contracts")::

    codebooks         [k, b, d_seed]
    seed_proj         [h, d_seed, d_in]      d_in = d_seed (sum) or k*d_seed (concat)
    seed_norm_weight  [h, d_seed]
    seed_norm_bias    [h, d_seed]
    spline_delta      [h, d_seed, kappa, r]
    out_proj          [h, r, D]

With `codebook_combine="concat"` the seed z(i) is the concatenation of the k codebook rows
(width k*d_seed), so each head's seed projection maps k*d_seed -> d_seed: seed_proj is
[h, d_seed, k*d_seed] and still applied as `z @ seed_proj[l].T`. Everything after the seed
projection is unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "LEV_PARAMETER_GROUPS",
    "SPEC_WEIGHT_DECAY_GROUPS",
    "LEVConfig",
    "add_lev_arguments",
    "lev_config_from_args",
    "lev_overrides",
    "smallest_base",
]

_COMBINE_MODES = ("sum", "concat")
_KERNELS = ("auto", "triton", "cpu", "torch")

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


@dataclass
class LEVConfig:
    """Hyper-parameters of one LEV input generator (docs/lev.md section 2).

    The symbols of docs/lev.md are given first. Fields after `normalize_basis` are numerical or
    implementation choices that docs/lev.md fixes (eps values, initialisation) or leaves to us
    (dedup, fused path, eval table); they have flags too so every run is reproducible from its
    command line.
    """

    vocab_size: int
    """V: number of token ids; ids must lie in [0, V)."""

    hidden_size: int
    """D: model width, the size of each generated embedding."""

    num_digits: int = 3
    """k: number of base-b digits of an id (and of codebooks)."""

    base: Optional[int] = None
    """b: digit base. None picks the smallest b with b**k >= V."""

    seed_dim: int = 128
    """d_seed: width of each codebook row and of every head's seed."""

    num_knots: int = 16
    """kappa: uniform knots g_j = j/(kappa-1) of the quadratic B-spline basis (>= 3)."""

    rank: int = 64
    """r: number of separable modes per head."""

    num_heads: int = 8
    """h: number of heads; split across tensor-parallel ranks."""

    temperature: float = 2.0
    """tau: t = sigmoid(LayerNorm(u) / tau)."""

    codebook_combine: str = "sum"
    """How the k codebook rows form the seed: "sum" (width d_seed) or "concat" (k*d_seed)."""

    normalize_basis: bool = True
    """Renormalise the B-spline basis so it sums to 1 at every t (boundary knots lose mass)."""

    norm_eps: float = 1e-5
    """LayerNorm epsilon of the per-head seed normalisation."""

    product_eps: float = 1e-9
    """epsilon in sign * exp(sum log(|phi| + eps)) of the separable product."""

    init_std: float = 0.02
    """Std of codebooks and seed_proj at init; out_proj uses init_std / sqrt(h)."""

    spline_init_std: float = 0.1
    """Std of spline_delta at init (coefficients 1 + delta start near 1)."""

    dedup: bool = True
    """Evaluate LEV once per distinct id of the micro-batch, then gather."""

    fused: bool = True
    """Use the recompute-in-backward autograd Function (lev.fused); False = plain autograd."""

    eval_table: bool = False
    """In eval mode, look ids up in a materialised [V, D] table, rebuilt when parameters change."""

    chunk_size: int = 0
    """Ids per chunk in the fused path; 0 picks one from the sizes (about 8M spline values)."""

    kernel: str = "auto"
    """Fused path implementation: "triton" (`lev.triton_kernel`), "cpu" (`lev.cpu_fused`, a
    compiled C++ kernel), "torch" (`lev.fused`), or "auto": triton for float32 CUDA tensors when
    triton imports, cpu for CPU tensors when a C++ compiler builds it, else torch."""

    init_output_std: Optional[float] = None
    """If set, out_proj is rescaled at init so that the std of all entries of the [V, D]
    embedding table is this value (the other arms start at 0.02). None: the spec's init."""

    weight_decay_groups: tuple[str, ...] = SPEC_WEIGHT_DECAY_GROUPS
    """LEV parameter groups (keys of LEV_PARAMETER_GROUPS) that get weight decay."""

    lr_mult: float = 1.0
    """Learning-rate multiplier of every LEV parameter (peak and minimum lr of the schedule)."""

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise ValueError(f"LEVConfig: {message}")

        if self.vocab_size < 1:
            fail(f"vocab_size must be >= 1, got {self.vocab_size} (check --vocab-size/tokenizer)")
        if self.hidden_size < 1:
            fail(f"hidden_size D must be >= 1, got {self.hidden_size}; change --hidden-size")
        if self.num_digits < 1:
            fail(f"num_digits must be >= 1, got {self.num_digits}; change --lev-num-digits")
        if self.base is None:
            self.base = smallest_base(self.vocab_size, self.num_digits)
        elif self.base < 2:
            fail(f"base must be >= 2, got {self.base}; change --lev-base (or omit it)")
        elif self.base**self.num_digits < self.vocab_size:
            need_b = smallest_base(self.vocab_size, self.num_digits)
            need_k = 1
            while self.base**need_k < self.vocab_size:
                need_k += 1
            fail(
                f"{self.num_digits} digits in base {self.base} cover only "
                f"{self.base}**{self.num_digits}={self.base**self.num_digits} ids, fewer than "
                f"vocab size {self.vocab_size}; raise --lev-base to >= {need_b}, or "
                f"--lev-num-digits to >= {need_k}, or omit --lev-base"
            )
        if self.seed_dim < 1:
            fail(f"seed_dim must be >= 1, got {self.seed_dim}; change --lev-seed-dim")
        if self.num_knots < 3:
            fail(
                f"num_knots (kappa) must be >= 3 for a quadratic B-spline basis, got "
                f"{self.num_knots}; change --lev-num-knots"
            )
        if self.rank < 1:
            fail(f"rank must be >= 1, got {self.rank}; change --lev-rank")
        if self.num_heads < 1:
            fail(f"num_heads must be >= 1, got {self.num_heads}; change --lev-num-heads")
        if not self.temperature > 0:
            fail(f"temperature must be > 0, got {self.temperature}; change --lev-temperature")
        if self.codebook_combine not in _COMBINE_MODES:
            fail(
                f"codebook_combine must be one of {_COMBINE_MODES}, got "
                f"{self.codebook_combine!r}; change --lev-codebook-combine"
            )
        if not self.norm_eps > 0:
            fail(f"norm_eps must be > 0, got {self.norm_eps}; change --lev-norm-eps")
        if not self.product_eps > 0:
            fail(f"product_eps must be > 0, got {self.product_eps}; change --lev-product-eps")
        if self.init_std < 0 or self.spline_init_std < 0:
            fail("init stds must be >= 0; change --lev-init-std / --lev-spline-init-std")
        if self.chunk_size < 0:
            fail(f"chunk_size must be >= 0, got {self.chunk_size}; change --lev-chunk-size")
        if self.kernel not in _KERNELS:
            fail(f"kernel must be one of {_KERNELS}, got {self.kernel!r}; change --lev-kernel")
        if self.kernel in ("triton", "cpu") and not self.fused:
            fail(
                f"--lev-kernel {self.kernel} is a fused path; drop --no-lev-fused or use "
                "--lev-kernel auto"
            )
        if self.init_output_std is not None and not self.init_output_std > 0:
            fail(
                f"init_output_std must be > 0, got {self.init_output_std}; change "
                "--lev-init-output-std (or omit it for the spec's init)"
            )
        self.weight_decay_groups = tuple(self.weight_decay_groups)
        unknown = [g for g in self.weight_decay_groups if g not in LEV_PARAMETER_GROUPS]
        if unknown:
            fail(
                f"unknown weight-decay group(s) {unknown}; --lev-weight-decay-groups takes "
                f"any of {' '.join(LEV_PARAMETER_GROUPS)}"
            )
        if not self.lr_mult > 0:
            fail(f"lr_mult must be > 0, got {self.lr_mult}; change --lev-lr-mult")

    # ----------------------------------------------------------------------------- derived

    @property
    def seed_in_dim(self) -> int:
        """Width of the seed z: d_seed with "sum", k*d_seed with "concat"."""
        k = self.num_digits if self.codebook_combine == "concat" else 1
        return k * self.seed_dim

    def parameter_shapes(self, tp_size: int = 1) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every LEV parameter on one rank of a TP group of `tp_size`."""
        if self.num_heads % tp_size != 0:
            raise ValueError(
                f"--lev-num-heads {self.num_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp_size}: every TP rank must own whole LEV heads; "
                f"change --lev-num-heads to a multiple of {tp_size}"
            )
        h = self.num_heads // tp_size
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
        """Total LEV parameters (TP size 1): the formula of docs/lev.md section 2

        k*b*d_seed + h*(d_in*d_seed + 2*d_seed + d_seed*kappa*r + r*D),

        where d_in = d_seed for "sum" (the d_seed^2 term) and k*d_seed for "concat".
        """
        k, b, d = self.num_digits, self.base, self.seed_dim
        per_head = (
            self.seed_in_dim * d
            + 2 * d
            + d * self.num_knots * self.rank
            + self.rank * self.hidden_size
        )
        return k * b * d + self.num_heads * per_head

    # ----------------------------------------------------------------------------- args

    @classmethod
    def from_args(cls, args: argparse.Namespace, vocab_size: int, hidden_size: int) -> "LEVConfig":
        """Build from parsed flags (see `add_lev_arguments`); V and D come from the model."""
        return lev_config_from_args(args, vocab_size, hidden_size)


# Field name -> (flag, type, help). Dest names are `lev_<field>` except where noted.
_FLAG_FIELDS = {
    "num_digits": ("--lev-num-digits", int, "k: base-b digits per token id"),
    "base": ("--lev-base", int, "b: digit base (default: smallest b with b^k >= V)"),
    "seed_dim": ("--lev-seed-dim", int, "d_seed: codebook row / seed width"),
    "num_knots": ("--lev-num-knots", int, "kappa: B-spline knots (>= 3)"),
    "rank": ("--lev-rank", int, "r: separable modes per head"),
    "num_heads": ("--lev-num-heads", int, "h: heads (divisible by the TP size)"),
    "temperature": ("--lev-temperature", float, "tau in sigmoid(LayerNorm(u) / tau)"),
    "norm_eps": ("--lev-norm-eps", float, "LayerNorm epsilon"),
    "product_eps": ("--lev-product-eps", float, "eps in exp(sum log(|phi| + eps))"),
    "init_std": ("--lev-init-std", float, "init std of codebooks and seed_proj"),
    "spline_init_std": ("--lev-spline-init-std", float, "init std of spline_delta"),
    "chunk_size": ("--lev-chunk-size", int, "ids per chunk of the fused path (0: auto)"),
    "init_output_std": (
        "--lev-init-output-std",
        float,
        "rescale out_proj at init so the [V, D] embedding table has this std (default: the "
        "spec's init, std ~0.2 at small widths; the other arms start at 0.02)",
    ),
    "lr_mult": ("--lev-lr-mult", float, "learning-rate multiplier of the LEV parameters"),
}
_BOOL_FIELDS = {
    "normalize_basis": ("--lev-normalize-basis", "renormalise the B-spline basis to sum 1"),
    "dedup": ("--lev-dedup", "evaluate LEV once per distinct id of the micro-batch"),
    "fused": ("--lev-fused", "recompute-in-backward fused path (saves activation memory)"),
    "eval_table": ("--lev-eval-table", "in eval mode use a materialised V x D table"),
}


def add_lev_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the LEV flag group (`--lev-*`, dests `lev_<field>`) to `parser`; return `parser`."""
    defaults = {f.name: f.default for f in dataclasses.fields(LEVConfig)}
    group = parser.add_argument_group("LEV", "LEV input generator (docs/lev.md section 2)")
    for field, (flag, typ, help_) in _FLAG_FIELDS.items():
        group.add_argument(flag, type=typ, default=defaults[field], dest=f"lev_{field}", help=help_)
    group.add_argument(
        "--lev-codebook-combine",
        choices=_COMBINE_MODES,
        default=defaults["codebook_combine"],
        dest="lev_codebook_combine",
        help="how the k codebook rows form the seed (concat: width k*d_seed)",
    )
    group.add_argument(
        "--lev-kernel",
        choices=_KERNELS,
        default=defaults["kernel"],
        dest="lev_kernel",
        help="fused LEV implementation: triton kernels, the C++ CPU kernel, torch ops, or "
        "auto (triton on CUDA, cpu on CPU)",
    )
    group.add_argument(
        "--lev-weight-decay-groups",
        nargs="*",
        choices=tuple(LEV_PARAMETER_GROUPS),
        default=list(defaults["weight_decay_groups"]),
        dest="lev_weight_decay_groups",
        metavar="GROUP",
        help=f"LEV parameter groups that get weight decay, any of {' '.join(LEV_PARAMETER_GROUPS)}"
        f" (none: no flag values; default: {' '.join(SPEC_WEIGHT_DECAY_GROUPS)})",
    )
    for field, (flag, help_) in _BOOL_FIELDS.items():
        group.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=defaults[field],
            dest=f"lev_{field}",
            help=help_,
        )
    return parser


def lev_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """LEVConfig field -> value of every `lev_<field>` attribute of `args` (V and D excluded)."""
    return {
        field.name: getattr(args, f"lev_{field.name}")
        for field in dataclasses.fields(LEVConfig)
        if field.name not in ("vocab_size", "hidden_size") and hasattr(args, f"lev_{field.name}")
    }


def lev_config_from_args(args: argparse.Namespace, vocab_size: int, hidden_size: int) -> LEVConfig:
    """LEVConfig from the `lev_*` attributes of `args` (absent ones keep their defaults)."""
    return LEVConfig(vocab_size=vocab_size, hidden_size=hidden_size, **lev_overrides(args))
