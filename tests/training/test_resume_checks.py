"""Resuming, as users get it wrong (pretrain_leviathan.py on one rank, mock data, tiny model):

- a --load directory that does not exist is a WARNING naming its absolute path (an error with
  --exit-on-missing-checkpoint);
- --log-jsonl holds one record per iteration after a resume from an earlier checkpoint;
- a new --train-iters on resume names --train-iters and points at
  --override-opt_param-scheduler;
- --load naming one iter_XXXXXXX directory loads that iteration (as --load <run> --ckpt-step N);
  with a --ckpt-step naming another, one line says to pass the run's directory;
- a width change is reported with the parameter and both shapes, without blaming the
  vocabulary padding;
- a malformed weighted --data-path blend is refused as such (not "dataset not found: 0.5").
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from megatron_ext.config.data import DataConfig
from megatron_ext.data.readers import DataError
from tests.support.runs import ENTRY_MODULE, TINY_MOCK_RUN, run_command

pytestmark = pytest.mark.integration

TINY = TINY_MOCK_RUN


def _run(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """pretrain_leviathan on one rank; stdout and stderr apart."""
    return run_command(ENTRY_MODULE, [*TINY, *args], workdir)


def _error_line(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    return errors[0]


def test_resume_mistakes_are_explained(tmp_path):
    ckpt, jsonl = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    missing = tmp_path / "no_such_dir"
    first = _run(
        tmp_path, "--train-iters", "6", "--exit-interval", "4", "--save", str(ckpt),
        "--save-interval", "2", "--load", str(missing), "--log-jsonl", str(jsonl),
    )  # fmt: skip
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # the path as the run shows it: relative to its working directory when below it
    shown = os.path.relpath(missing, tmp_path)
    assert f"WARNING: --load {shown} does not exist: starting from scratch" in first.stdout
    strict = _run(
        tmp_path, "--train-iters", "6", "--load", str(missing), "--exit-on-missing-checkpoint"
    )
    assert f"--load {shown} does not exist" in _error_line(strict)

    # Resumed at iteration 2 of a log that reached 4: iterations 3-4 are not repeated.
    resumed = _run(
        tmp_path, "--train-iters", "6", "--load", str(ckpt), "--ckpt-step", "2",
        "--log-jsonl", str(jsonl),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6]

    longer = _run(tmp_path, "--train-iters", "12", "--load", str(ckpt))
    line = _error_line(longer)
    assert "learning-rate schedule" in line and "--override-opt_param-scheduler" in line, line
    # the flag the user changed, not the scheduler's names for it
    assert line.startswith("error: --train-iters of this command line differs"), line
    assert "decay_steps" not in line and "do not match" not in line, line

    # --load naming one checkpoint (as the tools take it) loads that iteration, exactly.
    before = sorted(p.name for p in ckpt.iterdir())
    one = _run(
        tmp_path, "--train-iters", "6", "--load", str(ckpt / "iter_0000002"), "--exit-interval",
        "3", "--log-jsonl", str(tmp_path / "one.jsonl"),
    )  # fmt: skip
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "loading iteration 2 of" in one.stdout and "--ckpt-step 2" in one.stdout
    assert "iter_0000002 (iteration 2," in one.stdout, one.stdout[-3000:]
    one_records = [json.loads(x) for x in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in one_records] == [3]
    assert one_records[0]["loss"] == pytest.approx(records[2]["loss"], rel=1e-5)
    other = _run(
        tmp_path, "--train-iters", "6", "--load", str(ckpt / "iter_0000002"), "--ckpt-step", "4"
    )
    line = _error_line(other)
    assert f"--load {ckpt}" in line and "--ckpt-step 4" in line, line
    assert sorted(p.name for p in ckpt.iterdir()) == before  # nothing written into --load

    wider = _run(tmp_path, "--train-iters", "6", "--load", str(ckpt), "--hidden-size", "48")
    line = _error_line(wider)
    assert "embedding.word_embeddings.weight: the checkpoint holds shape (256, 32), this model " \
        "(256, 48)" in line, line  # fmt: skip
    assert "vocabulary" not in line and "--use-checkpoint-args" in line, line


@pytest.mark.parametrize(
    "blend", [["a", "0.5"], ["0.5", "a", "b"], ["0.5", "a", "b", "0.5"], ["a", "0.3", "b"]]
)
def test_malformed_weighted_blend(blend):
    with pytest.raises(DataError, match="a weighted blend is pairs of weight and prefix"):
        DataConfig(data_path=blend)
    DataConfig(data_path=["0.7", "a", "0.3", "b"])  # well-formed: accepted here
    DataConfig(data_path=["a", "b"])
