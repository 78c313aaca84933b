"""The args.json format (one flat key per flag, Megatron-LM's names) keeps its keys and values:
`data/args_json_format.json` holds what main 9e624e2 wrote for a set of command lines (the
layout and optimizer flags, a preset, runs given in samples, a batch ramp, Megatron-LM's
rewrites, every model-shaping flag, the interleaved schedule, the feature flags, GPT-3 175B's
launch script); `RunConfig.args_json` writes the same but for the defaults issue 47 took from
Megatron-LM (and the deprecated --no-lev-fused, which is recorded as mapped), and reads back
into the same RunConfig. No figure here is computed: the values compare exactly."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megatron_ext.config.arguments import build_parser, parse_config, run_config_from_args_json

PARSER = build_parser()
CASES = json.loads((Path(__file__).parent / "data" / "args_json_format.json").read_text())
# Megatron-LM's defaults since issue 47, where the command line leaves them.
MEGATRON_DEFAULTS = dict(
    hidden_dropout=0.1,
    attention_dropout=0.1,
    eval_interval=None,
    fp8_amax_history_len=1,
    fp8_amax_compute_algo="most_recent",
)
GIVEN = {
    "hidden_dropout": "--hidden-dropout",
    "attention_dropout": "--attention-dropout",
    "eval_interval": "--eval-interval",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_args_json_keeps_its_keys_and_values(name):
    case = CASES[name]
    level = logging.getLogger().level
    try:
        run = parse_config(case["argv"], world_size=case["world_size"])
    finally:
        logging.getLogger().setLevel(level)
    written = run.args_json()
    recorded = dict(case["args_json"])
    for key, value in MEGATRON_DEFAULTS.items():
        if key not in GIVEN or GIVEN[key] not in case["argv"]:
            recorded[key] = value
    if "--no-lev-fused" in case["argv"]:  # mapped while parsing: recorded as the kernel
        recorded.update(lev_fused=None, lev_kernel="reference")
    # Every recorded key stays; a flag added since appears at its default (none yet).
    added = set(written) - set(recorded)
    assert set(recorded) <= set(written)
    assert {k: written[k] for k in added} == {k: PARSER.get_default(k) for k in added}
    assert {k: (recorded[k], written[k]) for k in recorded if written[k] != recorded[k]} == {}
    assert run_config_from_args_json(written) == run
