"""Writes data/megatron_lm_defaults.json: the dest and default of every option of Megatron-LM's
command line at tag core_v0.16.1, read from its own parser (`megatron/training/arguments.py`,
which megatron-core's release does not ship).

    python tests/training/megatron_lm_defaults.py --repo PATH_TO_MEGATRON_LM_GIT_DIR

The tag's `megatron/training/` is extracted into a temporary directory and imported beside the
installed megatron-core (the package `__init__` and the two legacy helpers its `utils` imports
are stubbed: only the argument groups run). Run once; the test reads the JSON.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

TAG = "core_v0.16.1"
OUT = Path(__file__).parent / "data" / "megatron_lm_defaults.json"


def _json(value):
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def megatron_lm_parser(repo: str) -> argparse.ArgumentParser:
    """Megatron-LM's own parser at TAG (its add_megatron_arguments)."""
    root = tempfile.mkdtemp()
    archive = subprocess.run(
        ["git", "-C", repo, "archive", TAG, "megatron/training"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "x", "-C", root], input=archive, check=True)
    training = types.ModuleType("megatron.training")
    training.__path__ = [os.path.join(root, "megatron", "training")]
    for name in ("get_args", "get_timers", "get_adlr_autoresume"):
        setattr(training, name, lambda: None)
    sys.modules["megatron.training"] = training
    for name in ("megatron.legacy", "megatron.legacy.model", "megatron.legacy.model.module"):
        stub = types.ModuleType(name)
        stub.__path__ = []
        sys.modules[name] = stub
    sys.modules["megatron.legacy.model.module"].param_is_not_shared = lambda param: True
    arguments = importlib.import_module("megatron.training.arguments")
    return arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def render(table: dict[str, dict]) -> str:
    """{"tag": ..., "options": {option: {"default", "dest"}}} as JSON, one line per option."""
    lines = [
        f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(table.items())
    ]
    return '{\n "options": {\n' + ",\n".join(lines) + f'\n }},\n "tag": {json.dumps(TAG)}\n}}\n'


def main() -> int:
    """Write the table from the Megatron-LM git directory given with --repo."""
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--repo", required=True, help="a Megatron-LM git directory with the tag")
    repo = cli.parse_args().repo
    parser = megatron_lm_parser(repo)
    table = {
        option: {"dest": action.dest, "default": _json(action.default)}
        for action in parser._actions
        for option in action.option_strings
        if option not in ("-h", "--help")
    }
    OUT.write_text(render(table))
    print(f"wrote {len(table)} options of Megatron-LM {TAG} to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
