"""Command-line flags declared on config dataclass fields, and the parser generated from them.

A config field that has a flag says so in its metadata: `flag(default, "--name", "help", ...)`
(the mechanism `LEVConfig` introduced; `lev/arguments.py` keeps its own copy for the `--lev-*`
group). `add_config_arguments(parser, cls, title)` turns every such field of `cls` into one
argparse argument whose default *is* the field's default and whose type comes from the
annotation; `config_flag_values(cls, args)` reads the parsed values back by field name. So a
new flag is one field: no argparse code, no mapping table.

`ArgumentError` is the one error type of the command line: an impossible or contradictory
combination of flags, its message one line naming the flag to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

__all__ = [
    "ArgumentError",
    "flag",
    "flag_fields",
    "flag_dest",
    "field_default",
    "command_line_default",
    "add_config_arguments",
    "config_flag_values",
]


class ArgumentError(ValueError):
    """An impossible or contradictory combination of flags (the message names the flag)."""


def flag(
    default: Any,
    name: str,
    help: str = "",
    *,
    aliases: tuple[str, ...] = (),
    shapes_model: bool = False,
    command_line_default: Any = dataclasses.MISSING,
    **argparse_options,
) -> Any:
    """A dataclass field whose command-line flag is `name` (e.g. "--lr-decay-style").

    `aliases` are other spellings of the same flag (Megatron-LM accepts several for a few).
    `argparse_options` go to `add_argument` as they are (choices, metavar, dest, action, nargs);
    the default is the field's, so the command line and a library user agree. A list default
    becomes a default factory (each config gets its own copy).

    `shapes_model`: the value shapes the model's parameters, so `--use-checkpoint-args` takes
    it from the checkpoint's args.json. `command_line_default`: the flag's default (or a
    callable giving it) where it must differ from the library's: Megatron-LM's default, e.g.
    None for a flag that is required or derived on the command line, or `--transformer-impl`
    transformer_engine where this machine can run it. The field's docstring says why.
    """
    metadata = {"flag": name, "aliases": tuple(aliases), "help": help, **argparse_options}
    if shapes_model:
        metadata["shapes_model"] = True
    if command_line_default is not dataclasses.MISSING:
        metadata["command_line_default"] = command_line_default
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_default(field: dataclasses.Field) -> Any:
    """The default of `field` (calling its default factory, if it has one)."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of dataclass `cls` that declare a command-line flag, in field order."""
    return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]


def flag_dest(field: dataclasses.Field) -> str:
    """The namespace attribute of a field's flag: its `dest`, else the field name."""
    return field.metadata.get("dest", field.name)


def command_line_default(field: dataclasses.Field) -> Any:
    """The default of a field's flag: the field's own unless it declares another."""
    if "command_line_default" in field.metadata:
        default = field.metadata["command_line_default"]
        return default() if callable(default) else default
    return field_default(field)


_NOT_ARGPARSE = ("flag", "aliases", "shapes_model", "command_line_default")


def _argparse_options(field: dataclasses.Field, annotation: Any) -> dict[str, Any]:
    """add_argument keywords of one field, from its annotation and metadata."""
    meta = {k: v for k, v in field.metadata.items() if k not in _NOT_ARGPARSE}
    options: dict[str, Any] = dict(dest=flag_dest(field), default=command_line_default(field))
    options.update(meta)
    if not options.get("help"):
        options.pop("help", None)
    if "action" in options:  # an explicit action (store_true, BooleanOptionalAction, ...)
        return options
    if typing.get_origin(annotation) is typing.Union:  # Optional[X] -> X
        (annotation, *_) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if annotation is bool:
        # A switch that is off by default is Megatron-LM's store_true; on by default, --no-x.
        off = field.default is False
        options["action"] = "store_true" if off else argparse.BooleanOptionalAction
    elif typing.get_origin(annotation) in (list, tuple) or annotation in (list, tuple):
        options.setdefault("nargs", "*")
        (item, *_) = typing.get_args(annotation) or (str,)
        options.setdefault("type", item)
    elif "type" not in options:
        options["type"] = annotation
    return options


def add_config_arguments(
    parser: argparse.ArgumentParser, cls: type, title: str, description: str | None = None
) -> argparse._ArgumentGroup:
    """Add one argparse group with the flag of every flagged field of `cls`; return the group."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title, description)
    for field in flag_fields(cls):
        names = (field.metadata["flag"], *field.metadata.get("aliases", ()))
        group.add_argument(*names, **_argparse_options(field, hints[field.name]))
    return group


def config_flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """Field name -> parsed value for every flagged field of `cls` present in `args` (a flag
    missing from `args` is left out: the args.json of a checkpoint written before it existed)."""
    return {
        f.name: getattr(args, flag_dest(f)) for f in flag_fields(cls) if hasattr(args, flag_dest(f))
    }
