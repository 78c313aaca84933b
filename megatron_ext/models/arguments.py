"""The model's command-line flags and the `ModelConfig` they fill.

The flags are declared on the fields of `ModelConfig` and `EmbeddingConfig` (`config_flags`);
this module adds them as argument groups, with the `--lev-*` group and the Megatron-LM launch
script switches that restate this backbone's fixed design, and applies the command line's own
rules (Megatron-LM's): explicit sizes or a preset, `--num-query-groups` only with
`--group-query-attention`.
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_ext.config_flags import add_config_arguments, config_flag_values, flag_dest
from megatron_ext.lev.arguments import add_lev_arguments, lev_flag_values
from megatron_ext.models.config import EmbeddingConfig, ModelConfig

__all__ = ["add_model_arguments", "model_config_from_args"]

_SIZES = ("num_layers", "hidden_size", "num_attention_heads")


def add_model_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the model, embedding-arm, Megatron-LM compatibility and --lev-* flags; return parser."""
    add_config_arguments(parser, ModelConfig, "model", "LLaMA-style backbone and input embedding")
    add_config_arguments(
        parser, EmbeddingConfig, "embedding", "input embedding arm (docs/lev.md section 3)"
    )
    _add_megatron_compatibility_arguments(parser)
    add_lev_arguments(parser)
    return parser


def _add_megatron_compatibility_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of Megatron-LM GPT launch scripts that restate this backbone's fixed design.

    They are accepted so that existing scripts run unchanged; a value that asks for another
    design (LayerNorm, learned positions) is refused in `model_config_from_args`.
    """
    compat = parser.add_argument_group(
        "Megatron-LM compatibility", "accepted for launch-script reuse; the backbone is LLaMA-style"
    )
    for flag, help_ in (
        ("--use-mcore-models", "always: models are megatron-core GPTModels"),
        ("--swiglu", "always: the MLP is SwiGLU"),
        ("--disable-bias-linear", "always: linear layers have no bias"),
        ("--attention-softmax-in-fp32", "always: softmax runs in fp32"),
        ("--use-flash-attn", "Transformer Engine picks its fused attention itself"),
        ("--no-masked-softmax-fusion", "the local path runs no fusions; TE fuses on its own"),
        ("--no-bias-swiglu-fusion", "the local path runs no fusions; TE fuses on its own"),
        ("--no-bias-dropout-fusion", "the local path runs no fusions; TE fuses on its own"),
        ("--no-rope-fusion", "the local path runs no fusions; TE fuses on its own"),
        ("--no-gradient-accumulation-fusion", "gradients accumulate in fp32 main grads"),
    ):
        compat.add_argument(flag, action="store_true", help=help_)
    compat.add_argument("--normalization", default="RMSNorm", help="only RMSNorm")
    compat.add_argument("--position-embedding-type", default="rope", help="only rope")


def _check_fixed_design(args: argparse.Namespace) -> None:
    if getattr(args, "normalization", "RMSNorm") != "RMSNorm":
        raise ValueError(
            f"--normalization {args.normalization}: the Leviathan backbone is LLaMA-style and "
            "uses RMSNorm; drop the flag"
        )
    if getattr(args, "position_embedding_type", "rope") != "rope":
        raise ValueError(
            f"--position-embedding-type {args.position_embedding_type}: the Leviathan backbone "
            "uses rotary positions; drop the flag"
        )


def _check_sizes(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for the flags as typed (a model built in code has its defaults)."""
    given = [k for k in _SIZES if getattr(args, k, None) is not None]
    if not getattr(args, "model_size", None) and given and len(given) < len(_SIZES):
        flags = ", ".join("--" + k.replace("_", "-") for k in _SIZES if k not in given)
        raise ValueError(f"set {flags} or pick a --model-size preset")
    if getattr(args, "num_query_groups", None) is not None and not getattr(
        args, "group_query_attention", False
    ):
        raise ValueError("--num-query-groups needs --group-query-attention (as in Megatron-LM)")


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """Fill a ModelConfig from parsed flags (or a checkpoint's args.json as a namespace);
    `vocab_size` is the padded vocabulary.

    Every field is read from its flag's destination (`config_flags.flag_dest`): the model's and
    the embedding's flags, the layout and precision of `ParallelConfig` / `PrecisionConfig` by
    the same names, the `--lev-*` flags as the `LEVConfig` at `embedding.lev` (built at the
    model's V and D). A name missing from `args` keeps the field's default.
    """
    _check_fixed_design(args)
    embedding = EmbeddingConfig(**config_flag_values(EmbeddingConfig, args))
    _check_sizes(args)
    if embedding.uses_lev:
        embedding = dataclasses.replace(embedding, lev=lev_flag_values(args))
    values = {
        f.name: getattr(args, flag_dest(f))
        for f in dataclasses.fields(ModelConfig)
        if f.name not in ("vocab_size", "embedding", "params_dtype") and hasattr(args, flag_dest(f))
    }
    return ModelConfig(vocab_size=vocab_size, embedding=embedding, **values)
