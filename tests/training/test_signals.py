"""SIGTERM delivered the three ways a cluster delivers it, to a 2-rank run under
torch.distributed.run with real DataLoader workers (--num-workers 2) and --exit-signal-handler:

- to the rank processes only (`kill` of the training processes): the DP=2 run of
  test_end_to_end.py, which also resumes from the checkpoint it saves;
- to torchrun only (it forwards SIGTERM to each rank's process group: ranks and their workers);
- to every process of the job, DataLoader workers included (Slurm at --signal=TERM@... or at
  the time limit).

In each case the run finishes the current iteration, saves it, and every rank exits 0.
torchrun itself exits 0 when only the ranks were signalled; when it was signalled itself it
reports the signal (exit 1, "Received 15 death signal" and a SignalException traceback) after
its ranks exited 0:
docs and examples/slurm/pretrain.sbatch rely on exactly this.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.support.jobs import launch
from tests.support.runs import ENTRY_MODULE
from tests.support.runs import TINY_LEV_MODEL as MODEL
from tests.support.runs import TINY_TRAIN as TRAIN

pytestmark = pytest.mark.integration
# Long enough that the signal, sent once iteration 2 is logged, always lands mid-run: at 30
# iterations (TINY_TRAIN) a quiet machine finished the run in about a second, before the
# process-tree walk that finds torchrun had delivered it.
ITERS = 1000
_AT = TRAIN.index("--train-iters") + 1
TRAIN = [*TRAIN[:_AT], str(ITERS), *TRAIN[_AT + 1 :]]

RANK_ENTRY = Path(__file__).with_name("_rank_entry.py")


def _records(jsonl: Path) -> list[dict]:
    if not jsonl.exists():
        return []
    lines = jsonl.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


def _run_and_signal(delivery: str, args: list[str], workdir: Path, timeout: float = 240):
    """Launch 2 ranks, SIGTERM as `delivery` says once iteration 2 is logged; return
    (torchrun exit code, output, {rank: recorded exit}, workers per rank at the signal,
    last logged iteration)."""
    workdir.mkdir(parents=True)
    jsonl, exits = workdir / "metrics.jsonl", workdir / "exits"
    exits.mkdir()
    env = {"LEVIATHAN_TEST_EXIT_DIR": str(exits)}
    args = [*args, "--log-jsonl", str(jsonl)]
    # "job": every process, DataLoader workers first as in the failure report.
    targets = {"torchrun": "agent"}.get(delivery, delivery)
    with launch(
        RANK_ENTRY, 2, args, env=env, signal_targets=targets, timeout=timeout, cwd=workdir
    ) as job:
        job.wait_for_lines(jsonl, 2)
        workers = [len(pids) for pids in job.workers().values()]
        assert len(job.send_signal(signal.SIGTERM)) >= 1
        returncode = job.wait()
    ranks_exit = {p.name: p.read_text() for p in sorted(exits.iterdir())}
    last = max((r["iteration"] for r in _records(jsonl)), default=0)
    return returncode, job.output(), ranks_exit, workers, last


@pytest.mark.parametrize("delivery", ["torchrun", "job"])
def test_sigterm_saves_and_every_rank_exits_zero(delivery, corpus, tmp_path):
    d = tmp_path / delivery
    args = [*MODEL, *TRAIN, *corpus, "--num-workers", "2", "--exit-signal-handler"]
    args += ["--save", str(d / "ckpt"), "--eval-iters", "0"]
    returncode, output, ranks_exit, workers, last = _run_and_signal(delivery, args, d)

    assert workers == [2, 2], f"expected 2 DataLoader workers per rank, saw {workers}"
    assert ranks_exit == {"rank0": "0", "rank1": "0"}, f"{ranks_exit}\n{output[-5000:]}"
    assert "DataLoader worker" not in output, output[-5000:]
    # The only traceback allowed is torchrun's own report of the signal it received.
    assert output.count("Traceback") == output.count("SignalException: Process"), output[-5000:]
    assert 2 <= last < ITERS, f"SIGTERM landed at iteration {last}"
    assert f"exiting at iteration {last} (signal)" in output
    ckpt = d / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(last)
    assert (ckpt / f"iter_{last:07d}" / "common.json").is_file()
    assert not list(ckpt.glob("*.tmp"))
    assert not (ckpt / "save.lock").exists()  # the run released --save on its way out
    # torchrun was signalled itself: it says so in its exit status (see the docstring)
    assert returncode == 1 and "Received 15 death signal" in output, output[-3000:]


def test_ctrl_c_says_what_was_kept_and_what_was_lost(corpus, tmp_path):
    """Ctrl-C in the terminal: SIGINT to torchrun's process group (torchrun passes it on to
    each rank's). One line from rank 0 names the last complete checkpoint and the iterations
    after it that were lost; no rank's traceback; --save is left complete and unlocked.

    A save every iteration, and the signal sent while one is being written (its
    iter_XXXXXXX.tmp exists), so that Ctrl-C lands in a save (this one or the next) on every
    run: the partial save must not be left behind."""
    ckpt, jsonl = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    args = [*MODEL, *TRAIN, *corpus, "--save", str(ckpt), "--save-interval", "1"]
    args += ["--eval-iters", "0", "--log-jsonl", str(jsonl)]
    with launch(ENTRY_MODULE, 2, args, signal_targets="agent", cwd=tmp_path) as job:
        job.wait_for_lines(jsonl, 5)
        while not list(ckpt.glob("iter_*.tmp")):
            assert job.proc.poll() is None, job.output()[-4000:]
            time.sleep(0.001)
        job.send_signal(signal.SIGINT)
        job.wait()
        output = job.output()
    last = max(r["iteration"] for r in _records(jsonl))
    latest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    lines = [line for line in output.splitlines() if line.startswith("interrupted")]
    assert len(lines) == 1, output[-5000:]
    assert 1 <= latest <= last < ITERS, (latest, last)
    kept = f"kept the last complete checkpoint, iteration {latest} in --save {ckpt}"
    if latest < last:
        lost = f"iterations {latest + 1}-{last} were" if latest + 1 < last else f"{last} was"
        assert kept in lines[0] and lost in lines[0] and "lost" in lines[0], lines[0]
    else:
        assert "nothing was lost" in lines[0], lines[0]
    assert f"resume with --load {ckpt}" in lines[0], lines[0]
    # torchrun reports the signal it received itself; the ranks add no traceback
    assert output.count("Traceback") == output.count("SignalException: Process"), output[-5000:]
    assert "ConnectionResetError" not in output and "rank 1" not in lines[0], output[-5000:]
    assert not list(ckpt.glob("*.tmp")) and not (ckpt / "save.lock").exists()
