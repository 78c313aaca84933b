"""The command lines as recorded: every option of `pretrain_leviathan.py`'s parser and of the
tools that share training options (evaluate, generate, convert_checkpoint, count_params), with
its option strings, dest, default, type, choices, nargs, action class, metavar, required flag,
help and argument group, compared with `data/parsers.json`.

The file was written from main 9e624e2's parsers before issue 47 generated them another way;
every difference since is intended and recorded in the file by the commit that made it
(`python tests/training/test_parser_dump.py --write` rewrites it).
"""

from __future__ import annotations

import argparse
import json
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


def _groups(parser: argparse.ArgumentParser) -> dict[int, str]:
    out = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            out[id(action)] = group.title
    return out


def dump(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, dict]:
    """Option (or sub-command option) -> its settings; sub-commands recurse as "name --flag"."""
    groups, out = _groups(parser), {}
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
            metavar=_json(action.metavar),
            required=action.required,
            help=action.help,
            group=groups.get(id(action)),
        )
    return out


def parsers() -> dict[str, dict[str, dict]]:
    """Every recorded command's options."""
    from megatron_ext.conversion import convert_checkpoint
    from megatron_ext.evaluation import evaluate
    from megatron_ext.inference import generate
    from megatron_ext.models import param_table
    from megatron_ext.training.arguments import build_parser

    return {
        "pretrain_leviathan": dump(build_parser()),
        "evaluate": dump(evaluate.build_parser()),
        "generate": dump(generate.build_parser()),
        "convert_checkpoint": dump(convert_checkpoint.build_parser()),
        "count_params": dump(param_table.build_parser()),
    }


def _machine_independent(record: dict) -> dict:
    """--transformer-impl defaults to transformer_engine where TE and a GPU are present."""
    from megatron_ext.models.config import transformer_engine_available

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
                fields = sorted(
                    f
                    for f in (old.get(key) or {}).keys() | (new.get(key) or {}).keys()
                    if (old.get(key) or {}).get(f) != (new.get(key) or {}).get(f)
                )
                differences.append(f"{command} {key}: {fields}")
    assert not differences, (
        "the parsers differ from tests/training/data/parsers.json (record an intended change "
        "with python tests/training/test_parser_dump.py --write):\n" + "\n".join(differences)
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/training/test_parser_dump.py --write")
    RECORD.write_text(json.dumps(parsers(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}")
