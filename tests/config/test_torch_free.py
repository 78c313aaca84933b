"""The config room (`megatron_ext.config`) imports neither torch nor megatron-core: every module
of it imports in a fresh interpreter where both are blocked, the command line parses into a
`RunConfig` there and its args.json reads back into the same config."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # a fresh interpreter

_PROGRAM = r"""
import importlib, pkgutil, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "megatron"):
            raise ImportError(f"the config room imported {name}")

sys.meta_path.insert(0, Blocked())
import megatron_ext.config as room
names = sorted(m.name for m in pkgutil.iter_modules(room.__path__))
for name in names:
    importlib.import_module(f"megatron_ext.config.{name}")
from megatron_ext.config.arguments import parse_config, run_config_from_args_json
from megatron_ext.config.run import RunConfig

run = parse_config(
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 1e-3 --seq-length 32 "
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --embedding-type lev "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 100".split(),
    world_size=2,
    cuda=False,
)
assert isinstance(run, RunConfig), type(run)
assert run_config_from_args_json(run.args_json()) == run  # the args.json reader, too
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron"))
print(",".join(names), run.parallel.data_parallel_size, run.num_microbatches, loaded)
"""


def test_config_room_imports_no_torch_and_parses():
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    modules, dp, micro, loaded = done.stdout.split(" ", 3)
    assert {"arguments", "data", "flags", "layout", "lev", "model", "run"} <= set(
        modules.split(",")
    )
    assert (dp, micro, loaded.strip()) == ("2", "2", "[]")


def test_tokenizer_type_choices_are_the_tokenizers():
    from megatron_ext.config.data import TOKENIZER_TYPE_NAMES
    from megatron_ext.data.tokenizers import TOKENIZER_TYPES

    assert list(TOKENIZER_TYPE_NAMES) == sorted(TOKENIZER_TYPES)
