"""examples/slurm/*.sbatch submitted with `sbatch` to a real single-host Slurm (slurmctld and
two slurmd on this machine, tests/slurm/conftest.py), tiny CPU model, sizes through the
scripts' own arguments and environment:

- pretrain.sbatch on 2 nodes: one torchrun agent per node, the ranks placed as the script
  says, the job COMPLETED with exit 0;
- pretrain_requeue.sbatch at a time limit: Slurm's warning signal (--signal=USR1@100) reaches
  the ranks, they save, the job requeues itself (`scontrol requeue`), and the requeued job
  (SLURM_RESTART_COUNT=1) resumes and logs the same losses as an uninterrupted job, bit for bit;
- `scancel` of a running job leaves the last complete checkpoint (it verifies) and no
  half-written one under a final name, and the next job on the same --save runs (taking over
  the --save lock if the cancelled job left it);
- a rank that dies ends the job step (srun --kill-on-bad-exit) with torchrun's and srun's lines
  naming it; `scontrol requeue` of the failed job resumes from the last checkpoint;
- pretrain_container.sbatch: what can be checked without pyxis/enroot (docs/cluster.md lists
  the rest): bash -n, `sbatch --test-only` accepts its options, its srun's container options.

Time limits act at the minute and slurmctld checks them every 30 s, sending the warning at the
first check that finds the end within the warning time plus 30 s. The time-limit test submits
with --time=10 --signal=USR1@100 (no warning: the end is 10 minutes away), freezes the ranks
(SIGSTOP) at their first record, once they have their handler (a warning that came before it
would be ignored, as torchrun's SIGUSR1 is), then cuts the limit (`scontrol update`) to 2
minutes past the elapsed minutes: the end is then 60 to 120 s away, within the 130 s, so the
next check (at most 30 s later, before the end) sends the warning. Once it is pending on the
ranks the limit is raised to 30 minutes (no kill however long the save takes, and no warning for
the requeued job on a slow host) and the ranks go on. The ranks are found before they train (the
/proc scan is slow on a busy host) and the run is LONG_ITERS iterations, so that they cannot
finish before the freeze.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cluster import records
from tests.support.distributed import find_free_port
from tests.support.jobs import process_state
from tests.support.runs import REPO, TINY_LEV_MODEL, TINY_TRAIN_DEFAULT_DROPOUT
from tests.support.slurm import Cluster, signal_caught, signal_pending

pytestmark = pytest.mark.integration

SLURM_DIR = REPO / "examples" / "slurm"
ITERS = 40  # long enough (2 to 4 s) for the test to freeze the ranks before the end
LONG_ITERS = 200  # the time-limit test's run: far longer than the freeze takes, on a busy host
SAVE_INTERVAL = 4
# A node without GPUs: the scripts' GPU and CPU counts are overridden on sbatch's command line,
# as a user adapts a script to a partition.
NO_GPUS = ["--gpus-per-node=0", "--cpus-per-task=1"]


@pytest.fixture(scope="module")
def train_args(sample_data) -> list[str]:
    return [
        *TINY_LEV_MODEL, *TINY_TRAIN_DEFAULT_DROPOUT, *sample_data, "--eval-iters", "0",
        "--train-iters", str(ITERS), "--save-interval", str(SAVE_INTERVAL),
    ]  # fmt: skip


def _requeue_job(slurm: Cluster, d: Path, args: list[str], *sbatch: str, **env) -> int:
    """pretrain_requeue.sbatch on one node, 2 ranks, saving to d/ckpt, logging to d/."""
    d.mkdir(parents=True, exist_ok=True)
    flags = [*args, "--save", d / "ckpt", "--load", d / "ckpt", "--log-jsonl", d / "m.jsonl"]
    return slurm.sbatch(
        ["--nodes", "1", *NO_GPUS, f"--output={d}/%x-%j.out", *sbatch,
         SLURM_DIR / "pretrain_requeue.sbatch", *flags],
        env={"NPROC_PER_NODE": 2, "LOG_DIR": d, "MASTER_PORT": find_free_port(), **env},
    )  # fmt: skip


def _output(d: Path, job: int) -> str:
    return (d / f"leviathan-{job}.out").read_text()


def _losses(d: Path) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in records(d / "m.jsonl")}


def _wait_records(
    jsonl: Path, count: int, slurm: Cluster, job: int, timeout: float = 240, poll: float = 0.05
):
    deadline, checked = time.monotonic() + timeout, 0.0
    while len(records(jsonl)) < count:
        if time.monotonic() - checked >= 1:  # scontrol once a second (slow on a busy host)
            checked = time.monotonic()
            info = slurm.job(job)
            assert info["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), info
        assert time.monotonic() < deadline, f"{count} records not written in {timeout} s"
        time.sleep(poll)


class _Reference:
    """An uninterrupted pretrain_requeue.sbatch job (trains ITERS iterations, exits 0, does not
    requeue), submitted at once; `losses()` waits for it, so that it runs beside the job a test
    submits meanwhile (one node each)."""

    def __init__(self, slurm: Cluster, d: Path, args: list[str], iters: int = ITERS):
        self.slurm, self.d, self.job = slurm, d, _requeue_job(slurm, d, args)
        self.iters, self._losses = iters, None

    def losses(self) -> dict[int, float]:
        if self._losses is None:
            info = self.slurm.wait(self.job, timeout=300)
            output = _output(self.d, self.job)
            assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", output[-4000:]
            assert "requeueing" not in output and info["Restarts"] == "0"
            self._losses = _losses(self.d)
            assert sorted(self._losses) == list(range(1, self.iters + 1))
        return self._losses


@pytest.fixture(scope="module")
def reference(slurm, train_args, tmp_path_factory) -> _Reference:
    return _Reference(slurm, tmp_path_factory.mktemp("reference"), train_args)


def _long(train_args: list[str]) -> list[str]:
    return [*train_args, "--train-iters", str(LONG_ITERS), "--save-interval", "50"]


def _ranks_once_started(slurm: Cluster, job: int, nranks: int = 2, timeout: float = 240):
    """The job's ranks (global rank -> pid) as soon as torchrun has started them all."""
    deadline = time.monotonic() + timeout
    while sorted(ranks := slurm.ranks(job)) != list(range(nranks)):
        info = slurm.job(job)
        assert info["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), info
        assert time.monotonic() < deadline, f"{nranks} ranks not started in {timeout} s: {ranks}"
        time.sleep(0.2)
    return ranks


def test_pretrain_sbatch_two_nodes(slurm, sample_data, tmp_path):
    # The recipe's data and tokenizer come from DATA_DIR / TOKENIZER_DIR under the names of
    # the vocabulary ablation's 50k tokenizer; the tiny model's flags follow the recipe's.
    data = tmp_path / "data"
    data.mkdir()
    prefix = Path(sample_data[sample_data.index("--data-path") + 1])
    for f in prefix.parent.glob(prefix.name + "*"):
        (data / f.name.replace(prefix.name, "pile_sp50k_text_document")).symlink_to(f)
    tokenizer = sample_data[sample_data.index("--tokenizer-model") + 1]
    (data / "pile_sp50k.model").symlink_to(tokenizer)
    tiny = [*TINY_LEV_MODEL, "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-samples", "32", "--split", "90,7,3", "--num-workers", "0",
            "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
            "--save-interval", "2", "--data-cache-path", str(tmp_path / "cache")]  # fmt: skip
    env = dict(DATA_DIR=data, TOKENIZER_DIR=data, RUNS_DIR=tmp_path / "runs", GPUS_PER_NODE=1,
               LOG_DIR=tmp_path, MASTER_PORT=find_free_port())  # fmt: skip
    job = slurm.sbatch(
        ["--nodes", "2", *NO_GPUS, f"--output={tmp_path}/%x-%j.out",
         SLURM_DIR / "pretrain.sbatch", "200m", "lev", "50k", *tiny],
        env=env,
    )  # fmt: skip
    info = slurm.wait(job, timeout=300)
    output = (tmp_path / f"leviathan-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", output[-4000:]
    assert info["NodeList"] == "127.0.0.[1-2]" and info["NumNodes"] == "2"
    # One torchrun agent per node (srun --ntasks-per-node=1), GPUS_PER_NODE ranks each: node 0
    # holds rank 0, node 1 rank 1; the two agents met at the first node's rendezvous.
    assert "placement: node 0: rank 0 (local 0: tp 0 dp 0 pp 0)" in output, output[-4000:]
    assert "placement: node 1: rank 1 (local 0: tp 0 dp 1 pp 0)" in output
    assert "layout: world 2 = TP 1 x CP 1 x PP 1 x DP 2" in output
    assert "done (finished)" in output
    ckpt = tmp_path / "runs" / "lev-200m-50k" / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (tmp_path / f"leviathan-{job}.step.log").is_file()


def test_time_limit_warning_saves_requeues_and_resumes(slurm, train_args, tmp_path):
    reference = _Reference(slurm, tmp_path / "reference", _long(train_args), LONG_ITERS)
    # --signal=USR1@100 in place of the script's 120 s; 10 minutes, cut once the ranks have
    # their handler (the module's docstring).
    job = _requeue_job(slurm, tmp_path, _long(train_args), "--time=10", "--signal=USR1@100")
    ranks = _ranks_once_started(slurm, job)
    _wait_records(tmp_path / "m.jsonl", 1, slurm, job, poll=0.01)
    _stop(ranks)
    # They train, so their --exit-signal-handler is set: the warning cannot come before it.
    assert all(signal_caught(p, signal.SIGUSR1) for p in ranks.values()), ranks
    assert len(records(tmp_path / "m.jsonl")) < LONG_ITERS, "the ranks finished before the freeze"
    h, m, sec = map(int, slurm.job(job)["RunTime"].split("-")[-1].split(":"))
    slurm.run("scontrol", "update", f"JobId={job}", f"TimeLimit={h * 60 + m + 2}")
    # Slurm sends the warning at its next check; it may wake the stopped ranks itself
    # (SIGCONT before the signal).
    deadline = time.monotonic() + 120
    while not all(signal_pending(p, signal.SIGUSR1) for p in ranks.values()):
        if any(process_state(p) not in ("T", "t") for p in ranks.values()):
            break
        assert time.monotonic() < deadline, "no SIGUSR1 from Slurm within 120 s"
        time.sleep(0.2)
    # 30 minutes, as an admin extends a job (the module's docstring).
    slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=30")
    for pid in ranks.values():
        os.kill(pid, signal.SIGCONT)
    info = slurm.wait(job, "COMPLETED", timeout=900, restarts=1)  # 200 iterations, slow hosts
    output = _output(tmp_path, job)
    assert info["ExitCode"] == "0:0" and info["Restarts"] == "1", output[-4000:]
    stopped = re.search(r"exiting at iteration (\d+) \(signal\)", output)
    assert stopped, output[-4000:]
    last = int(stopped.group(1))
    assert 1 <= last < LONG_ITERS
    assert f"saved a checkpoint on the time-limit warning; requeueing job {job}" in output
    assert f"job {job} start (requeue count 1)" in output
    assert re.search(rf"loaded checkpoint \S+iter_{last:07d} \(iteration {last},", output)
    assert (tmp_path / f"leviathan-{job}.step1.log").is_file()
    losses, want = _losses(tmp_path), reference.losses()
    assert sorted(losses) == list(range(1, LONG_ITERS + 1))
    for it in range(1, LONG_ITERS + 1):  # bit for bit, the resumed iterations included
        assert losses[it] == want[it], f"iteration {it}: {losses[it]} != {want[it]}"


def _stop(ranks: dict[int, int], timeout: float = 60) -> None:
    """SIGSTOP the ranks and wait until they are stopped (a busy host delivers it late)."""
    for pid in ranks.values():
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while any(process_state(p) not in ("T", "t") for p in ranks.values()):
        assert time.monotonic() < deadline, {p: process_state(p) for p in ranks.values()}
        time.sleep(0.01)


def _verify(ckpt: Path, iteration: int) -> None:
    proc = subprocess.run(
        [sys.executable, "tools/convert_checkpoint.py", "verify",
         "--load", str(ckpt), "--iteration", str(iteration)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "match their digests" in proc.stdout, proc.stdout + proc.stderr


def test_scancel_keeps_the_last_checkpoint_and_the_next_job_takes_over(slurm, train_args, tmp_path):
    long = [*train_args, "--train-iters", "400", "--exit-interval", "400", "--save-interval", "1"]
    job = _requeue_job(slurm, tmp_path, long)
    _wait_records(tmp_path / "m.jsonl", 6, slurm, job)
    slurm.run("scancel", str(job))  # SIGTERM to every process, SIGKILL after KillWait (5 s)
    info = slurm.wait(job, timeout=120)
    assert info["JobState"] == "CANCELLED", info
    ckpt = tmp_path / "ckpt"
    latest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert latest >= 1
    _verify(ckpt, latest)
    # Anything half-written is an iter_N.tmp newer than the last complete checkpoint (never
    # loaded; the next save removes it); every final iter_N is complete.
    assert all(int(p.name[5:12]) > latest for p in ckpt.glob("iter_*.tmp"))
    for final in ckpt.glob("iter_???????"):
        assert (final / "common.json").is_file(), final
    left_lock = (ckpt / "save.lock").exists()

    nxt = _requeue_job(slurm, tmp_path, [*long, "--exit-interval", str(latest + 2)])
    info = slurm.wait(nxt, timeout=300)
    output = _output(tmp_path, nxt)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", output[-4000:]
    assert re.search(rf"loaded checkpoint \S+iter_{latest:07d} \(iteration {latest},", output)
    assert "is in use by another run" not in output
    if left_lock:  # the cancelled ranks were killed before they released it
        assert "taking over the lock of a run that is gone" in output, output[-4000:]
    assert not (ckpt / "save.lock").exists()
    assert int((ckpt / "latest_checkpointed_iteration.txt").read_text()) == latest + 2


def test_a_dead_rank_ends_the_step_and_a_requeue_resumes(slurm, train_args, reference, tmp_path):
    job = _requeue_job(slurm, tmp_path, train_args, MAX_RESTARTS=0)
    ranks = _ranks_once_started(slurm, job)
    _wait_records(tmp_path / "m.jsonl", SAVE_INTERVAL + 1, slurm, job, poll=0.01)
    _stop(ranks)
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    os.kill(ranks[1], signal.SIGKILL)
    os.kill(ranks[0], signal.SIGCONT)
    info = slurm.wait(job, timeout=120)
    output = _output(tmp_path, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", output[-4000:]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: -9", output), output[-4000:]
    assert re.search(r"srun: error: 127\.0\.0\.\d: task 0: Exited with exit code 1", output)
    assert "requeueing" not in output

    slurm.run("scontrol", "requeue", str(job))
    info = slurm.wait(job, "COMPLETED", timeout=900, restarts=1)  # 200 iterations, slow hosts
    output = _output(tmp_path, job)
    assert f"job {job} start (requeue count 1)" in output
    assert re.search(rf"loaded checkpoint \S+iter_{saved:07d} \(iteration {saved},", output)
    losses, want = _losses(tmp_path), reference.losses()
    assert sorted(losses) == list(range(1, ITERS + 1))
    for it in range(saved + 1, ITERS + 1):
        assert losses[it] == want[it], f"iteration {it}: {losses[it]} != {want[it]}"


def test_container_script_is_accepted_by_sbatch(slurm, tmp_path):
    script = SLURM_DIR / "pretrain_container.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # sbatch parses every #SBATCH line and asks slurmctld whether the job could run (here with
    # the GPUs and node count overridden, as on a partition of this cluster).
    proc = slurm.run("sbatch", "--test-only", "--nodes", "1", "--ntasks-per-node", "2",
                     *NO_GPUS, str(script), "--model-size", "1.2b")  # fmt: skip
    assert re.search(r"Job \d+ to start at .* on nodes 127\.0\.0\.", proc.stderr), proc.stderr
    text = script.read_text()
    directives = dict(
        line[len("#SBATCH --") :].split("=", 1)
        for line in text.splitlines()
        if line.startswith("#SBATCH --") and "=" in line
    )
    assert directives["signal"] == "TERM@300" and directives["time"] == "24:00:00"
    # srun's container options, as the shell expands them (IMAGE/DATA/CKPT/LOGS given).
    env = {"IMAGE": "/images/leviathan.sqsh", "DATA": "/data/pile", "CKPT": "/ckpt/run",
           "LOGS": "/logs/run", "SLURM_SUBMIT_DIR": str(tmp_path)}  # fmt: skip
    srun = text[text.index("srun --kill-on-bad-exit") :]
    lines = [line.strip().rstrip("\\") for line in srun.splitlines() if "--container-" in line]
    words = shlex.split(_with(env, " ".join(lines)))
    options = dict(w[2:].split("=", 1) for w in words if w.startswith("--container-"))
    assert options["container-image"] == "/images/leviathan.sqsh"
    mounts = [m.split(":") for m in options["container-mounts"].split(",")]
    assert mounts == [["/data/pile", "/data"], ["/ckpt/run", "/ckpt"], ["/logs/run", "/logs"]]
    assert all(os.path.isabs(src) and os.path.isabs(dst) for src, dst in mounts)
    assert options["container-workdir"] == "/workspace/leviathan"
    # The task's command: ranks from Slurm's variables, the training entry inside the image.
    assert "export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID" in srun
    assert "--save /ckpt --load /ckpt" in srun and "--exit-signal-handler" in srun


def _with(env: dict, text: str) -> str:
    """`text` with $NAME and "$NAME" of `env` substituted (the rest left as written)."""
    for key, value in env.items():
        text = text.replace(f'"${key}"', value).replace(f"${key}", value)
    return text


def test_a_stopped_cluster_leaves_nothing_running(slurm, tmp_path, tmp_path_factory):
    """scripts/slurm_local.sh stop with a job running: the job is cancelled, the daemons stop,
    and `pgrep` finds none of the cluster's processes (a second, one-node cluster)."""
    # slurmd's sockets live under DIR (at most 108 characters): a short one, as the session's.
    directory = tmp_path_factory.mktemp("slurm")
    other = Cluster.start(directory, nodes=1)
    try:
        job = other.sbatch(["--wrap", "sleep 600", f"--output={tmp_path}/sleep-%j.out"])
        other.wait(job, "RUNNING", timeout=60)
        # RUNNING is set before slurmstepd has started the batch script: wait for its processes.
        deadline = time.monotonic() + 120
        while (
            not (other.processes(job) and any("sleep 600" in line for line in other.leftovers()))
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        assert other.processes(job), "the job's processes"
        assert sorted(other.daemons()) == ["munged", "slurmctld", "slurmd-127.0.0.1"]
        running = other.leftovers()
        assert any("sleep 600" in line for line in running), running
    finally:
        other.stop()
    assert other.leftovers() == []
    for name, pid in [("slurmctld", "slurmctld.pid"), ("slurmd", "slurmd-127.0.0.1.pid")]:
        pgrep = subprocess.run(["pgrep", "-F", str(directory / pid)], capture_output=True)
        assert pgrep.returncode == 1, f"{name} still runs"
