"""A checkpoint written by main 9e624e2 (before issue 47 changed how flags become configs)
resumes bit for bit: `data/ckpt_9e624e2/` is iteration 3 of a one-rank CPU run of
`data/ckpt_9e624e2_run.json`'s command line, which recorded iterations 1-6 and the args.json
it wrote at iteration 6. Continued from iteration 3, the run logs the same losses, grad norms
and learning rates, the same validation and test losses, and writes the same args.json (but
for the paths of --load/--save/--log-jsonl and the FP8 recipe's defaults, Megatron-LM's since
issue 47); --use-checkpoint-args reads its args.json."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DATA = Path(__file__).parent / "data"
RUN = json.loads((DATA / "ckpt_9e624e2_run.json").read_text())


def _without_outputs(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--save", "--load", "--log-jsonl"):
            skip = True
        else:
            out.append(arg)
    return out


def _added_since(saved: dict) -> dict:
    """The flags added since main 9e624e2, at their defaults (an args.json of then lacks them)."""
    from megatron_ext.training.arguments import build_parser

    parser = build_parser()
    return {
        a.dest: parser.get_default(a.dest)
        for a in parser._actions
        if a.option_strings and a.dest not in saved and a.default is not argparse.SUPPRESS
        and a.dest != "help"
    }  # fmt: skip


def test_a_checkpoint_of_main_9e624e2_resumes_bit_for_bit(tmp_path, launcher):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA / "ckpt_9e624e2", ckpt)
    argv = [*_without_outputs(RUN["argv"]), "--load", str(ckpt), "--save", str(ckpt)]
    run = launcher(1, argv, tmp_path / "run").check()
    keep = ("iteration", "consumed_samples", "loss", "grad_norm", "lr")
    resumed = [{k: r[k] for k in keep} for r in run.records]
    assert resumed == RUN["records"][3:]  # iterations 4-6, exactly
    lines = RUN["eval_lines"]
    assert f"validation loss at iteration 6 | lm loss value: {lines['validation_6']}" in run.output
    assert f"test loss at iteration 6 | lm loss value: {lines['test_6']}" in run.output
    written = json.loads((ckpt / "iter_0000006" / "args.json").read_text())
    expected = dict(RUN["args_json_at_6"])
    expected.update(load=str(ckpt), save=str(ckpt), log_jsonl=str(tmp_path / "run/metrics.jsonl"))
    # Megatron-LM's FP8 recipe defaults since issue 47 (no --fp8-format here: no effect).
    expected.update(fp8_amax_history_len=1, fp8_amax_compute_algo="most_recent")
    assert written == {**_added_since(expected), **expected}


def test_use_checkpoint_args_reads_the_model_flags_of_main_9e624e2():
    """--use-checkpoint-args restores the model flags into the RunConfig, and the whole
    args.json reads back into the run it recorded (Megatron-LM's FP8 recipe defaults since
    issue 47 aside: without --fp8-format they had no effect)."""
    from megatron_ext.training.arguments import parse_config, run_config_from_args_json

    argv = ["--micro-batch-size", "2", "--train-iters", "6", "--lr", "1e-3", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--seq-length", "16",
            "--load", str(DATA / "ckpt_9e624e2"), "--use-checkpoint-args"]  # fmt: skip
    run = parse_config(argv, world_size=1)
    saved = json.loads((DATA / "ckpt_9e624e2" / "iter_0000003" / "args.json").read_text())
    written = run.args_json()
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "lev_seed_dim", "lev_rank", "lev_num_heads", "lev_num_knots"):  # fmt: skip
        assert written[name] == saved[name], name
    model = run.model
    assert (model.num_layers, model.hidden_size, model.embedding.lev.num_knots) == (2, 16, 5)
    recorded = run_config_from_args_json(saved)
    fp8 = {"fp8_amax_history_len": 1, "fp8_amax_compute_algo": "most_recent"}
    assert recorded.args_json() == {**_added_since(saved), **saved, **fp8}
