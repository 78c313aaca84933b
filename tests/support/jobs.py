"""`megatron_ext.launch` jobs that tests and benchmarks signal and inspect: the ranks, torchrun
agents and DataLoader workers of a job, signals delivered as a cluster delivers them, pause /
resume, and waiting for --log-jsonl records::

    with launch("pretrain_leviathan", 2, args, log=workdir / "output.log") as job:
        job.wait_for_lines(jsonl, 2)            # iteration 2 logged
        job.pause(); job.resume()               # SIGSTOP / SIGCONT every process of the job
        job.send_signal(signal.SIGTERM)         # to the targets given at launch
        returncode = job.wait()

Signal targets, as the three deliveries a cluster makes:

- ``"ranks"``: the training processes only (``kill`` of the ranks);
- ``"agent"``: torchrun only (it forwards SIGTERM/SIGINT to every rank's process group);
- ``"job"``: every process of the job, DataLoader workers first, then the ranks, then the
  agent (Slurm's ``--signal`` or the time limit).

With one rank and no torchrun the rank is its own agent.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path
from typing import Literal, Optional

from megatron_ext import launch as _launch

__all__ = ["Job", "SignalTargets", "count_records", "launch", "process_state"]

SignalTargets = Literal["ranks", "agent", "job"]


def process_state(pid: int) -> Optional[str]:
    """The state letter of /proc/<pid>/stat (R, S, T, Z, ...), or None for no such process."""
    stat = _launch._stat(pid)
    return stat[0] if stat else None


def _rank_of(pid: int) -> Optional[int]:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _is_torchrun(pid: int) -> bool:
    """Whether ``pid`` runs torchrun (``python -m torch.distributed.run`` or the script)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"torch.distributed.run" in argv[:3] or any(
        Path(os.fsdecode(a)).name == "torchrun" for a in argv[:2]
    )


def count_records(path: Path) -> int:
    """Complete JSON lines in ``path`` (0 if it does not exist yet)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return 0
    return sum(1 for line in text.splitlines() if line.strip().endswith("}"))


class Job(_launch.Job):
    """A launched job that is signalled (`send_signal` to `signal_targets` by default) and
    inspected (`ranks`, `agents`, `workers`)."""

    def __init__(self, *args, signal_targets: SignalTargets = "ranks", **kwargs):
        super().__init__(*args, **kwargs)
        self.signal_targets = signal_targets

    def processes(self) -> list[int]:
        """Every process of the job now running below the agent (remembered for the kill)."""
        found = _launch.descendant_pids(self.proc.pid)
        self._remember(found)
        return found

    def agents(self, tree: Optional[dict] = None) -> list[int]:
        """The torchrun processes of the job: the launched process itself, or those started
        below it by a wrapper (a batch script, ``srun`` running ``torchrun``)."""
        if not self.torchrun:
            return []
        pids = [self.proc.pid, *_launch.descendant_pids(self.proc.pid, tree)]
        self._remember(pids)
        return [pid for pid in pids if _is_torchrun(pid)]

    def ranks(self, tree: Optional[dict] = None) -> dict[int, int]:
        """{rank: pid} of the training processes now running: the children of the torchrun
        agents that carry a RANK (their own DataLoader workers are grandchildren)."""
        if not self.torchrun:
            return {} if self.proc.poll() is not None else {0: self.proc.pid}
        tree = tree or _launch.process_children()
        out = {}
        for agent in self.agents(tree):
            for pid in tree.get(agent, []):
                self._remember([pid])
                rank = _rank_of(pid)
                if rank is not None:
                    out[rank] = pid
        return dict(sorted(out.items()))

    def workers(self) -> dict[int, list[int]]:
        """{rank: [pid, ...]} of the processes each rank started (DataLoader workers)."""
        tree = _launch.process_children()
        out = {}
        for rank, pid in self.ranks(tree).items():
            out[rank] = _launch.descendant_pids(pid, tree)
            self._remember(out[rank])
        return out

    def targets(self, which: Optional[SignalTargets] = None) -> list[int]:
        """The pids a signal to ``which`` (default: the launch's ``signal_targets``) reaches."""
        which = which or self.signal_targets
        ranks = list(self.ranks().values())
        if which == "ranks":
            return ranks
        if which == "agent":
            return (self.agents() if self.torchrun else []) or [self.proc.pid]
        if which == "job":
            workers = [w for pids in self.workers().values() for w in pids]
            return workers + [r for r in ranks if r != self.proc.pid] + [self.proc.pid]
        raise ValueError(f"signal targets must be 'ranks', 'agent' or 'job', not {which!r}")

    def send_signal(self, sig: int, which: Optional[SignalTargets] = None) -> list[int]:
        """Send ``sig`` to the targets; returns the pids signalled (gone ones are skipped)."""
        sent = []
        for pid in self.targets(which):
            try:
                os.kill(pid, sig)
                sent.append(pid)
            except ProcessLookupError:
                pass
        return sent

    def pause(self, timeout: float = 10.0) -> list[int]:
        """Stop every process of the job (SIGSTOP to the DataLoader workers, the ranks and
        torchrun, each in its own session) until `resume`, and return once all of them are
        stopped (what they wrote before is complete); returns the pids stopped. A benchmark
        uses this to let several jobs take turns on the same cores.

        Raises:
            TimeoutError: a process still runs ``timeout`` seconds after the signal.
        """
        sent = self.send_signal(signal.SIGSTOP, "job")
        deadline = time.monotonic() + timeout
        while running := [pid for pid in sent if process_state(pid) not in ("T", "t", "Z", None)]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes {running} still run {timeout:g} s after SIGSTOP")
            time.sleep(0.001)
        return sent

    def resume(self) -> list[int]:
        """Continue what `pause` stopped (SIGCONT to the same targets); returns the pids."""
        return self.send_signal(signal.SIGCONT, "job")

    def wait_for_lines(self, path: Path, count: int, *, require: bool = True) -> int:
        """Wait until the file ``path`` holds ``count`` complete JSON lines (e.g. --log-jsonl
        records); returns the number seen. If the job exits first: an AssertionError with the
        end of its output (``require``), or the smaller number."""
        while (seen := count_records(path)) < count:
            if self.proc.poll() is not None:
                assert not require, (
                    f"exited {self.proc.returncode} after {seen} of {count} records:\n"
                    f"{self.output()[-4000:]}"
                )
                return count_records(path)
            self._check_deadline()
            self.processes()
            time.sleep(0.05)
        return seen

    def errors(self) -> str:
        """The separate stderr file so far (launch(..., stderr=PATH)); "" without one."""
        if self._err is None:
            return ""
        if not self._err.closed:
            self._err.flush()
        return self.stderr_path.read_text(errors="replace")


def launch(*args, signal_targets: SignalTargets = "ranks", **kwargs) -> Job:
    """`megatron_ext.launch.launch` returning a `Job` whose `send_signal` reaches
    ``signal_targets`` by default."""
    return _launch.launch(
        *args, job=functools.partial(Job, signal_targets=signal_targets), **kwargs
    )
