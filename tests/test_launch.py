"""megatron_ext.launch with a small entry script: the environment each rank gets,
signals delivered to the ranks / torchrun / the whole job (workers included), and the kill on
timeout that leaves nothing running."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from megatron_ext.launch import PACKAGE_ROOT, child_pids, job_environment
from tests.support.distributed import find_free_port
from tests.support.jobs import Job, count_records, launch, process_state

pytestmark = pytest.mark.integration

# Each rank starts one worker child and records {"who", "pid", "rank", ...}; a worker records
# {"who": "worker", "ready": true} once its handler is installed (a signal sent earlier would
# kill it unrecorded). On SIGTERM each records who got it and exits 0.
ENTRY = """
import json, os, signal, subprocess, sys, time
out = os.environ["LAUNCH_TEST_OUT"]
def record(**kw):
    with open(out, "a") as f:
        f.write(json.dumps(kw) + "\\n")
role = sys.argv[1] if len(sys.argv) > 1 else "rank"
def on_term(signum, frame):
    record(who=role, got="SIGTERM", rank=os.environ.get("RANK"))
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
if role == "worker":  # its handler is in place: the test may signal from now on
    record(who="worker", ready=True)
if role == "rank":
    worker = subprocess.Popen([sys.executable, __file__, "worker"])
    record(who="rank", pid=os.getpid(), rank=os.environ.get("RANK"),
           world=os.environ.get("WORLD_SIZE"), port=os.environ.get("MASTER_PORT"),
           path=os.environ.get("PYTHONPATH", "").split(os.pathsep)[0], worker=worker.pid)
time.sleep(float(os.environ.get("LAUNCH_TEST_SLEEP", "60")))
"""


def _entry(tmp_path: Path) -> Path:
    path = tmp_path / "entry.py"
    path.write_text(ENTRY)
    return path


def _lines(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z")


@pytest.mark.parametrize("targets", ["ranks", "agent", "job"])
def test_sigterm_reaches_the_targets_a_cluster_would_signal(tmp_path, targets):
    out = tmp_path / "out.jsonl"
    env = {"LAUNCH_TEST_OUT": str(out)}
    with launch(_entry(tmp_path), 2, [], env=env, signal_targets=targets, cwd=tmp_path,
                timeout=120) as job:  # fmt: skip
        job.wait_for_lines(out, 4)  # two ranks and their two workers, handlers installed
        ranks = job.ranks()
        assert sorted(ranks) == [0, 1]
        workers = job.workers()
        assert all(len(pids) == 1 for pids in workers.values()), workers
        sent = job.send_signal(signal.SIGTERM)
        job.wait()
    started = [r for r in _lines(out) if r["who"] == "rank" and "pid" in r]
    assert sorted(r["rank"] for r in started) == ["0", "1"]
    assert {r["world"] for r in started} == {"2"} and len({r["port"] for r in started}) == 1
    assert {r["path"] for r in started} == {str(PACKAGE_ROOT)}  # the caller's megatron_ext
    got = sorted((r["who"], r["rank"]) for r in _lines(out) if r.get("got") == "SIGTERM")
    if targets == "ranks":
        assert sent == list(ranks.values())
        assert got == [("rank", "0"), ("rank", "1")]
    elif targets == "agent":  # torchrun forwards SIGTERM to each rank's process group
        assert sent == [job.pid]
        assert sorted(who for who, _ in got) == ["rank", "rank", "worker", "worker"]
    else:  # workers first, then ranks, then torchrun
        assert sent[-1] == job.pid and set(sent[:2]) == {p for w in workers.values() for p in w}
        # A process may record twice: the signal sent to it, then torchrun's forward.
        assert {g for g in got if g[0] == "worker"} == {("worker", "0"), ("worker", "1")}
    for pid in [*ranks.values(), *(p for w in workers.values() for p in w)]:
        assert not _alive(pid), pid


def test_pause_stops_every_process_of_the_job_until_resume(tmp_path):
    """pause / resume (benchmarks/bench_train_step.py --slices): every rank, every DataLoader
    worker and torchrun are stopped (state T), then run on; the job still ends normally."""
    out = tmp_path / "out.jsonl"
    env = {"LAUNCH_TEST_OUT": str(out)}
    with launch(_entry(tmp_path), 2, [], env=env, cwd=tmp_path, timeout=120) as job:
        job.wait_for_lines(out, 4)
        workers = [p for pids in job.workers().values() for p in pids]
        everyone = [*workers, *job.ranks().values(), job.pid]
        assert len(everyone) == 5
        assert sorted(job.pause()) == sorted(everyone)
        assert [process_state(p) for p in everyone] == ["T"] * 5  # pause waits for it
        assert sorted(job.resume()) == sorted(everyone)
        deadline = time.monotonic() + 10  # SIGCONT is delivered asynchronously
        while any(process_state(p) == "T" for p in everyone) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(process_state(p) in "RS" for p in everyone), [process_state(p) for p in everyone]
        job.send_signal(signal.SIGTERM, "job")
        job.wait()
    # Their handlers still ran (once each, or twice where torchrun's forward came before the
    # process had exited).
    got = {(r["who"], r["rank"]) for r in _lines(out) if r.get("got") == "SIGTERM"}
    assert got == {("rank", "0"), ("rank", "1"), ("worker", "0"), ("worker", "1")}


def test_ranks_and_agent_are_found_below_a_wrapper_script(tmp_path):
    """A batch script that runs torchrun (as `srun` does in a Slurm step): ranks() and the
    "agent" target follow script -> torchrun -> ranks."""
    out = tmp_path / "out.jsonl"
    torchrun = (
        f"{sys.executable} -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 "
        f"--master-port {find_free_port()} {_entry(tmp_path)}"
    )
    env = job_environment({"LAUNCH_TEST_OUT": str(out)})
    with Job(["bash", "-c", f"{torchrun}; exit $?"], log_path=tmp_path / "out.log", env=env,
             cwd=tmp_path, torchrun=True, signal_targets="agent", timeout=120) as job:  # fmt: skip
        job.wait_for_lines(out, 4)
        (agent,) = job.agents()
        assert agent != job.pid and agent in child_pids(job.pid)
        ranks = job.ranks()
        assert sorted(ranks) == [0, 1] and all(p in child_pids(agent) for p in ranks.values())
        assert job.send_signal(signal.SIGTERM) == [agent]
        job.wait()  # torchrun forwards SIGTERM to the ranks, then exits with an error itself
    got = sorted(r["who"] for r in _lines(out) if r.get("got") == "SIGTERM")
    assert got == ["rank", "rank", "worker", "worker"]


def test_one_rank_without_torchrun_gets_a_port_and_no_inherited_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "7")
    out = tmp_path / "out.jsonl"
    env = {"LAUNCH_TEST_OUT": str(out), "LAUNCH_TEST_SLEEP": "0"}
    with launch(_entry(tmp_path), 1, [], env=env, cwd=tmp_path, log=tmp_path / "a.log") as job:
        assert job.wait() == 0, job.output()
        assert job.ranks() == {}  # exited
    (record,) = [r for r in _lines(out) if "pid" in r]
    assert record["pid"] == job.pid and record["rank"] is None and int(record["port"]) > 0
    assert (tmp_path / "a.log").exists()


def test_timeout_kills_everything_it_started(tmp_path):
    out = tmp_path / "out.jsonl"
    env = {"LAUNCH_TEST_OUT": str(out)}
    start = time.monotonic()
    # 12 s: the job (torchrun, which imports torch, and four small Python processes) is up well
    # before, and the wait below runs out of it doing nothing.
    with launch(_entry(tmp_path), 2, [], env=env, cwd=tmp_path, timeout=12) as job:
        job.wait_for_lines(out, 4)  # two ranks, two workers
        pids = [job.pid, *job.ranks().values(), *(w for ws in job.workers().values() for w in ws)]
        with pytest.raises(TimeoutError, match="killed after 12 s"):
            job.wait()
    assert time.monotonic() - start < 60
    assert len(pids) == 5 and not any(_alive(pid) for pid in pids)
    assert count_records(out) == 4  # the start-up records only: SIGKILL is not handled


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="nproc must be >= 1"):
        launch("pretrain_leviathan", 0, [])
    with pytest.raises(ValueError, match="more than one rank needs torchrun"):
        launch("pretrain_leviathan", 2, [], torchrun=False)
