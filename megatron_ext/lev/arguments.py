"""The `--lev-*` flags, generated from `LEVConfig`'s fields, and the config they fill.

Each `LEVConfig` field but V and D declares its flag and help in its metadata
(`lev.config._flag`); `add_lev_arguments` turns them into one argparse group (dest
`lev_<field>`, default the field's default, type from the annotation: booleans get
`--lev-x/--no-lev-x`, tuples take any number of values) and `lev_config_from_args` reads the
parsed values back into a frozen `LEVConfig`. The entry point (`models.arguments`), the tools
and the tests all go through these functions, so a new field needs no argparse code.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
import warnings
from typing import Any

from megatron_ext.lev.config import LEVConfig

__all__ = ["add_lev_arguments", "lev_config_from_args", "lev_flag_fields", "lev_flag_values"]


def lev_flag_fields() -> list[dataclasses.Field]:
    """The `LEVConfig` fields that have a command-line flag (all but vocab_size, hidden_size)."""
    return [f for f in dataclasses.fields(LEVConfig) if "flag" in f.metadata]


def _dest(field: dataclasses.Field) -> str:
    return field.metadata["flag"].lstrip("-").replace("-", "_")  # --lev-num-knots -> lev_num_knots


def _argparse_options(field: dataclasses.Field, annotation: Any) -> dict[str, Any]:
    """add_argument keywords of one field, from its annotation and metadata."""
    meta = dict(field.metadata)
    options: dict[str, Any] = dict(dest=_dest(field), default=field.default, help=meta.pop("help"))
    meta.pop("flag")
    options.update(meta)  # choices, metavar
    if annotation is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(annotation) is tuple:  # tuple[str, ...]: any number of choices
        options.update(nargs="*", default=list(field.default))
    elif "choices" not in options:  # Optional[int] -> int; plain types as they are
        options["type"] = next(
            (a for a in typing.get_args(annotation) if a is not type(None)), annotation
        )
    return options


def add_lev_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the LEV flag group (`--lev-*`, dests `lev_<field>`) to `parser`; return `parser`."""
    hints = typing.get_type_hints(LEVConfig)
    group = parser.add_argument_group("LEV", "LEV input generator (docs/lev.md section 2)")
    for field in lev_flag_fields():
        group.add_argument(field.metadata["flag"], **_argparse_options(field, hints[field.name]))
    group.add_argument(
        "--lev-fused",
        dest="lev_fused",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="deprecated: --no-lev-fused is --lev-kernel reference; --lev-fused is the default",
    )
    return parser


def lev_flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """LEVConfig field -> parsed value, for every `--lev-*` flag present in `args` (a flag
    missing from `args` is left out: the args.json of a checkpoint written before it existed).

    The deprecated `--lev-fused/--no-lev-fused` (`lev_fused`, also in old args.json) is mapped
    onto `kernel`: False means "reference" (with "auto"; refused with another kernel), True the
    default. Either warns once per process.

    Raises:
        ValueError: --no-lev-fused together with --lev-kernel torch/triton/cpu.
    """
    values = {f.name: getattr(args, _dest(f)) for f in lev_flag_fields() if hasattr(args, _dest(f))}
    fused = getattr(args, "lev_fused", None)
    if fused is not None:
        _warn_fused_deprecated()
        kernel = values.get("kernel", "auto")
        if not fused:
            if kernel not in ("auto", "reference"):
                raise ValueError(
                    f"--no-lev-fused (deprecated: --lev-kernel reference) contradicts "
                    f"--lev-kernel {kernel}; drop --no-lev-fused"
                )
            values["kernel"] = "reference"
    return values


_warned_fused = False


def _warn_fused_deprecated() -> None:
    global _warned_fused
    if not _warned_fused:
        _warned_fused = True
        warnings.warn(
            "--lev-fused/--no-lev-fused (lev_fused in args.json) is deprecated: use --lev-kernel "
            "(--no-lev-fused is --lev-kernel reference)",
            FutureWarning,
            stacklevel=3,
        )


def lev_config_from_args(args: argparse.Namespace, vocab_size: int, hidden_size: int) -> LEVConfig:
    """The `LEVConfig` of the parsed `lev_*` values of `args`; V and D come from the model.

    A flag missing from `args` keeps the field's default (`lev_flag_values`).

    Raises:
        ValueError: an impossible value, naming the flag to change (`LEVConfig.__post_init__`).
    """
    return LEVConfig(vocab_size=vocab_size, hidden_size=hidden_size, **lev_flag_values(args))
