"""LEV hyper-parameters: `LEVConfig`, a dataclass that validates itself, with its `--lev-*` flags.

Every hyper-parameter of docs/lev.md section 2 is a field of `LEVConfig` that declares its
flag (`config_flags.flag`, the mechanism of every config): the command line only fills the
config, the way Megatron fills a `TransformerConfig` from args. Invalid combinations fail in
`__post_init__` with a message that names the flag to change; the one check that needs the
parallel layout (whole heads per tensor-parallel rank) is `heads_per_rank`.

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
import math
from dataclasses import dataclass
from typing import Optional

from megatron_ext.config_flags import flag, flag_name

__all__ = ["LEV_PARAMETER_GROUPS", "SPEC_WEIGHT_DECAY_GROUPS", "LEVConfig", "smallest_base"]

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


@dataclass(frozen=True)
class LEVConfig:
    """Hyper-parameters of one LEV input generator (docs/lev.md section 2).

    The symbols of docs/lev.md are given first. Fields after `normalize_basis` are numerical or
    implementation choices that docs/lev.md fixes (eps values, initialisation) or leaves to us
    (dedup, kernel, eval table); they have flags too so every run is reproducible from its
    command line. Every field but V and D declares its `--lev-*` flag. Frozen: the object the
    flags produce is the one `LEVEmbedding` and the kernels read (through `LEVKernelOptions.of`).
    """

    vocab_size: Optional[int] = None
    """V: number of token ids; ids must lie in [0, V). None (with `hidden_size`): the flags
    before the model's size is known; `models.config.EmbeddingConfig.at_model_size` sets both."""

    hidden_size: Optional[int] = None
    """D: model width, the size of each generated embedding."""

    num_digits: int = flag(3, "k: base-b digits per token id", name="--lev-num-digits")
    """k: number of base-b digits of an id (and of codebooks)."""

    base: Optional[int] = flag(
        None, "b: digit base (default: smallest b with b^k >= V)", name="--lev-base"
    )
    """b: digit base. None picks the smallest b with b**k >= V (stored resolved)."""

    seed_dim: int = flag(128, "d_seed: codebook row / seed width", name="--lev-seed-dim")
    """d_seed: width of each codebook row and of every head's seed."""

    num_knots: int = flag(16, "kappa: B-spline knots (>= 3)", name="--lev-num-knots")
    """kappa: uniform knots g_j = j/(kappa-1) of the quadratic B-spline basis (>= 3)."""

    rank: int = flag(64, "r: separable modes per head", name="--lev-rank")
    """r: number of separable modes per head."""

    num_heads: int = flag(8, "h: heads (divisible by the TP size)", name="--lev-num-heads")
    """h: number of heads; split across tensor-parallel ranks."""

    temperature: float = flag(2.0, "tau in sigmoid(LayerNorm(u) / tau)", name="--lev-temperature")
    """tau: t = sigmoid(LayerNorm(u) / tau)."""

    codebook_combine: str = flag(
        "sum",
        "how the k codebook rows form the seed (concat: width k*d_seed)",
        choices=_COMBINE_MODES,
        name="--lev-codebook-combine",
    )
    """How the k codebook rows form the seed: "sum" (width d_seed) or "concat" (k*d_seed)."""

    normalize_basis: bool = flag(
        True, "renormalise the B-spline basis to sum 1", name="--lev-normalize-basis"
    )
    """Renormalise the B-spline basis so it sums to 1 at every t (boundary knots lose mass)."""

    norm_eps: float = flag(1e-5, "LayerNorm epsilon", name="--lev-norm-eps")
    """LayerNorm epsilon of the per-head seed normalisation."""

    product_eps: float = flag(1e-9, "eps in exp(sum log(|phi| + eps))", name="--lev-product-eps")
    """epsilon in sign * exp(sum log(|phi| + eps)) of the separable product."""

    init_std: float = flag(0.02, "init std of codebooks and seed_proj", name="--lev-init-std")
    """Std of codebooks and seed_proj at init; out_proj uses init_std / sqrt(h)."""

    spline_init_std: float = flag(0.1, "init std of spline_delta", name="--lev-spline-init-std")
    """Std of spline_delta at init (coefficients 1 + delta start near 1)."""

    dedup: bool = flag(
        True, "evaluate LEV once per distinct id of the micro-batch", name="--lev-dedup"
    )
    """Evaluate LEV once per distinct id of the micro-batch, then gather."""

    dedup_global_batch: bool = flag(
        True,
        "with --lev-dedup, evaluate LEV once per distinct id of the global batch: a micro-batch "
        "computes only ids no earlier micro-batch had, and LEV's backward runs once, after the "
        "last micro-batch (the portable engine)",
        name="--lev-dedup-global-batch",
    )
    """With `dedup`, under the portable engine: one LEV forward per distinct id of the whole
    global batch and one LEV backward per iteration (`LEVEmbedding.begin_global_batch`)."""

    eval_table: bool = flag(
        False,
        "in eval mode use a materialised V x D table",
        action=argparse.BooleanOptionalAction,
        name="--lev-eval-table",
    )
    """In eval mode, look ids up in a materialised [V, D] table, rebuilt when parameters change."""

    chunk_size: int = flag(
        0, "ids per chunk of the torch kernel (0: auto)", name="--lev-chunk-size"
    )
    """Ids per chunk of the torch kernel (`lev.fused`); 0 picks one from the sizes (about 2M
    spline values per chunk)."""

    kernel: str = flag(
        "auto",
        "LEV implementation: the readable math under plain autograd (reference), torch ops, "
        "Triton kernels, the C++ CPU kernel, or auto (triton on CUDA, cpu on CPU)",
        choices=_KERNELS,
        name="--lev-kernel",
    )
    """Implementation of steps 3a-3e (`lev.kernels`): "reference" (`lev.math` under plain
    autograd, every intermediate saved), "torch" (`lev.fused`), "triton" (`lev.triton_kernel`),
    "cpu" (`cpu_accel.lev_kernel`, a compiled C++ kernel, one of the CPU accelerations), or
    "auto": triton for float32 CUDA tensors when triton imports, cpu for CPU tensors when the
    accelerations are on and a C++ compiler builds it, else torch. All but
    reference save only the seeds and the modes for backward."""

    init_output_std: Optional[float] = flag(
        None,
        "rescale out_proj at init so the [V, D] embedding table has this std (default: the "
        "spec's init, std ~0.2 at small widths; the other arms start at 0.02)",
        name="--lev-init-output-std",
    )
    """If set, out_proj is rescaled at init so that the std of all entries of the [V, D]
    embedding table is this value (the other arms start at 0.02). None: the spec's init."""

    weight_decay_groups: tuple[str, ...] = flag(
        SPEC_WEIGHT_DECAY_GROUPS,
        f"LEV parameter groups that get weight decay, any of {' '.join(LEV_PARAMETER_GROUPS)}"
        f" (none: no flag values; default: {' '.join(SPEC_WEIGHT_DECAY_GROUPS)})",
        choices=tuple(LEV_PARAMETER_GROUPS),
        metavar="GROUP",
        name="--lev-weight-decay-groups",
    )
    """LEV parameter groups (keys of LEV_PARAMETER_GROUPS) that get weight decay."""

    lr_mult: float = flag(
        1.0, "learning-rate multiplier of the LEV parameters", name="--lev-lr-mult"
    )
    """Learning-rate multiplier of every LEV parameter (peak and minimum lr of the schedule)."""

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise ValueError(f"LEVConfig: {message}")

        sized = self.vocab_size is not None
        if sized and self.vocab_size < 1:
            fail(f"vocab_size must be >= 1, got {self.vocab_size} (check --vocab-size/tokenizer)")
        if self.hidden_size is not None and self.hidden_size < 1:
            fail(f"hidden_size D must be >= 1, got {self.hidden_size}; change --hidden-size")
        for name, ok, rule in (
            ("num_digits", self.num_digits >= 1, ">= 1"),
            ("seed_dim", self.seed_dim >= 1, ">= 1"),
            ("rank", self.rank >= 1, ">= 1"),
            ("num_heads", self.num_heads >= 1, ">= 1"),
            ("temperature", self.temperature > 0, "> 0"),
            ("norm_eps", self.norm_eps > 0, "> 0"),
            ("product_eps", self.product_eps > 0, "> 0"),
            ("chunk_size", self.chunk_size >= 0, ">= 0"),
            ("lr_mult", self.lr_mult > 0, "> 0"),
        ):
            if not ok:
                flag_ = flag_name(self.__dataclass_fields__[name])
                fail(f"{name} must be {rule}, got {getattr(self, name)}; change {flag_}")
        if self.base is None:
            if sized:
                object.__setattr__(self, "base", smallest_base(self.vocab_size, self.num_digits))
        elif self.base < 2:
            fail(f"base must be >= 2, got {self.base}; change --lev-base (or omit it)")
        elif sized and self.base**self.num_digits < self.vocab_size:
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
        if self.num_knots < 3:
            fail(
                f"num_knots (kappa) must be >= 3 for a quadratic B-spline basis, got "
                f"{self.num_knots}; change --lev-num-knots"
            )
        if self.codebook_combine not in _COMBINE_MODES:
            fail(
                f"codebook_combine must be one of {_COMBINE_MODES}, got "
                f"{self.codebook_combine!r}; change --lev-codebook-combine"
            )
        if self.init_std < 0 or self.spline_init_std < 0:
            fail("init stds must be >= 0; change --lev-init-std / --lev-spline-init-std")
        if self.kernel not in _KERNELS:
            fail(f"kernel must be one of {_KERNELS}, got {self.kernel!r}; change --lev-kernel")
        if self.init_output_std is not None and not self.init_output_std > 0:
            fail(
                f"init_output_std must be > 0, got {self.init_output_std}; change "
                "--lev-init-output-std (or omit it for the spec's init)"
            )
        object.__setattr__(self, "weight_decay_groups", tuple(self.weight_decay_groups))
        unknown = [g for g in self.weight_decay_groups if g not in LEV_PARAMETER_GROUPS]
        if unknown:
            fail(
                f"unknown weight-decay group(s) {unknown}; --lev-weight-decay-groups takes "
                f"any of {' '.join(LEV_PARAMETER_GROUPS)}"
            )

    # ----------------------------------------------------------------------------- derived

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
        """h / tp: the heads each rank of a tensor-parallel group of `tp_size` owns.

        Raises:
            ValueError: h is not divisible by `tp_size` (every rank must own whole heads).
        """
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
        """Total LEV parameters (TP size 1): the formula of docs/lev.md section 2

        k*b*d_seed + h*(d_in*d_seed + 2*d_seed + d_seed*kappa*r + r*D),

        where d_in = d_seed for "sum" (the d_seed^2 term) and k*d_seed for "concat".
        """
        d = self.seed_dim
        per_head = (
            self.seed_in_dim * d
            + 2 * d
            + d * self.num_knots * self.rank
            + self.rank * self.hidden_size
        )
        return self.num_codebook_parameters + self.num_heads * per_head
