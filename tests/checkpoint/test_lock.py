"""One run per --save (megatron_ext/checkpoint/lock.py).

In this process: the lock is created with its holder, a second taker is refused naming it,
release removes it; a lock whose holder is gone is taken over with one warning (same host: the
pid no longer runs, also a reused pid; another host: the lease is older than LEASE_SECONDS);
the same job (Slurm job id, torchrun's run or agent) takes it over with an info line; an
unreadable lock is refused; a run whose lock was taken over learns it before saving;
`break_lock` refuses a running holder unless forced.

With real processes: two runs at once on one --save (the second exits 2 with one line naming
the first, which runs on), the stale lock of a job killed outright (SIGKILL to every process)
taken over by the next run with one warning, a restart under `torchrun --max-restarts 2` with
the lock held taken over silently, and `tools/convert_checkpoint.py unlock`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from megatron_ext.checkpoint import lock as L
from megatron_ext.checkpoint.io_errors import SaveLockError
from tests.support.jobs import launch
from tests.support.runs import ENTRY_MODULE, TINY_MOCK_RUN, run_command, run_tool


def _plant(root: Path, **changes) -> L.LockHolder:
    """A lock file in `root` held by someone else (this process, changed by `changes`)."""
    holder = dataclasses.replace(L.LockHolder.me(), **changes)
    root.mkdir(parents=True, exist_ok=True)
    (root / L.LOCK_FILENAME).write_text(json.dumps(dataclasses.asdict(holder)))
    return holder


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture(autouse=True)
def _no_job(monkeypatch):
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def test_taken_refused_and_released(tmp_path):
    root = tmp_path / "ckpt"
    lock = L.SaveLock.acquire(str(root))
    try:
        held = L.read_lock(str(root))
        assert (held.host, held.pid, held.job_id) == (socket.gethostname(), os.getpid(), None)
        with pytest.raises(SaveLockError) as caught:
            L.SaveLock.acquire(str(root))
        message = str(caught.value)
        assert f"is in use by another run: pid {os.getpid()} on host {socket.gethostname()}, " \
            "started " in message, message  # fmt: skip
        assert f"python tools/convert_checkpoint.py unlock --save {root}" in message
    finally:
        lock.release()
    assert not (root / L.LOCK_FILENAME).exists()
    assert sorted(os.listdir(root)) == []  # no temporary files left
    L.SaveLock.acquire(str(root)).release()


def test_a_gone_holder_is_taken_over_with_one_warning(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="megatron_ext.checkpoint.lock")
    dead = _dead_pid()
    cases = {
        "dead_pid": (dict(pid=dead), f"pid {dead} on this host is not running"),
        # this very pid, but another process start time: the pid was reused
        "reused_pid": (dict(pid_start=1), f"pid {os.getpid()} on this host is not running"),
        "stale_lease": (
            dict(host="elsewhere", renewed=time.time() - L.LEASE_SECONDS - 100),
            r"its lease on host elsewhere was last renewed 4\d\d s ago \(stale after 300 s\)",
        ),
    }
    for name, (changes, why) in cases.items():
        root = tmp_path / name
        _plant(root, **changes)
        caplog.clear()
        lock = L.SaveLock.acquire(str(root))
        assert L.read_lock(str(root)).token == lock.holder.token
        lock.release()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, (name, warnings)
        assert "taking over the lock of a run that is gone" in warnings[0], warnings
        assert re.search(why, warnings[0]), (name, warnings[0])


def test_a_live_holder_elsewhere_is_refused(tmp_path):
    _plant(tmp_path, host="node17", pid=4242, renewed=time.time() - 20, job_id="slurm:9")
    with pytest.raises(SaveLockError, match=r"pid 4242 on host node17 \(job slurm:9\), started "):
        L.SaveLock.acquire(str(tmp_path))


def test_the_same_job_takes_its_lock_over(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="megatron_ext.checkpoint.lock")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    _plant(tmp_path, host="node3", pid=1, job_id="slurm:77")  # a requeue on another node
    L.SaveLock.acquire(str(tmp_path)).release()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "taking over the lock of this job's previous run (pid 1 on host node3, started " in (
        caplog.text
    )
    # The same job, but its holder still runs on this host: another run of it (two steps).
    _plant(tmp_path, job_id="slurm:77")
    with pytest.raises(SaveLockError, match="is in use by another run"):
        L.SaveLock.acquire(str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id
    assert L.current_job_id().startswith(f"torchrun-agent:{socket.gethostname()}:{os.getppid()}:")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert L.current_job_id() == "torchrun:abc"


def test_an_unreadable_lock_is_refused(tmp_path):
    (tmp_path / L.LOCK_FILENAME).write_text('{"host": "x"}')
    with pytest.raises(SaveLockError, match="which is not a lock file"):
        L.SaveLock.acquire(str(tmp_path))


def test_a_lock_taken_over_is_noticed_before_saving(tmp_path):
    lock = L.SaveLock.acquire(str(tmp_path))
    lock.check()  # still ours
    other = _plant(tmp_path, host="node9", pid=99)
    with pytest.raises(SaveLockError, match=r"is no longer this run's \(now: pid 99 on host node9"):
        lock.check()
    lock.release()
    assert L.read_lock(str(tmp_path)).token == other.token  # not ours: left alone


def test_break_lock(tmp_path):
    _plant(tmp_path)  # held by this (running) process
    with pytest.raises(SaveLockError, match="held by a running process"):
        L.break_lock(str(tmp_path))
    assert L.break_lock(str(tmp_path), force=True).startswith(f"pid {os.getpid()} on host")
    _plant(tmp_path, pid=_dead_pid())
    assert L.break_lock(str(tmp_path)) is not None
    assert L.break_lock(str(tmp_path)) is None  # no lock left


# ------------------------------------------------------------------------- real processes

TINY = TINY_MOCK_RUN


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.integration
def test_two_runs_then_a_killed_job(tmp_path):
    jsonl = tmp_path / "first.jsonl"
    first = [*TINY, "--train-iters", "100000", "--global-batch-size", "4", "--save", "ckpt"]
    first += ["--log-jsonl", str(jsonl)]
    with launch(ENTRY_MODULE, 2, first, cwd=tmp_path, signal_targets="job") as job:
        job.wait_for_lines(jsonl, 2)
        holder = job.ranks()[0]
        second = [*TINY, "--train-iters", "4", "--save", "ckpt"]
        other = run_command(ENTRY_MODULE, second, tmp_path)
        assert other.returncode == 2, other.stdout[-3000:] + other.stderr[-3000:]
        errors = _errors(other.stderr)
        assert len(errors) == 1 and "Traceback" not in other.stderr, other.stderr[-3000:]
        assert errors[0].startswith(
            f"error: --save ckpt is in use by another run: pid {holder} on host "
            f"{socket.gethostname()} (job torchrun-agent:"
        ), errors[0]
        assert "convert_checkpoint.py unlock --save ckpt" in errors[0]
        assert job.returncode is None  # the first run goes on
        assert len(job.send_signal(signal.SIGKILL, "job")) >= 3  # agent and both ranks
        job.wait()
    assert L.read_lock(str(tmp_path / "ckpt")).pid == holder  # left behind

    third = [*TINY, "--train-iters", "4", "--save", "ckpt", "--load", "ckpt"]
    run = run_command(ENTRY_MODULE, third, tmp_path, merge_stderr=True)
    assert run.returncode == 0, run.stdout[-3000:]
    lines = [line for line in run.stdout.splitlines() if "--save ckpt" in line]
    assert len(lines) == 1, lines
    assert f"WARNING: --save ckpt: taking over the lock of a run that is gone (pid {holder} on " \
        "this host is not running)" in lines[0], lines  # fmt: skip
    assert not (tmp_path / "ckpt" / L.LOCK_FILENAME).exists()

    # Breaking a lock by hand: refused while its holder runs here, unless forced.
    _plant(tmp_path / "ckpt")
    refused = run_tool("convert_checkpoint.py", ["unlock", "--save", "ckpt"], tmp_path)
    assert refused.returncode == 2 and "is held by a running process" in refused.stderr
    forced = run_tool("convert_checkpoint.py", ["unlock", "--save", "ckpt", "--force"], tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert f"unlock: removed the lock of ckpt (held by pid {os.getpid()}" in forced.stdout
    assert not (tmp_path / "ckpt" / L.LOCK_FILENAME).exists()


@pytest.mark.integration
def test_a_torchrun_restart_takes_the_lock_over(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    args = [*TINY, "--train-iters", "100", "--save-interval", "10", "--save", "ckpt"]
    args += ["--load", "ckpt", "--log-jsonl", str(jsonl)]
    with launch(
        ENTRY_MODULE, 1, args, cwd=tmp_path, torchrun=True, torchrun_args=["--max-restarts", "2"]
    ) as job:
        job.wait_for_lines(jsonl, 12)
        rank0 = job.ranks()[0]
        assert L.read_lock(str(tmp_path / "ckpt")).pid == rank0
        os.kill(rank0, signal.SIGKILL)  # it cannot remove its lock
        assert job.wait() == 0, job.output()[-4000:]
    output = job.output()
    assert "restart 1 of --max-restarts 2" in output, output[-4000:]
    assert "--save ckpt: taking over the lock of this job's previous run" in output
    assert f"pid {rank0} on host" in output
    assert "WARNING: --save" not in output
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "100"
    assert not (tmp_path / "ckpt" / L.LOCK_FILENAME).exists()
