"""args.json keeps its keys and values: `data/args_json_9e624e2.json` holds what main 9e624e2
wrote for a set of command lines (the layout and optimizer flags, a preset, runs given in
samples, a batch ramp, Megatron-LM's rewrites, every model-shaping flag, the interleaved
schedule, the feature flags, GPT-3 175B's launch script); today's parser writes the same."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megatron_ext.training.arguments import parse_config

CASES = json.loads((Path(__file__).parent / "data" / "args_json_9e624e2.json").read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_args_json_is_what_main_9e624e2_wrote(name):
    case = CASES[name]
    level = logging.getLogger().level
    try:
        _, cfg = parse_config(case["argv"], world_size=case["world_size"])
    finally:
        logging.getLogger().setLevel(level)
    written = cfg.ckpt.args_json
    recorded = case["args_json"]
    assert sorted(written) == sorted(recorded)
    assert {k: v for k, v in written.items() if v != recorded[k]} == {}
