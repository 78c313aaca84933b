"""The one flag mechanism: command-line flags declared on config dataclass fields.

`flag(default, "help", ...)` declares a field's flag in its metadata: named after the field
(`micro_batch_size` -> --micro-batch-size) unless it gives `name`, its namespace attribute (and
args.json key) Megatron-LM's. `add_flags(group, cls)` turns the fields into argparse arguments
whose default *is* the field's and whose type comes from the annotation; `flag_values` reads
parsed values back by field name; `@flag_dataclass` (frozen) refuses, before the config's own
checks, what the fields declare (`required`, `minimum`, `above`, `choices`, `needs`). So a new
flag is one field. `ArgumentParser` is every command's parser; `ArgumentError` the command
line's one error (one line naming the flag to change).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import typing
from typing import Any, Mapping, Optional

__all__ = [
    "ArgumentError",
    "ArgumentParser",
    "HelpFormatter",
    "add_flags",
    "check_flag_values",
    "command_line_default",
    "field_default",
    "flag",
    "flag_dataclass",
    "flag_dest",
    "flag_fields",
    "flag_name",
    "flag_values",
]


class ArgumentError(ValueError):
    """An impossible or contradictory combination of flags (the message names the flag)."""


def flag(
    default: Any,
    help: str = "",
    *,
    name: Optional[str] = None,
    prefix: str = "",
    aliases: tuple[str, ...] = (),
    shapes_model: bool = False,
    command_line_default: Any = dataclasses.MISSING,
    required: bool = False,
    minimum: Any = None,
    above: Any = None,
    needs: Optional[str] = None,
    **argparse_options,
) -> Any:
    """A dataclass field with a command-line flag: `name` (default: `flag_name`), the `help`
    that says what it does (--help adds the default), other spellings (`aliases`);
    `argparse_options` go to `add_argument` as they are. A list default becomes a factory.

    `shapes_model`: the value shapes the model's parameters (`--use-checkpoint-args` takes it
    from the checkpoint). `command_line_default`: the flag's default (or a callable giving it)
    where it differs from the library's (Megatron-LM's). `required`: the config refuses None;
    `minimum` / `above`: the least value / a bound to exceed (None passes); `needs`: the field
    that must be set when this one differs from its default.
    """
    metadata = {"flag": name, "aliases": tuple(aliases), "help": help, **argparse_options}
    extra = dict(prefix=prefix or None, shapes_model=shapes_model or None, needs=needs)
    extra.update(required=required or None, minimum=minimum, above=above)
    metadata.update({k: v for k, v in extra.items() if v is not None})
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


def flag_name(field: dataclasses.Field) -> str:
    """The flag of a field: its `name`, else `--<prefix>field-name` (`--no-field-name` for a
    switch that turns the field off, action store_false)."""
    meta = field.metadata
    if meta["flag"] is not None:
        return meta["flag"]
    off = "no-" if meta.get("action") == "store_false" else ""
    return f"--{off}{meta.get('prefix', '')}{field.name.replace('_', '-')}"


def flag_dest(field: dataclasses.Field) -> str:
    """The namespace attribute (args.json key) of a field: its flag's `dest`, else the flag's
    name (`--no-x` for a field that is on by default: x); a field without a flag: its name."""
    meta = field.metadata
    if "flag" not in meta:
        return field.name
    if "dest" in meta:
        return meta["dest"]
    name = flag_name(field)[2:]
    if meta.get("action") == "store_false" and name.startswith("no-"):
        name = name[3:]
    return name.replace("-", "_")


def command_line_default(field: dataclasses.Field) -> Any:
    """The default of a field's flag: the field's own unless it declares another."""
    if "command_line_default" in field.metadata:
        default = field.metadata["command_line_default"]
        return default() if callable(default) else default
    return field_default(field)


_NOT_ARGPARSE = ("flag", "prefix", "aliases", "shapes_model", "command_line_default", "required")
_NOT_ARGPARSE += ("minimum", "above", "needs")


def _argparse_options(field: dataclasses.Field, annotation: Any) -> dict[str, Any]:
    """add_argument keywords of one field, from its annotation and metadata."""
    meta = {k: v for k, v in field.metadata.items() if k not in _NOT_ARGPARSE}
    default = command_line_default(field)
    options: dict[str, Any] = {**meta, "dest": flag_dest(field), "default": default}
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
        if isinstance(default, tuple):
            options["default"] = list(default)
    elif "type" not in options:
        options["type"] = annotation
    return options


def add_flags(group, cls: type, *names: str, **overrides) -> None:
    """Add the flags of `cls`'s fields `names` (default: every flagged field) to `group` (a
    parser or an argument group). `overrides` replace add_argument keywords of each flag added:
    a tool whose purpose differs gives its own default, and its help says why."""
    hints = typing.get_type_hints(cls)
    chosen = [f for f in flag_fields(cls) if not names or f.name in names]
    missing = set(names) - {f.name for f in chosen}
    if missing:
        raise ValueError(f"{cls.__name__} has no flagged field {sorted(missing)}")
    for field in chosen:
        options = {**_argparse_options(field, hints[field.name]), **overrides}
        group.add_argument(flag_name(field), *field.metadata["aliases"], **options)


def flag_values(
    cls: type, values: Mapping[str, Any] | argparse.Namespace, derived: bool = False
) -> dict[str, Any]:
    """Field name -> value of each flagged field (with `derived`, each field) of `cls` in `values`
    (parsed flags or an args.json, by namespace name); a field missing there is left out."""
    fields = dataclasses.fields(cls) if derived else flag_fields(cls)
    values = vars(values) if isinstance(values, argparse.Namespace) else values
    return {f.name: values[flag_dest(f)] for f in fields if flag_dest(f) in values}


def _one_of(choices) -> str:
    if len(choices) == 2:
        return " or ".join(map(str, choices))
    return "one of " + ", ".join(map(str, choices))


def check_flag_values(config: Any) -> None:
    """Refuse a flagged field of `config` given without the field it `needs`, None where
    `required`, below its `minimum`, not above `above` or outside its `choices` (each item of a
    list value), with the command line's one-line message."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    for f in flag_fields(type(config)):
        value, meta = getattr(config, f.name), f.metadata
        name, needs = flag_name(f), meta.get("needs")
        if needs and value != field_default(f) and not getattr(config, needs):
            raise ValueError(f"{name} needs {flag_name(fields[needs])}")
        if value is None and meta.get("required"):
            raise ValueError(f"{name} is required")
        if value is None:
            continue
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if "choices" in meta and item not in meta["choices"]:
                raise ValueError(f"{name} must be {_one_of(meta['choices'])}, got {item!r}")
        if isinstance(value, (list, tuple)):
            continue
        if "minimum" in meta and value < meta["minimum"]:
            raise ValueError(f"{name} must be >= {meta['minimum']}, got {value}")
        if "above" in meta and not value > meta["above"]:
            raise ValueError(f"{name} must be > {meta['above']}, got {value}")


def flag_dataclass(cls: type) -> type:
    """`dataclass(frozen=True)` for a config with flags: its `__post_init__` refuses what the
    fields declare (`check_flag_values`), then runs the class's own `__post_init__`, if any.
    A class with a `derive(values)` classmethod (field name -> value as given, to the values
    to build with) has its derived values computed from the given ones before it is built."""
    own = getattr(cls, "__post_init__", lambda self: None)  # a parent's, if the class has none

    @functools.wraps(own)
    def __post_init__(self) -> None:
        check_flag_values(self)
        own(self)

    cls.__post_init__ = __post_init__
    cls = dataclasses.dataclass(frozen=True)(cls)
    if hasattr(cls, "derive"):
        init, signature = cls.__init__, inspect.signature(cls.__init__)

        @functools.wraps(init)
        def __init__(self, *args, **kwargs) -> None:
            given = signature.bind(self, *args, **kwargs).arguments
            fields = [f for f in dataclasses.fields(cls) if f.init]
            init(self, **cls.derive({f.name: given.get(f.name, field_default(f)) for f in fields}))

        cls.__init__ = __init__
    return cls


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help of every command: the description as written, and each option's default after its
    help unless the help names it (a switch is off unless given; a required option says so)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help, default = action.help or "", action.default
        if type(action).__name__ == "_ChoicesPseudoAction":  # a sub-command in the list
            return help
        if action.required:
            return help + " (required)"
        if isinstance(action, argparse.BooleanOptionalAction) and default is not None:
            default = action.option_strings[0 if default else 1]
        elif action.nargs == 0 or default is argparse.SUPPRESS:  # store_true / store_false
            return help
        else:
            default = "none" if default is None else "%(default)s"
        return help if "default" in help.lower() else f"{help} (default: {default})"


class ArgumentParser(argparse.ArgumentParser):
    """The parser of every command: --help laid out by `HelpFormatter`, its sub-commands' too
    (argparse builds a sub-command's parser with its parent's class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
