"""A checkpoint of format 1 (checkpoint.format.FORMAT_VERSION) keeps loading and resuming:
`data/checkpoint_format1/` is iteration 3 of a one-rank CPU run of
`data/checkpoint_format1_run.json`'s command line (written by main 9e624e2, before issue 47
changed how flags become configs), which recorded iterations 1-6 and the args.json it wrote at
iteration 6. Continued from iteration 3, the run logs the same losses, grad norms and learning
rates, the same validation and test losses, and writes the same args.json (but for the paths of
--load/--save/--log-jsonl and the FP8 recipe's defaults, Megatron-LM's since issue 47);
--use-checkpoint-args reads its args.json.

The figures were recorded on another machine: they are compared to a relative 1e-5, which
another CPU's or BLAS's float32 rounding cannot break (4.820573568344116 recorded,
4.820573806762695 on an AMD EPYC); bit-identity of a resumed run is asserted elsewhere, between
two runs of one test (tests/training/test_end_to_end.py)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DATA = Path(__file__).parent / "data"
RUN = json.loads((DATA / "checkpoint_format1_run.json").read_text())
CKPT = DATA / "checkpoint_format1"
RTOL = 1e-5  # float32 sums of another CPU or BLAS code path, never a change of behaviour


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
    """The flags added since the checkpoint was written, at their defaults (its args.json lacks
    them)."""
    from megatron_ext.config.arguments import build_parser

    parser = build_parser()
    return {
        a.dest: parser.get_default(a.dest)
        for a in parser._actions
        if a.option_strings and a.dest not in saved and a.default is not argparse.SUPPRESS
        and a.dest != "help"
    }  # fmt: skip


def _loss_value(output: str, which: str) -> float:
    found = re.search(rf"{which} loss at iteration 6 \| lm loss value: (\S+)", output)
    assert found, f"no {which} loss at iteration 6 in the output:\n{output[-3000:]}"
    return float(found.group(1))


def test_a_format_1_checkpoint_resumes(tmp_path, launcher):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(CKPT, ckpt)
    argv = [*_without_outputs(RUN["argv"]), "--load", str(ckpt), "--save", str(ckpt)]
    run = launcher(1, argv, tmp_path / "run").check()
    keep = ("iteration", "consumed_samples", "loss", "grad_norm", "lr")
    resumed = [{k: r[k] for k in keep} for r in run.records]
    recorded = RUN["records"][3:]  # iterations 4-6
    assert [{k: r[k] for k in keep[:2]} for r in resumed] == [
        {k: r[k] for k in keep[:2]} for r in recorded
    ]
    for now, then in zip(resumed, recorded):
        for k in keep[2:]:
            assert now[k] == pytest.approx(then[k], rel=RTOL), (now["iteration"], k)
    lines = RUN["eval_lines"]
    for which, key in (("validation", "validation_6"), ("test", "test_6")):
        assert _loss_value(run.output, which) == pytest.approx(float(lines[key]), rel=RTOL)
    written = json.loads((ckpt / "iter_0000006" / "args.json").read_text())
    expected = dict(RUN["args_json_at_6"])
    expected.update(load=str(ckpt), save=str(ckpt), log_jsonl=str(tmp_path / "run/metrics.jsonl"))
    # Megatron-LM's FP8 recipe defaults since issue 47 (no --fp8-format here: no effect).
    expected.update(fp8_amax_history_len=1, fp8_amax_compute_algo="most_recent")
    assert written == {**_added_since(expected), **expected}


def test_use_checkpoint_args_reads_the_model_flags_of_a_format_1_checkpoint():
    """--use-checkpoint-args restores the model flags into the RunConfig, and the whole
    args.json reads back into the run it recorded (Megatron-LM's FP8 recipe defaults since
    issue 47 aside: without --fp8-format they had no effect)."""
    from megatron_ext.config.arguments import parse_config, run_config_from_args_json

    argv = ["--micro-batch-size", "2", "--train-iters", "6", "--lr", "1e-3", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--seq-length", "16",
            "--load", str(CKPT), "--use-checkpoint-args"]  # fmt: skip
    run = parse_config(argv, world_size=1)
    saved = json.loads((CKPT / "iter_0000003" / "args.json").read_text())
    written = run.args_json()
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "lev_seed_dim", "lev_rank", "lev_num_heads", "lev_num_knots"):  # fmt: skip
        assert written[name] == saved[name], name
    model = run.model
    assert (model.num_layers, model.hidden_size, model.embedding.lev.num_knots) == (2, 16, 5)
    recorded = run_config_from_args_json(saved)
    fp8 = {"fp8_amax_history_len": 1, "fp8_amax_compute_algo": "most_recent"}
    assert recorded.args_json() == {**_added_since(saved), **saved, **fp8}
