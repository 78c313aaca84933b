"""Cluster resilience with real processes (2 gloo ranks under torch.distributed.run):

- --exit-duration-in-mins saves and exits 0 before the limit, counted from the job start with
  the save included; --exit-interval saves and exits 0 (the reference run);
- a SIGSTOPped rank makes the other fail within --distributed-timeout-minutes (0.1 = 6 s) with
  one line naming the timeout and the group; torchrun exits non-zero; the last checkpoint is
  intact;
- torchrun --max-restarts 2 after a SIGKILLed rank: the ranks restart, resume by themselves from
  the latest checkpoint (--load = --save) and train the same losses as an uninterrupted run.

examples/slurm/*.sbatch run under a real Slurm in tests/slurm/test_sbatch.py.

One uninterrupted 2-rank run (the reference, 12 iterations, a checkpoint every 4) is shared by
the checks that compare losses. The two-agent (--nnodes 2) run is in test_cluster_nodes.py, a
module of its own so that pytest-xdist (--dist loadfile) can run it beside this one.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.support.cluster import cluster_job as _job
from tests.support.cluster import records as _records
from tests.support.cluster import torchrun_cmd as _torchrun
from tests.support.runs import TINY_LEV_MODEL, TINY_TRAIN, TINY_TRAIN_DEFAULT_DROPOUT, train

pytestmark = pytest.mark.integration

ITERS = 12
SAVE_INTERVAL = 4


@pytest.fixture(scope="module")
def train_args(corpus) -> list[str]:
    """Every run asks for the same schedule (so that losses compare) and stops at ITERS."""
    return [
        *TINY_LEV_MODEL, *TINY_TRAIN_DEFAULT_DROPOUT, *corpus, "--eval-iters", "0",
        "--exit-interval", str(ITERS), "--save-interval", str(SAVE_INTERVAL),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(train_args, tmp_path_factory) -> dict[int, float]:
    """An uninterrupted 2-rank run (forked ranks: tests.support.runs.train): --exit-interval
    saves and exits 0."""
    d = tmp_path_factory.mktemp("reference")
    run = train(2, [*train_args, "--save", str(d / "ckpt")], d).check()
    assert f"exiting at iteration {ITERS} (exit-interval)" in run.output
    assert (d / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    assert sorted(run.losses) == list(range(1, ITERS + 1))
    return run.losses


def test_exit_duration_saves_and_exits_before_the_limit(corpus, tmp_path):
    # 12 s: a forked rank starts in about a second (up to 5 s on a loaded 2-core machine); the
    # run is sized to outlast the limit on a fast one (about 60 ms an iteration). Saves every
    # 50 iterations: the check reserves the longest of them, measured under the host's load
    # (the guess before any save, 5 % of the limit, is 0.6 s here: a loaded host's final save
    # took longer).
    limit_min = 0.2
    args = [*TINY_LEV_MODEL, *TINY_TRAIN, *corpus, "--eval-iters", "0", "--train-iters", "5000"]
    args += ["--exit-duration-in-mins", str(limit_min), "--save", str(tmp_path / "ckpt")]
    args += ["--save-interval", "50"]
    run = train(1, args, tmp_path).check()
    last = max(run.losses)
    assert 1 <= last < 5000 and f"exiting at iteration {last} (exit-duration)" in run.output
    saved = re.search(
        r"exit-duration: saved iteration (\d+) ([\d.]+) s after the job start", run.output
    )
    assert saved and int(saved.group(1)) == last, run.output[-3000:]
    assert float(saved.group(2)) < 60 * limit_min, saved.group(0)
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(last)
    assert (ckpt / f"iter_{last:07d}" / "common.json").is_file()


def test_stopped_rank_times_out_and_keeps_the_last_checkpoint(train_args, tmp_path):
    jsonl, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    args = [*train_args, "--train-iters", "400", "--exit-interval", "400"]
    args += ["--save", str(ckpt), "--distributed-timeout-minutes", "0.1"]
    with _job(_torchrun(args, jsonl), tmp_path) as job:
        job.wait_for_lines(jsonl, SAVE_INTERVAL + 1)
        stopped = job.ranks()[1]
        os.kill(stopped, signal.SIGSTOP)
        deadline = time.monotonic() + 240
        while "error: rank 0:" not in job.output() and job.proc.poll() is None:
            assert time.monotonic() < deadline, job.output()[-4000:]
            time.sleep(0.1)
        # The stopped rank cannot act on torchrun's SIGTERM; torchrun would SIGKILL it after
        # 30 s (its shutdown timeout), which the test does at once.
        os.kill(stopped, signal.SIGKILL)
        returncode = job.wait()
    output = job.output()
    assert returncode != 0, output[-4000:]
    lines = [line for line in output.splitlines() if line.startswith("error: rank 0:")]
    assert len(lines) == 1, output[-4000:]
    assert "did not complete within --distributed-timeout-minutes 0.1 (6 s)" in lines[0]
    assert re.search(r"over ranks (\[0, 1\]|0\.\.1)", lines[0]), lines[0]
    latest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert latest >= SAVE_INTERVAL and latest % SAVE_INTERVAL == 0
    assert f"last complete checkpoint is iteration {latest}" in lines[0]
    assert (ckpt / f"iter_{latest:07d}" / "common.json").is_file()
    # A save the stop interrupted may be left as iter_N.tmp (N > latest); the next save removes it.
    assert all(int(p.name[5:12]) > latest for p in ckpt.glob("iter_*.tmp"))


def test_torchrun_restarts_after_sigkill_and_resumes(train_args, reference, tmp_path):
    jsonl, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    args = [*train_args, "--save", str(ckpt), "--load", str(ckpt)]
    with _job(_torchrun(args, jsonl, "--max-restarts", "2"), tmp_path) as job:
        job.wait_for_lines(jsonl, SAVE_INTERVAL + 2)
        # The ranks are frozen while rank 1 is killed (an iteration takes about 50 ms): what
        # was saved and trained at the kill is then known exactly.
        ranks = job.ranks()
        for pid in ranks.values():
            os.kill(pid, signal.SIGSTOP)
        trained = len(_records(jsonl))
        saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
        os.kill(ranks[1], signal.SIGKILL)
        os.kill(ranks[0], signal.SIGCONT)
        returncode = job.wait()
    output = job.output()
    assert returncode == 0, output[-4000:]
    resumed = re.search(r"restart 1 of --max-restarts 2\) after a rank failed: resuming from "
                        r"iteration (\d+)", output)  # fmt: skip
    assert resumed, output[-4000:]
    start = int(resumed.group(1))
    assert start == saved and trained - start <= SAVE_INTERVAL, (start, saved, trained)
    assert "loaded checkpoint" in output and f"(iteration {start}," in output
    losses = {r["iteration"]: r["loss"] for r in _records(jsonl)}
    assert sorted(losses) == list(range(1, ITERS + 1))
    for it in range(start + 1, ITERS + 1):  # trained again after the restart
        assert losses[it] == reference[it], f"iteration {it}: {losses[it]} != {reference[it]}"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
