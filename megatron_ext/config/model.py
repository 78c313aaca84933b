"""`ModelConfig` and `EmbeddingConfig`: the LLaMA-style backbone and its input embedding (with
the `LEVConfig` at the model's V and D), their flags declared on their fields. They describe the
model only: the layout and precision it is built at are `config.layout`'s.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import field
from typing import Any, Optional, Union

from megatron_ext.config.flags import flag, flag_dataclass
from megatron_ext.config.lev import LEVConfig

__all__ = [
    "EMBEDDING_TYPES",
    "MODEL_SIZE_PRESETS",
    "TRANSFORMER_IMPLS",
    "EmbeddingConfig",
    "ModelConfig",
    "llama_ffn_hidden_size",
    "transformer_engine_available",
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

# The debug flavour: sizes neither a preset nor a flag gives (tiny, CPU friendly).
_DEBUG_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


def transformer_engine_available() -> bool:
    """True when Transformer Engine is importable and a CUDA device is present."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    import torch  # deferred: the configs import no torch; only a machine with TE asks it

    return torch.cuda.is_available()


def llama_ffn_hidden_size(hidden_size: int, multiple_of: int = 256) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4D (same FLOPs as a 4D GELU MLP), rounded up."""
    ffn = int(2 * 4 * hidden_size / 3)
    return multiple_of * ((ffn + multiple_of - 1) // multiple_of)


@flag_dataclass
class EmbeddingConfig:
    """Which input embedding the model uses, and the sizes of the non-LEV arms (None: matching
    LEV's input-side parameter count, `models.param_count.resolve_embedding_sizes`)."""

    embedding_type: str = flag(
        "lev", "the input embedding arm", shapes_model=True, choices=EMBEDDING_TYPES
    )
    lev: Union[LEVConfig, dict[str, Any], None] = None
    """The LEV hyper-parameters of the arms that use them: None (the defaults), a LEVConfig or a
    dict of its fields; inside a `ModelConfig` a `LEVConfig` at the model's V and D for those
    arms and None for tied / untied (`at_model_size`)."""
    albert_dim: Optional[int] = flag(
        None,
        "ALBERT's m: V x m table, m x D projection (default: match LEV)",
        shapes_model=True,
        minimum=1,
    )
    flat_mlp_seed_dim: Optional[int] = flag(
        None, "FLAT-MLP's V x d table width d (default: match)", shapes_model=True, minimum=1
    )
    mlp_hidden: Optional[int] = flag(
        None,
        "hidden width of the FLAT-MLP / FACTORED-MLP networks (default: match LEV)",
        shapes_model=True,
        minimum=1,
        name="--embedding-mlp-hidden",
    )
    untie_embeddings_and_output_weights: bool = flag(
        False,
        "Megatron-LM's flag; every arm but 'tied' is untied already, so it only "
        "conflicts with --embedding-type tied",
        shapes_model=True,
    )

    def __post_init__(self) -> None:
        if self.tied and self.untie_embeddings_and_output_weights:
            raise ValueError(
                "--untie-embeddings-and-output-weights contradicts --embedding-type tied; drop one"
            )

    @property
    def tied(self) -> bool:
        """Whether the input table is shared with the output head (the TIED arm)."""
        return self.embedding_type == "tied"

    @property
    def uses_lev(self) -> bool:
        """Whether the arm is built or sized from LEV's hyper-parameters (all but tied/untied)."""
        return self.embedding_type in _LEV_SIZED_TYPES

    def at_model_size(self, vocab_size: Optional[int], hidden_size: int) -> "EmbeddingConfig":
        """This config with `lev` a `LEVConfig` at `vocab_size` (None: not known yet) and
        `hidden_size` if the arm uses LEV, else None (self if it is so). ValueError: an impossible
        LEV hyper-parameter (naming its flag), or a `lev` built for another V or D."""
        lev = self.lev
        if not self.uses_lev:
            lev = None
        elif not isinstance(lev, LEVConfig):
            lev = LEVConfig(**{"vocab_size": vocab_size, "hidden_size": hidden_size, **(lev or {})})
        elif lev.vocab_size is None:
            lev = dataclasses.replace(lev, vocab_size=vocab_size, hidden_size=hidden_size)
        if lev is not None and (lev.vocab_size, lev.hidden_size) != (vocab_size, hidden_size):
            raise ValueError(
                f"the LEVConfig is for V={lev.vocab_size}, D={lev.hidden_size} but the model has "
                f"--vocab-size {vocab_size} and --hidden-size {hidden_size}; build it with the "
                "model's sizes (ModelConfig.replace carries new sizes over to it)"
            )
        return self if lev is self.lev else dataclasses.replace(self, lev=lev)


@flag_dataclass
class ModelConfig:
    """A decoder-only LLaMA-style model: RMSNorm, SwiGLU, rotary positions, no biases."""

    vocab_size: Optional[int] = None
    """The (padded) vocabulary; None until the tokenizer is known (`RunConfig.with_tokenizer`)."""
    num_layers: Optional[int] = flag(
        None, "transformer layers (default: the preset's, else 2)", shapes_model=True, minimum=1
    )
    hidden_size: Optional[int] = flag(
        None, "model width D (default: the preset's, else 64)", shapes_model=True, minimum=1
    )
    num_attention_heads: Optional[int] = flag(
        None, "query heads (default: the preset's, else 4)", shapes_model=True, minimum=1
    )
    num_query_groups: Optional[int] = flag(
        None,
        "key/value heads of grouped-query attention (default: one per query head; 1 with "
        "--group-query-attention, as in Megatron-LM)",
        shapes_model=True,
        minimum=1,
    )
    ffn_hidden_size: Optional[int] = flag(
        None,
        "SwiGLU inner width (default: the preset's, else LLaMA's 8/3 x hidden rounded up to a "
        "multiple of 256)",
        shapes_model=True,
        minimum=1,
    )
    seq_length: Optional[int] = flag(None, "tokens per sample", shapes_model=True, minimum=1)
    """The run's one value (`RunConfig.model`: a sample's tokens, which the datasets are cut
    to). Rotary positions need no table, so None (a model built in code) means 128."""
    rotary_base: int = flag(10000, "base of the rotary frequencies", shapes_model=True)
    rotary_percent: float = flag(1.0, "fraction of head channels rotated", shapes_model=True)
    head_dim: Optional[int] = flag(
        None,
        "channels per attention head (default: hidden size / heads)",
        shapes_model=True,
        minimum=1,
        name="--kv-channels",
    )
    norm_epsilon: float = flag(1e-5, "RMSNorm epsilon", shapes_model=True)
    init_method_std: float = flag(0.02, "std of the normal weight init")
    hidden_dropout: float = flag(0.0, "dropout after attention and MLP", command_line_default=0.1)
    """Megatron-LM's 0.1 on the command line; 0.0 for a model built in code (deterministic
    forwards, which the numerics tests compare)."""
    attention_dropout: float = flag(
        0.0, "dropout of the attention probabilities", command_line_default=0.1
    )
    qk_layernorm: bool = flag(False, "RMSNorm on queries and keys", shapes_model=True)
    transformer_impl: str = flag(
        "local",
        "transformer_engine (TE on CUDA) or local (megatron-core modules with CPU twins); "
        "default: transformer_engine where TE and a GPU are present, else local",
        # Megatron-LM's default (transformer_engine) where it can run, else local.
        command_line_default=lambda: TRANSFORMER_IMPLS[transformer_engine_available()],
        choices=TRANSFORMER_IMPLS,
    )
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)

    use_cpu_initialization: bool = flag(
        True, "initialise weights on CPU from one seeded stream (identical at every TP size)"
    )
    perform_initialization: bool = True
    recompute_granularity: Optional[str] = flag(
        None,
        "recompute activations in backward: full layers or selective parts",
        choices=RECOMPUTE_GRANULARITIES,
    )
    recompute_method: Optional[str] = flag(
        None,
        "full recompute: uniform (chunks of layers) or block (the first N per stage)",
        choices=RECOMPUTE_METHODS,
    )
    recompute_num_layers: Optional[int] = flag(None, "layers per --recompute-method chunk/block")
    extra_transformer_config: dict = field(default_factory=dict)
    """Further TransformerConfig fields, passed through unchanged (Megatron-style overrides)."""
    model_size: Optional[str] = flag(
        None,
        "preset depth/width/heads/FFN for the paper's scales (explicit flags override)",
        shapes_model=True,
        choices=sorted(MODEL_SIZE_PRESETS),
    )
    group_query_attention: bool = flag(False, "use --num-query-groups KV heads", shapes_model=True)
    max_position_embeddings: Optional[int] = flag(
        None,
        "accepted for Megatron compatibility; rotary positions need no table",
        shapes_model=True,
    )
    recompute_activations: bool = flag(
        False, "selective recomputation (same as --recompute-granularity selective)"
    )

    derived: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """The flags left None that this config filled (`derive`): args.json records them as given
    (None); `check_as_given` reads which sizes were given."""

    @classmethod
    def derive(cls, v: dict) -> dict:
        """The sizes left None filled (`derived`), and the LEVConfig built at the model's V and
        D (`EmbeddingConfig.at_model_size`, which checks it)."""
        if isinstance(v["embedding"], dict):
            v["embedding"] = EmbeddingConfig(**v["embedding"])
        sizes = {**_DEBUG_MODEL, **MODEL_SIZE_PRESETS.get(v["model_size"] or "", {})}
        fills = dict(
            num_layers=lambda: sizes["num_layers"],
            hidden_size=lambda: sizes["hidden_size"],
            num_attention_heads=lambda: sizes["num_attention_heads"],
            ffn_hidden_size=lambda: (
                sizes.get("ffn_hidden_size") or llama_ffn_hidden_size(v["hidden_size"])
            ),
            seq_length=lambda: 128,
            # Megatron-LM's default with --group-query-attention is one key/value group.
            num_query_groups=lambda: 1 if v["group_query_attention"] else v["num_attention_heads"],
            recompute_granularity=lambda: "selective" if v["recompute_activations"] else None,
        )
        derived = set(v["derived"])
        for name, fill in fills.items():
            if v[name] is None and fill() is not None:
                v[name] = fill()
                derived.add(name)
        if v["vocab_size"] is not None and v["vocab_size"] < 1:
            raise ValueError(f"--vocab-size must be >= 1, got {v['vocab_size']}")
        given = v["embedding"].lev
        given = given.base if isinstance(given, LEVConfig) else (given or {}).get("base")
        v["embedding"] = v["embedding"].at_model_size(v["vocab_size"], v["hidden_size"])
        if v["embedding"].lev is not None and v["embedding"].lev.base != given:
            derived.add("lev_base")
        v["derived"] = tuple(sorted(derived))
        return v

    def __post_init__(self) -> None:
        """Raise ValueError naming the flag for every impossible setting (what needs the layout
        too is `config.layout.check_layout`'s)."""
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

    def check_as_given(self) -> None:
        """Megatron-LM's rules for the sizes as the command line gives them (a model built in
        code has the rest filled): all of --num-layers, --hidden-size and --num-attention-heads,
        a --model-size preset, or none (the debug model); --num-query-groups only with
        --group-query-attention (Megatron-LM ignores it without the switch); --seq-length, no
        longer than --max-position-embeddings when that is given."""
        if "seq_length" in self.derived:
            raise ValueError("--seq-length is required")
        sizes = ("num_layers", "hidden_size", "num_attention_heads")
        given = [name for name in sizes if name not in self.derived]
        if not self.model_size and given and len(given) < len(sizes):
            flags = ", ".join("--" + k.replace("_", "-") for k in sizes if k not in given)
            raise ValueError(f"set {flags} or pick a --model-size preset")
        if "num_query_groups" not in self.derived and not self.group_query_attention:
            raise ValueError("--num-query-groups needs --group-query-attention (as in Megatron-LM)")
        table = self.max_position_embeddings
        if table is not None and self.seq_length > table:
            raise ValueError(
                f"--seq-length {self.seq_length} is longer than --max-position-embeddings {table} "
                f"(Megatron-LM refuses it too); raise --max-position-embeddings to at least "
                f"{self.seq_length}, or drop it (rotary positions need no table)"
            )

    @property
    def kv_channels(self) -> int:
        """Width of one attention head (--kv-channels, default hidden_size / heads)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def replace(self, **changes) -> "ModelConfig":
        """A validated copy with `changes`; a new vocab_size or hidden_size carries over to
        `embedding.lev` (unless `embedding` changes too), its digit base kept where it shapes the
        weights (lev, factored-mlp) and re-derived where it only sizes them (albert, flat-mlp)."""
        lev = self.embedding.lev
        resized = {"vocab_size", "hidden_size"} & changes.keys()
        if resized and "embedding" not in changes and lev is not None:
            keeps_base = self.embedding.embedding_type in ("lev", "factored-mlp")
            lev = dataclasses.replace(lev, vocab_size=None, base=lev.base if keeps_base else None)
            changes["embedding"] = dataclasses.replace(self.embedding, lev=lev)  # sized by derive
        return dataclasses.replace(self, **changes)
