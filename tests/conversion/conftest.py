"""Fixtures of the conversion tests: every arm trained for two iterations by
`pretrain_leviathan.py` (LEV and TIED at TP=2, ALBERT at PP=2, the others at TP=1), once per
session."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_ext.testing.runs import TINY_LEV_MODEL, TINY_TRAIN, launch

# arm -> (ranks, layout flags)
ARM_LAYOUTS = {
    "lev": (2, ["--tensor-model-parallel-size", "2"]),
    "tied": (2, ["--tensor-model-parallel-size", "2"]),
    "albert": (2, ["--pipeline-model-parallel-size", "2"]),
    "untied": (1, []),
    "flat-mlp": (1, []),
    "factored-mlp": (1, []),
}


def _arm_flags(arm: str) -> list[str]:
    flags = list(TINY_LEV_MODEL)
    flags[flags.index("--embedding-type") + 1] = arm
    # Grouped-query attention exercises the QKV group mapping of every converter.
    return flags + ["--group-query-attention", "--num-query-groups", "2"]


@pytest.fixture(scope="session")
def trained(tmp_path_factory, sample_data) -> dict:
    """{"data": data flags, "tokenizer": tok.model path, "ckpt": {arm: --save directory}}."""
    root = tmp_path_factory.mktemp("conversion")
    data = sample_data
    train = [*TINY_TRAIN, "--exit-interval", "2", "--save-interval", "2", "--eval-iters", "0"]

    def one(arm: str) -> Path:
        nproc, layout = ARM_LAYOUTS[arm]
        save = root / f"ckpt_{arm}"
        args = [*_arm_flags(arm), *train, *data, *layout, "--save", str(save)]
        launch(nproc, args, root / f"run_{arm}").check()
        return save

    with ThreadPoolExecutor(max_workers=2) as pool:
        paths = dict(zip(ARM_LAYOUTS, pool.map(one, ARM_LAYOUTS)))
    tokenizer = data[data.index("--tokenizer-model") + 1]
    return {"data": data, "tokenizer": tokenizer, "ckpt": {k: str(v) for k, v in paths.items()}}
