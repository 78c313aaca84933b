"""The paper's study on a (real, single-host) Slurm cluster: `examples/slurm/study.sh` submits a
data job, a job array with one arm per task (--requeue) and a report job that depends on the
array; its report equals the one examples/reproduce_small.sh's report stages write from the
same arm outputs (same arms, budget and flags), to a tolerance."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.support.runs import REPO
from tests.support.slurm import Cluster

pytestmark = pytest.mark.integration

ARMS = ["tied", "lev"]
# reproduce_small.sh's flags for a tiny, short study (its own defaults are an hour's work).
TINY = ["--corpus-mb", "1", "--num-layers", "2", "--hidden-size", "64", "--eval-interval", "2"]
ITERS = "4"
NUMBER = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _numbers_and_text(text: str) -> tuple[list[float], str]:
    numbers = [float(n.replace(",", "")) for n in NUMBER.findall(text)]
    return numbers, NUMBER.sub("#", text)


def test_study_array_writes_the_reproduce_small_report(slurm: Cluster, tmp_path):
    out, logs = tmp_path / "study", tmp_path / "logs"
    env = {**slurm.env, "ITERS": ITERS, "OUT": str(out), "LOG_DIR": str(logs)}
    proc = subprocess.run(
        ["bash", "examples/slurm/study.sh", "--arms", *ARMS, "--", *TINY],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = int(re.search(r"data job (\d+)", proc.stdout).group(1))
    array = int(re.search(r"training array (\d+): ", proc.stdout).group(1))
    report = int(re.search(r"report job (\d+)", proc.stdout).group(1))
    assert f"{array}_0=tied {array}_1=lev" in proc.stdout

    # The array waits for the data job, the report job for the whole array.
    assert slurm.job(report)["Dependency"].startswith(f"afterok:{array}")
    info = slurm.wait(report, timeout=900)
    logs_text = "\n".join(p.read_text() for p in sorted(logs.glob("study-*.out")))
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", logs_text[-5000:]
    assert slurm.job(data)["JobState"] == "COMPLETED"
    for task, arm in enumerate(ARMS):
        task_info = slurm.job(f"{array}_{task}")
        assert task_info["ArrayTaskId"] == str(task) and task_info["Requeue"] == "1"
        assert task_info["JobState"] == "COMPLETED", task_info
        assert (out / f"train_{arm}" / "run.json").is_file()
        assert (logs / f"study-{array}_{task}.out").is_file()
        assert task_info["EndTime"] <= info["StartTime"]  # ISO times: the report came after
    for name in ("report.md", "curves.png", "frequency.png"):
        assert (out / "report" / name).is_file(), name
    study_report = (out / "report" / "report.md").read_text()
    for section in ("## Validation perplexity", "## Loss curves", "## Frequency-stratified"):
        assert section in study_report  # (the decomposition needs all six arms)

    # reproduce_small.sh on the same arm outputs: its evaluation and report stages redone.
    again = tmp_path / "again"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("evaluate", "report"))
    proc = subprocess.run(
        ["bash", "examples/reproduce_small.sh", "--arms", *ARMS, *TINY],
        cwd=REPO, env={**env, "OUT": str(again)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    reused = re.findall(r"\] [^\n]*: reusing the finished stage in \S*?(\w+) \(", proc.stdout)
    assert reused == ["corpus", "tokenizer", "data", "train_tied", "train_lev"], proc.stdout
    local_report = (again / "report" / "report.md").read_text()
    got, got_text = _numbers_and_text(study_report.replace(str(out), "OUT"))
    want, want_text = _numbers_and_text(local_report.replace(str(again), "OUT"))
    assert got_text == want_text
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
