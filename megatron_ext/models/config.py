"""Model configuration: the LLaMA-style backbone plus its parallel layout and precision.

`ModelConfig` validates itself (impossible layouts fail at construction with a message naming
the flag to change) and derives megatron's `TransformerConfig` through `transformer_config()`.
It holds the frozen `LEVConfig` of the run (`cfg.embedding.lev`, at the model's V and D), which
the builder hands to `LEVEmbedding` as is. The command line only fills it
(`megatron_ext.models.arguments.model_config_from_args`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from megatron_ext.lev.config import LEVConfig

__all__ = [
    "EMBEDDING_TYPES",
    "MODEL_SIZE_PRESETS",
    "TRANSFORMER_IMPLS",
    "EmbeddingConfig",
    "ModelConfig",
    "check_half_precision",
    "llama_ffn_hidden_size",
]

EMBEDDING_TYPES = ("tied", "untied", "albert", "flat-mlp", "factored-mlp", "lev")
_LEV_SIZED_TYPES = ("albert", "flat-mlp", "factored-mlp", "lev")
TRANSFORMER_IMPLS = ("local", "transformer_engine")

# LLaMA-style shapes whose TIED parameter count lands near the paper's scales at V ~ 200k
# (o200k: 200,019 ids, padded to 200,064). D=1024 at 400M and D=2048 at 1.2B follow from the
# paper's arithmetic (UNTIED ~611M at 400M); `tools/count_params.py` prints the totals.
MODEL_SIZE_PRESETS: dict[str, dict[str, int]] = {
    "200m": dict(num_layers=7, hidden_size=768, num_attention_heads=12, ffn_hidden_size=2048),
    "400m": dict(num_layers=16, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=2816),
    "1.2b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632),
}


def llama_ffn_hidden_size(hidden_size: int, multiple_of: int = 256) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4D (same FLOPs as a 4D GELU MLP), rounded up."""
    ffn = int(2 * 4 * hidden_size / 3)
    return multiple_of * ((ffn + multiple_of - 1) // multiple_of)


def check_half_precision(bf16: bool, fp16: bool) -> None:
    """Refuse --bf16 with --fp16 (the model's parameter dtype, and the training autocast in
    `training.config.PrecisionConfig`, take one of them)."""
    if bf16 and fp16:
        raise ValueError("--bf16 and --fp16 are exclusive; pick one")


@dataclass
class EmbeddingConfig:
    """Which input embedding the model uses, and the sizes of the non-LEV arms.

    Sizes left None are chosen so that the arm's input-side parameter count matches LEV's
    (see `megatron_ext.models.param_count.resolve_embedding_sizes`).
    """

    embedding_type: str = "lev"
    """tied | untied | albert | flat-mlp | factored-mlp | lev."""
    lev: Union[LEVConfig, dict[str, Any], None] = None
    """The LEV hyper-parameters of the arms that use them: the LEV generator, factored-mlp's
    digit codebooks, and the parameter count the albert / flat-mlp / factored-mlp widths match.
    Inside a `ModelConfig` a `LEVConfig` at the model's V and D for those arms and None for
    tied / untied (see `at_model_size`); given as None (the defaults) or as a dict of LEVConfig
    fields (vocab_size/hidden_size may be left out), it is built there."""
    albert_dim: Optional[int] = None
    """ALBERT's factorisation width m (V x m table, m x D projection)."""
    flat_mlp_seed_dim: Optional[int] = None
    """FLAT-MLP's lookup width d (V x d table)."""
    mlp_hidden: Optional[int] = None
    """Hidden width of the FLAT-MLP / FACTORED-MLP networks."""

    def __post_init__(self) -> None:
        if self.embedding_type not in EMBEDDING_TYPES:
            raise ValueError(
                f"--embedding-type must be one of {', '.join(EMBEDDING_TYPES)}, "
                f"got {self.embedding_type!r}"
            )
        for flag, value in (
            ("--albert-dim", self.albert_dim),
            ("--flat-mlp-seed-dim", self.flat_mlp_seed_dim),
            ("--embedding-mlp-hidden", self.mlp_hidden),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")

    @property
    def tied(self) -> bool:
        """Whether the input table is shared with the output head (the TIED arm)."""
        return self.embedding_type == "tied"

    @property
    def uses_lev(self) -> bool:
        """Whether the arm is built or sized from LEV's hyper-parameters (all but tied/untied)."""
        return self.embedding_type in _LEV_SIZED_TYPES

    def at_model_size(self, vocab_size: int, hidden_size: int) -> "EmbeddingConfig":
        """This config with `lev` a `LEVConfig` of vocabulary `vocab_size` and width
        `hidden_size` if the arm uses LEV, else None (self when it is so already).

        Raises:
            ValueError: a LEV hyper-parameter is impossible (naming its flag), or `lev` was
                built for another V or D.
        """
        lev = self.lev
        if not self.uses_lev:
            lev = None
        elif not isinstance(lev, LEVConfig):
            lev = LEVConfig(**{"vocab_size": vocab_size, "hidden_size": hidden_size, **(lev or {})})
        if lev is not None and (lev.vocab_size, lev.hidden_size) != (vocab_size, hidden_size):
            raise ValueError(
                f"the LEVConfig is for V={lev.vocab_size}, D={lev.hidden_size} but the model has "
                f"--vocab-size {vocab_size} and --hidden-size {hidden_size}; build it with the "
                "model's sizes (ModelConfig.replace carries new sizes over to it)"
            )
        return self if lev is self.lev else dataclasses.replace(self, lev=lev)


@dataclass
class ModelConfig:
    """A decoder-only LLaMA-style model: RMSNorm, SwiGLU, rotary positions, no biases."""

    vocab_size: int
    """Size of the (padded) vocabulary the model embeds and scores."""
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    """Grouped-query attention: number of key/value heads (None: one per query head)."""
    ffn_hidden_size: Optional[int] = None
    """SwiGLU inner width (None: LLaMA's 8/3 x hidden rounded up to a multiple of 256)."""
    seq_length: int = 128
    """Tokens per sequence the model is built for (rotary positions need no table, so the
    default only serves models built in code; `models.arguments.model_config_from_args` passes
    the run's --seq-length, the one value `BatchConfig` and `DataConfig` also receive)."""
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotary positions rotate (--rotary-percent)."""
    head_dim: Optional[int] = None
    """Channels per attention head (--kv-channels); None: hidden_size / num_attention_heads."""
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    qk_layernorm: bool = False
    transformer_impl: str = "local"
    """'local' (megatron-core modules + CPU twins) or 'transformer_engine'."""
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False

    params_dtype: torch.dtype = torch.float32
    bf16: bool = False
    fp16: bool = False
    fp8: Optional[str] = None
    """FP8 recipe format ('hybrid' or 'e4m3'), Transformer Engine only."""
    use_cpu_initialization: bool = True
    """Build weights on CPU from one seeded stream, so that any TP size gets the same model."""
    perform_initialization: bool = True
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    extra_transformer_config: dict = field(default_factory=dict)
    """Further TransformerConfig fields, passed through unchanged (Megatron-style overrides)."""

    def __post_init__(self) -> None:
        if isinstance(self.embedding, dict):
            self.embedding = EmbeddingConfig(**self.embedding)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = llama_ffn_hidden_size(self.hidden_size)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with the flag to change for every impossible setting; build the
        LEVConfig at the model's V and D (`EmbeddingConfig.at_model_size`), which checks the
        LEV hyper-parameters, and check its heads against the tensor-parallel size here, the
        one place that knows the layout."""
        positive = {
            "--vocab-size": self.vocab_size,
            "--num-layers": self.num_layers,
            "--hidden-size": self.hidden_size,
            "--num-attention-heads": self.num_attention_heads,
            "--num-query-groups": self.num_query_groups,
            "--ffn-hidden-size": self.ffn_hidden_size,
            "--seq-length": self.seq_length,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        self.embedding = self.embedding.at_model_size(self.vocab_size, self.hidden_size)
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"--kv-channels must be >= 1, got {self.head_dim}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if int(self.kv_channels * self.rotary_percent) % 2:
            raise ValueError(
                f"--rotary-percent {self.rotary_percent} x --kv-channels {self.kv_channels} "
                "must give an even number of rotary channels"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--num-query-groups {self.num_query_groups}"
            )
        if self.num_attention_heads % tp:
            raise ValueError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}; change one of them"
            )
        if self.num_query_groups % tp:
            raise ValueError(
                f"--num-query-groups {self.num_query_groups} is not divisible by "
                f"--tensor-model-parallel-size {tp}; change one of them"
            )
        if self.ffn_hidden_size % tp:
            raise ValueError(
                f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by "
                f"--tensor-model-parallel-size {tp}"
            )
        if self.num_layers % pp:
            raise ValueError(
                f"--num-layers {self.num_layers} is not divisible by "
                f"--pipeline-model-parallel-size {pp}; change one of them"
            )
        if self.sequence_parallel and tp == 1:
            raise ValueError(
                "--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the "
                "sequence across tensor-parallel ranks); drop the flag or raise TP"
            )
        if self.sequence_parallel and self.seq_length % tp:
            raise ValueError(
                f"--seq-length {self.seq_length} is not divisible by --tensor-model-parallel-size "
                f"{tp}, which --sequence-parallel needs; change the sequence length"
            )
        if self.embedding.embedding_type == "lev":
            self.embedding.lev.heads_per_rank(tp)  # LEV splits its heads over TP
        check_half_precision(self.bf16, self.fp16)
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(
                "--transformer-impl must be local or transformer_engine, got "
                f"{self.transformer_impl!r}"
            )
        if self.context_parallel_size > 1 and self.transformer_impl != "transformer_engine":
            raise ValueError(
                "--context-parallel-size > 1 needs --transformer-impl transformer_engine "
                "(megatron-core's context-parallel attention is Transformer Engine's)"
            )
        if self.fp8 is not None:
            if self.fp8 not in ("hybrid", "e4m3"):
                raise ValueError(f"--fp8-format must be hybrid or e4m3, got {self.fp8!r}")
            if self.transformer_impl != "transformer_engine":
                raise ValueError(
                    "--fp8-format needs --transformer-impl transformer_engine on a CUDA GPU; "
                    "FP8 is not available on CPU"
                )

    @property
    def kv_channels(self) -> int:
        """Width of one attention head (--kv-channels, default hidden_size / heads)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def replace(self, **changes) -> "ModelConfig":
        """A validated copy with some fields changed.

        A new vocab_size or hidden_size carries over to `embedding.lev` (unless `embedding` is
        changed too). LEV's digit base stays as resolved for the arms whose codebooks it shapes
        (lev, factored-mlp: the weights keep their shape); albert and flat-mlp, which only match
        LEV's parameter count, re-derive it for the new vocabulary.
        """
        lev = self.embedding.lev
        resized = {"vocab_size", "hidden_size"} & changes.keys()
        if resized and "embedding" not in changes and lev is not None:
            keeps_base = self.embedding.embedding_type in ("lev", "factored-mlp")
            lev = dataclasses.replace(
                lev,
                vocab_size=changes.get("vocab_size", self.vocab_size),
                hidden_size=changes.get("hidden_size", self.hidden_size),
                base=lev.base if keeps_base else None,
            )
            changes["embedding"] = dataclasses.replace(self.embedding, lev=lev)
        return dataclasses.replace(self, **changes)

    def transformer_config(self):
        """The megatron-core TransformerConfig of this model."""
        from megatron.core.transformer import TransformerConfig

        params_dtype = self.params_dtype
        if self.bf16:
            params_dtype = torch.bfloat16
        elif self.fp16:
            params_dtype = torch.float16
        kwargs = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            kv_channels=self.kv_channels,
            normalization="RMSNorm",
            layernorm_epsilon=self.norm_epsilon,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            qk_layernorm=self.qk_layernorm,
            hidden_dropout=self.hidden_dropout,
            attention_dropout=self.attention_dropout,
            init_method_std=self.init_method_std,
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            sequence_parallel=self.sequence_parallel,
            params_dtype=params_dtype,
            bf16=self.bf16,
            fp16=self.fp16,
            pipeline_dtype=params_dtype,
            fp8=self.fp8,
            use_cpu_initialization=self.use_cpu_initialization,
            perform_initialization=self.perform_initialization,
            recompute_granularity=self.recompute_granularity,
            recompute_method=self.recompute_method,
            recompute_num_layers=self.recompute_num_layers,
            # Fusions that need apex or CUDA kernels stay off; TE fuses on its own.
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
        )
        kwargs.update(self.extra_transformer_config)
        return TransformerConfig(**kwargs)
