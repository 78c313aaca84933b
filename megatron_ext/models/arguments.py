"""The model's command-line flags and the `ModelConfig` they fill.

The flags are declared on the fields of `ModelConfig` and `EmbeddingConfig` (`config_flags`);
this module adds them as argument groups, with the `--lev-*` group, and applies the command
line's own rules (Megatron-LM's): explicit sizes or a preset, `--num-query-groups` only with
`--group-query-attention`. The Megatron-LM launch-script flags that restate this backbone's
fixed design (`--swiglu`, `--normalization RMSNorm`, ...) are `training.megatron_compat` rules.
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
    """Add the model, embedding-arm and --lev-* flags; return parser."""
    add_config_arguments(parser, ModelConfig, "model", "LLaMA-style backbone and input embedding")
    add_config_arguments(
        parser, EmbeddingConfig, "embedding", "input embedding arm (docs/lev.md section 3)"
    )
    add_lev_arguments(parser)
    return parser


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
    the embedding's flags, the `--lev-*` flags as the `LEVConfig` at `embedding.lev` (built at
    the model's V and D). A name missing from `args` keeps the field's default. The layout and
    precision (`--tensor-model-parallel-size`, `--bf16`, ...; args.json has them under the same
    names, before and after they left `ModelConfig`) are not the model's: `build_model` takes
    them (`models.layout`).
    """
    embedding = EmbeddingConfig(**config_flag_values(EmbeddingConfig, args))
    _check_sizes(args)
    if embedding.uses_lev:
        embedding = dataclasses.replace(embedding, lev=lev_flag_values(args))
    values = {
        f.name: getattr(args, flag_dest(f))
        for f in dataclasses.fields(ModelConfig)
        if f.name not in ("vocab_size", "embedding") and hasattr(args, flag_dest(f))
    }
    return ModelConfig(vocab_size=vocab_size, embedding=embedding, **values)
