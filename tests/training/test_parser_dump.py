"""The command lines as recorded: every option of `pretrain_leviathan.py`'s parser and of every
tool (tools/*.py but gpu_check, sub-commands included), with what a script relies on (its
option strings, dest, default, type, choices, nargs, const, action class and required flag),
compared with `data/parsers.json`, one line per option; and every option has a help text, its
default shown by --help. Help sentences, metavars and argument groups are not recorded: editing
them needs no new record.

An intended change (an option added, a default changed) is recorded by the commit that makes
it: `python tests/training/test_parser_dump.py --write` rewrites the file, whose diff then shows
one line per changed option.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

RECORD = Path(__file__).parent / "data" / "parsers.json"


def _json(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return getattr(value, "__name__", repr(value))


def dump(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, dict]:
    """Option (or sub-command option) -> its settings; sub-commands recurse as "name --flag"."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(dump(sub, f"{prefix}{name} "))
            continue
        if isinstance(action, argparse._HelpAction):
            continue
        key = prefix + (" ".join(action.option_strings) or action.dest)
        out[key] = dict(
            dest=action.dest,
            default=_json(action.default),
            type=_json(action.type),
            choices=_json(action.choices),
            nargs=_json(action.nargs),
            action=type(action).__name__,
            const=_json(action.const),
            required=action.required,
        )
    return out


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parser of every command a user runs: pretrain_leviathan.py and tools/*.py."""
    from megatron_ext import quickstart
    from megatron_ext.config.arguments import build_parser
    from megatron_ext.conversion import convert_checkpoint
    from megatron_ext.data import (
        count_tokens,
        make_sample_corpus,
        merge_datasets,
        preprocess_data,
        train_tokenizer,
    )
    from megatron_ext.evaluation import evaluate
    from megatron_ext.inference import generate
    from megatron_ext.models import param_table
    from tools import make_demo_data

    return {
        "pretrain_leviathan": build_parser(),
        "evaluate": evaluate.build_parser(),
        "generate": generate.build_parser(),
        "convert_checkpoint": convert_checkpoint.build_parser(),
        "count_params": param_table.build_parser(),
        "preprocess_data": preprocess_data.build_parser(),
        "merge_datasets": merge_datasets.build_parser(),
        "count_tokens": count_tokens.build_parser(),
        "train_tokenizer": train_tokenizer.build_parser(),
        "make_sample_corpus": make_sample_corpus.build_parser(),
        "quickstart": quickstart.pipeline.build_parser(),
        "make_demo_data": make_demo_data.build_parser(),
    }


def parsers() -> dict[str, dict[str, dict]]:
    """Every recorded command's options."""
    return {name: dump(parser) for name, parser in command_parsers().items()}


def _with_subcommands(name: str, parser: argparse.ArgumentParser):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _with_subcommands(f"{name} {sub_name}", sub)


def test_every_option_says_what_it_does_and_its_default():
    """issue 50: --help describes every option of every command (sub-commands included), and
    the project's formatter adds each option's default where the help does not name it."""
    from megatron_ext.config.flags import HelpFormatter

    empty, plain = [], []
    for command, parser in command_parsers().items():
        for name, p in _with_subcommands(command, parser):
            if p.formatter_class is not HelpFormatter:
                plain.append(name)
            formatter = p._get_formatter()
            for action in p._actions:
                if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                    continue
                if not (action.help or "").strip():
                    empty.append(f"{name} {'/'.join(action.option_strings)}")
                    continue
                shown = formatter._expand_help(action)
                takes_value = action.nargs != 0 or isinstance(
                    action, argparse.BooleanOptionalAction
                )
                # Megatron-LM's compatibility flags keep its defaults (docs/megatron-compat.md).
                if (
                    action.default is not argparse.SUPPRESS
                    and takes_value
                    and not ("default" in shown or "required" in shown)
                ):
                    empty.append(f"{name} {'/'.join(action.option_strings)}: no default shown")
    assert not plain, f"parsers without config.flags.HelpFormatter: {plain}"
    assert not empty, "options without a help text:\n" + "\n".join(empty)


def test_count_params_help_says_what_it_does_before_the_model_flags():
    from megatron_ext.models import param_table

    text = param_table.build_parser().format_help()
    assert text.index("Parameter counts") < text.index("--format") < text.index("--hidden-size")
    assert text.index("--memory") < text.index("--lev-num-digits")
    assert len(text.split("Parameter counts")[0].splitlines()) <= 2  # a short usage line


def _machine_independent(record: dict) -> dict:
    """--transformer-impl defaults to transformer_engine where TE and a GPU are present."""
    from megatron_ext.config.model import transformer_engine_available

    if transformer_engine_available():
        option = record["pretrain_leviathan"]["--transformer-impl"]
        option["default"] = "transformer_engine"
    return record


def test_the_parsers_are_as_recorded():
    recorded = _machine_independent(json.loads(RECORD.read_text()))
    now = parsers()
    differences = []
    for command in sorted(recorded.keys() | now.keys()):
        old, new = recorded.get(command, {}), now.get(command, {})
        for key in sorted(old.keys() | new.keys()):
            if old.get(key) != new.get(key):
                was, now_ = old.get(key), new.get(key)
                if was is None or now_ is None:
                    what = "added" if was is None else "removed"
                else:
                    what = ", ".join(
                        f"{f} {was.get(f)!r} -> {now_.get(f)!r}"
                        for f in sorted(was.keys() | now_.keys())
                        if was.get(f) != now_.get(f)
                    )
                differences.append(f"{command} {key}: {what}")
    assert not differences, (
        "the parsers differ from tests/training/data/parsers.json; if the change is intended "
        "(an option added or removed, a default changed), record it with\n"
        "    python tests/training/test_parser_dump.py --write\n"
        "and commit the file with the change:\n" + "\n".join(differences)
    )


def render(record: dict[str, dict[str, dict]]) -> str:
    """The record as JSON, one line per option (a change shows as that option's line)."""
    lines = ["{"]
    for i, (command, options) in enumerate(sorted(record.items())):
        lines.append(f" {json.dumps(command)}: {{")
        items = sorted(options.items())
        for j, (key, value) in enumerate(items):
            comma = "," if j < len(items) - 1 else ""
            lines.append(f"  {json.dumps(key)}: {json.dumps(value, sort_keys=True)}{comma}")
        lines.append(" }" + ("," if i < len(record) - 1 else ""))
    return "\n".join([*lines, "}"]) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/training/test_parser_dump.py --write")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tools/
    RECORD.write_text(render(parsers()))
    print(f"wrote {os.path.relpath(RECORD)}")
