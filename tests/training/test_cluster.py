"""Cluster resilience with real processes (2 gloo ranks under torch.distributed.run):

- --exit-duration-in-mins saves and exits 0 before the limit, counted from the job start with
  the save included; --exit-interval saves and exits 0 (the reference run);
- a SIGSTOPped rank makes the other fail within --distributed-timeout-minutes (0.1 = 6 s) with
  one line naming the timeout and the group; torchrun exits non-zero; the last checkpoint is
  intact;
- torchrun --max-restarts 2 after a SIGKILLed rank: the ranks restart, resume by themselves from
  the latest checkpoint (--load = --save) and train the same losses as an uninterrupted run;
- examples/slurm/pretrain_requeue.sbatch, with `srun` and `scontrol` replaced by small scripts:
  SIGUSR1 to every process of the step saves and exits 0, the job requeues itself, and the
  requeued job resumes with the same losses.

One uninterrupted 2-rank run (the reference, 12 iterations, a checkpoint every 4) is shared by
the checks that compare losses. The two-agent (--nnodes 2) run is in test_cluster_nodes.py, a
module of its own so that pytest-xdist (--dist loadfile) can run it beside this one.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import time
from pathlib import Path

import pytest

from megatron_ext.launch import descendant_pids
from tests.support.cluster import TORCHRUN
from tests.support.cluster import cluster_job as _job
from tests.support.cluster import records as _records
from tests.support.cluster import torchrun_cmd as _torchrun
from tests.support.distributed import find_free_port
from tests.support.runs import REPO, TINY_LEV_MODEL, TINY_TRAIN, launch

pytestmark = pytest.mark.integration

ITERS = 12
SAVE_INTERVAL = 4


@pytest.fixture(scope="module")
def train_args(corpus) -> list[str]:
    """Every run asks for the same schedule (so that losses compare) and stops at ITERS."""
    return [
        *TINY_LEV_MODEL, *TINY_TRAIN, *corpus, "--eval-iters", "0",
        "--exit-interval", str(ITERS), "--save-interval", str(SAVE_INTERVAL),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(train_args, tmp_path_factory) -> dict[int, float]:
    """An uninterrupted 2-rank run: --exit-interval saves and exits 0."""
    d = tmp_path_factory.mktemp("reference")
    jsonl = d / "metrics.jsonl"
    args = [*train_args, "--save", str(d / "ckpt")]
    with _job(_torchrun(args, jsonl), d) as job:
        assert job.wait() == 0, job.output()[-4000:]
    assert f"exiting at iteration {ITERS} (exit-interval)" in job.output()
    assert (d / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    losses = {r["iteration"]: r["loss"] for r in _records(jsonl)}
    assert sorted(losses) == list(range(1, ITERS + 1))
    return losses


def test_exit_duration_saves_and_exits_before_the_limit(corpus, tmp_path):
    # 30 s: start-up alone took up to 20 s on a loaded 2-core machine; the run is sized to
    # outlast the limit on a fast one (about 60 ms an iteration).
    limit_min = 0.5
    args = [*TINY_LEV_MODEL, *TINY_TRAIN, *corpus, "--eval-iters", "0", "--train-iters", "5000"]
    args += ["--exit-duration-in-mins", str(limit_min), "--save", str(tmp_path / "ckpt")]
    run = launch(1, args, tmp_path).check()
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


def _fake_slurm(bin_dir: Path, requeued: Path) -> None:
    """`srun` runs its command once (one node); `scontrol` answers `show hostnames` and records
    `requeue`."""
    bin_dir.mkdir()
    scripts = {
        "srun": '#!/usr/bin/env bash\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n',
        "scontrol": (
            "#!/usr/bin/env bash\n"
            'if [ "$1" = show ]; then echo 127.0.0.1; exit 0; fi\n'
            f'echo "$*" >> {requeued}\n'
        ),
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)


def test_slurm_usr1_saves_requeues_and_resumes(train_args, reference, tmp_path):
    requeued = tmp_path / "requeued.txt"
    _fake_slurm(tmp_path / "bin", requeued)
    jsonl, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    args = [*train_args, "--save", str(ckpt), "--load", str(ckpt), "--log-jsonl", str(jsonl)]
    script = [str(REPO / "examples" / "slurm" / "pretrain_requeue.sbatch"), *args]
    env = dict(
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        ROOT=str(REPO), NPROC_PER_NODE="2", MASTER_PORT=str(find_free_port()),
        TORCHRUN=" ".join(TORCHRUN), SLURM_JOB_ID="4242", SLURM_JOB_NAME="i27-test",
        SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost",
    )  # fmt: skip
    env["LOG_DIR"] = str(tmp_path / "logs")
    with _job(["bash", *script], tmp_path / "job1", env) as job:
        job.wait_for_lines(jsonl, 2)
        torchrun = job.agents()  # batch script -> srun stand-in -> torchrun
        assert len(torchrun) == 1 and sorted(job.ranks()) == [0, 1]
        step = [torchrun[0], *descendant_pids(torchrun[0])]  # the step, as Slurm signals it
        # The 12 iterations take about a second: the step is frozen while every process gets
        # SIGUSR1, so that a slow test process cannot lose the race against the run's end.
        for sig in (signal.SIGSTOP, signal.SIGUSR1, signal.SIGCONT):
            for pid in step:
                os.kill(pid, sig)
        assert job.wait() == 0, job.output()[-4000:]
    first = job.output()
    stopped = re.search(r"exiting at iteration (\d+) \(signal\)", first)
    assert stopped and "requeueing job 4242" in first, first[-4000:]
    assert requeued.read_text().split() == ["requeue", "4242"]
    last = int(stopped.group(1))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(last)

    env.update(SLURM_RESTART_COUNT="1", MASTER_PORT=str(find_free_port()))
    with _job(["bash", *script], tmp_path / "job2", env) as job:
        assert job.wait() == 0, job.output()[-4000:]
    second = job.output()
    assert "requeue count 1" in second and "requeueing" not in second
    assert "loaded checkpoint" in second and f"iteration {last}" in second
    assert requeued.read_text().split() == ["requeue", "4242"]  # not requeued again
    losses = {r["iteration"]: r["loss"] for r in _records(jsonl)}
    assert sorted(losses) == list(range(1, ITERS + 1))
    for it in range(last + 1, ITERS + 1):
        assert losses[it] == reference[it], f"iteration {it}: {losses[it]} != {reference[it]}"
