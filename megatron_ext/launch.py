"""The one launcher of training processes: an entry point on N ranks under torchrun (plain
``python`` for one rank), in its own session, its output captured to a log, signals delivered
as a cluster delivers them, and nothing left running when it is done.

Used by the tests, tools/gpu_check.py, the quick start and the benchmarks::

    with launch("pretrain_leviathan", 2, args, log=workdir / "output.log") as job:
        job.wait_for_lines(jsonl, 2)            # iteration 2 logged
        job.pause(); job.resume()               # SIGSTOP / SIGCONT every process of the job
        job.send_signal(signal.SIGTERM)         # to the targets given at launch
        returncode = job.wait()
    output = job.output()

``entry`` is a module name (run as ``python -m entry`` / ``torchrun -m entry``, so it works from
an installed package: ``pretrain_leviathan`` is installed as a top-level module beside
``megatron_ext``) or the path of a ``.py`` script. The children import the same
``megatron_ext`` as the caller: its parent directory goes first on their PYTHONPATH (a source
checkout; for an installed package that is site-packages, already on the path).

Signal targets, as the three deliveries a cluster makes:

- ``"ranks"``: the training processes only (``kill`` of the ranks);
- ``"agent"``: torchrun only (it forwards SIGTERM/SIGINT to every rank's process group);
- ``"job"``: every process of the job, DataLoader workers first, then the ranks, then the
  agent (Slurm's ``--signal`` or the time limit).

With one rank and no torchrun the rank is its own agent.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Literal, Optional, Sequence, Union

import megatron_ext

_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LISTEN_PORTS = (20000, 32768)
"""Where `find_free_port` draws from when the kernel's ephemeral range cannot be read."""


def _listen_port_range() -> tuple[int, int]:
    """Ports [low, high) that the kernel never hands out as ephemeral (outgoing) ports.

    Linux's ephemeral range is read from /proc (32768-60999 by default); below it, down to
    10000, are the ports left for listeners. Elsewhere the IANA ephemeral range 49152-65535 is
    assumed, and 20000-32767 is used.
    """
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return _LISTEN_PORTS
    if low - 10000 >= 2000:
        return 10000, low
    if 65536 - (high + 1) >= 2000:
        return high + 1, 65536
    return _LISTEN_PORTS


_drawn_ports: set[int] = set()


def find_free_port() -> int:
    """Return a TCP port on loopback that was free a moment ago, for a rendezvous to listen on.

    The port is drawn at random outside the kernel's ephemeral range. A port that the kernel
    assigned (bind to port 0) is an ephemeral one, and between this call and the listener's
    bind any outgoing connection on the machine (gloo opens many) may take it: concurrent
    launches then fail with EADDRINUSE. A random draw also keeps concurrent callers (pytest-xdist
    workers) apart, and one process never gets the same port twice.
    """
    low, high = _listen_port_range()
    rng = random.Random(int.from_bytes(os.urandom(8), "little"))
    for _ in range(200):
        port = rng.randrange(low, high)
        if port in _drawn_ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _drawn_ports.add(port)
        return port
    raise RuntimeError(f"no free TCP port on 127.0.0.1 in {low}-{high - 1} after 200 tries")


__all__ = [
    "PACKAGE_ROOT",
    "Job",
    "SignalTargets",
    "launch",
    "job_environment",
    "child_pids",
    "descendant_pids",
    "find_free_port",
    "process_state",
]

SignalTargets = Literal["ranks", "agent", "job"]

# The directory holding the `megatron_ext` the caller imported (a checkout or site-packages).
PACKAGE_ROOT = Path(megatron_ext.__file__).resolve().parents[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc; Linux), in pid order."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields follow the last ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry))
    return sorted(children)


def descendant_pids(pid: int) -> list[int]:
    """Every process below ``pid``, children before grandchildren."""
    children = child_pids(pid)
    return children + [d for c in children for d in descendant_pids(c)]


def process_state(pid: int) -> Optional[str]:
    """The state letter of /proc/<pid>/stat (R, S, T, Z, ...), or None for no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat): with
    the pid it names one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _same_process_running(pid: int, started: Optional[int]) -> bool:
    """Whether the process seen as (pid, start time) still runs (a zombie does not)."""
    if started is None:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return int(stat[19]) == started and stat[0] not in ("Z", "X")


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


class Job:
    """A launched process tree (its own session) writing to ``log_path``.

    Use it as a context manager: on leaving the block every process it started (and every
    descendant seen while it ran) is killed, whatever happened inside.
    """

    def __init__(
        self,
        cmd: list[str],
        *,
        log_path: Path,
        env: dict,
        cwd: Path,
        torchrun: bool,
        signal_targets: SignalTargets,
        timeout: Optional[float],
        stderr_path: Optional[Path] = None,
    ):
        self.cmd = cmd
        self.log_path = Path(log_path)
        self.torchrun = torchrun
        self.signal_targets = signal_targets
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        self.seen: dict[int, Optional[int]] = {}  # pid -> start time
        self._log = open(self.log_path, "w")
        self.stderr_path = None if stderr_path is None else Path(stderr_path)
        self._err = None if stderr_path is None else open(stderr_path, "w")
        self._read_offset = 0
        self._partial = ""
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._err is None else self._err,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        """The agent's pid (torchrun, or the single rank)."""
        return self.proc.pid

    @property
    def returncode(self) -> Optional[int]:
        """The agent's exit status; None while it runs."""
        return self.proc.poll()

    def processes(self) -> list[int]:
        """Every process of the job now running below the agent (remembered for the kill)."""
        found = descendant_pids(self.proc.pid)
        self._remember(found)
        return found

    def _remember(self, pids: list[int]) -> None:
        for pid in pids:
            if pid not in self.seen:
                self.seen[pid] = _start_time(pid)

    def agents(self) -> list[int]:
        """The torchrun processes of the job: the launched process itself, or those started
        below it by a wrapper (a batch script, ``srun`` running ``torchrun``)."""
        if not self.torchrun:
            return []
        pids = [self.proc.pid, *descendant_pids(self.proc.pid)]
        self._remember(pids)
        return [pid for pid in pids if _is_torchrun(pid)]

    def ranks(self) -> dict[int, int]:
        """{rank: pid} of the training processes now running: the children of the torchrun
        agents that carry a RANK (their own DataLoader workers are grandchildren)."""
        if not self.torchrun:
            return {} if self.proc.poll() is not None else {0: self.proc.pid}
        out = {}
        for agent in self.agents():
            for pid in child_pids(agent):
                self._remember([pid])
                rank = _rank_of(pid)
                if rank is not None:
                    out[rank] = pid
        return dict(sorted(out.items()))

    def workers(self) -> dict[int, list[int]]:
        """{rank: [pid, ...]} of the processes each rank started (DataLoader workers)."""
        out = {}
        for rank, pid in self.ranks().items():
            out[rank] = descendant_pids(pid)
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

    def _check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.kill()
            raise TimeoutError(
                f"killed after {self.timeout:g} s: {' '.join(self.cmd)}\n{self.output()[-4000:]}"
            )

    def _follow(self, on_line: Optional[Callable[[str], None]]) -> None:
        if on_line is None:
            return
        with open(self.log_path) as handle:
            handle.seek(self._read_offset)
            text = handle.read()
            self._read_offset = handle.tell()
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            on_line(line)

    def wait(
        self, timeout: Optional[float] = None, on_line: Optional[Callable[[str], None]] = None
    ) -> int:
        """Wait for the agent to exit and return its status. Past the launch's timeout (or this
        call's ``timeout``) everything is killed and TimeoutError raised. ``on_line`` is called
        with each new line of the log while waiting."""
        until = None if timeout is None else time.monotonic() + timeout
        while self.proc.poll() is None:
            self._check_deadline()
            if until is not None and time.monotonic() > until:
                self.kill()
                raise TimeoutError(f"still running after {timeout:g} s: {' '.join(self.cmd)}")
            self.processes()
            self._follow(on_line)
            time.sleep(0.05)
        self._log.flush()
        self._follow(on_line)
        if on_line is not None and self._partial:
            on_line(self._partial)
            self._partial = ""
        return self.proc.returncode

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

    def stop(self, grace: float = 15.0) -> None:
        """Interrupt the agent (SIGINT, which torchrun forwards to the ranks), give the job
        ``grace`` seconds to exit cleanly, then kill what is left."""
        if self.proc.poll() is None:
            self.processes()
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the session and every descendant seen that still runs (stopped ones are
        continued first), so that a process that left the session dies too."""
        if self.proc.poll() is None:
            self.processes()
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        killed = []
        for pid, started in sorted(self.seen.items()):
            if not _same_process_running(pid, started):
                continue  # gone (its pid may belong to another process by now)
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            killed.append(pid)
        deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously
        while any(_same_process_running(p, self.seen[p]) for p in killed):
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)

    def output(self) -> str:
        """The log so far (stdout and stderr of every process, interleaved, unless stderr
        was given its own file)."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def errors(self) -> str:
        """The separate stderr file so far (launch(..., stderr=PATH)); "" without one."""
        if self._err is None:
            return ""
        if not self._err.closed:
            self._err.flush()
        return self.stderr_path.read_text(errors="replace")

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        self._log.close()
        if self._err is not None:
            self._err.close()


def count_records(path: Path) -> int:
    """Complete JSON lines in ``path`` (0 if it does not exist yet)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return 0
    return sum(1 for line in text.splitlines() if line.strip().endswith("}"))


def _entry_command(entry: Union[str, Path]) -> list[str]:
    entry = str(entry)
    if entry.endswith(".py") or os.sep in entry:
        return [entry]
    return ["-m", entry]


def job_environment(env: Optional[dict] = None) -> dict:
    """The environment of a launched job: the caller's, without an inherited rank identity,
    with PYTHONUNBUFFERED=1 and OMP_NUM_THREADS=1 unless set, this ``megatron_ext`` first on
    PYTHONPATH, then ``env`` added (a None value removes the variable)."""
    environment = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        environment.pop(key, None)
    environment.setdefault("PYTHONUNBUFFERED", "1")
    environment.setdefault("OMP_NUM_THREADS", "1")
    environment["PYTHONPATH"] = os.pathsep.join(
        dict.fromkeys(filter(None, [str(PACKAGE_ROOT), environment.get("PYTHONPATH")]))
    )
    for key, value in (env or {}).items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = str(value)
    return environment


def launch(
    entry: Union[str, Path],
    nproc: int,
    args: Sequence[str],
    *,
    env: Optional[dict] = None,
    signal_targets: SignalTargets = "ranks",
    timeout: Optional[float] = 300,
    log: Optional[Path] = None,
    stderr: Optional[Path] = None,
    cwd: Optional[Path] = None,
    torchrun: Optional[bool] = None,
    torchrun_args: Sequence[str] = (),
    python: str = sys.executable,
) -> Job:
    """Start ``entry`` on ``nproc`` ranks and return the running :class:`Job`.

    Args:
        entry: a module name (``"pretrain_leviathan"``) or a script path.
        nproc: ranks on this node.
        args: the entry's arguments.
        env: variables added to the inherited environment (PYTHONUNBUFFERED=1 and
            OMP_NUM_THREADS=1 are set unless given; a None value removes the variable).
        signal_targets: where :meth:`Job.send_signal` delivers by default (module docstring).
        timeout: seconds from the start after which :meth:`Job.wait` kills the job and raises
            TimeoutError (None: no limit).
        log: the output file (default: ``output.log`` in ``cwd``).
        stderr: a separate file for standard error (default: interleaved into ``log``).
        cwd: the working directory (default: the current one).
        torchrun: run under ``torch.distributed.run`` (default: when ``nproc > 1``); without it
            one plain process gets MASTER_ADDR/MASTER_PORT and no inherited RANK/WORLD_SIZE.
        torchrun_args: extra torchrun flags (e.g. ``--max-restarts 2``).
        python: the interpreter.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    torchrun = nproc > 1 if torchrun is None else torchrun
    if not torchrun and nproc != 1:
        raise ValueError("more than one rank needs torchrun")
    cwd = Path(cwd) if cwd is not None else Path.cwd()
    log_path = Path(log) if log is not None else cwd / "output.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)

    environment = job_environment(env)
    # A MASTER_PORT inherited from the caller's own process group is not reused.
    port = (env or {}).get("MASTER_PORT") or str(find_free_port())
    if torchrun:
        cmd = [
            python, "-m", "torch.distributed.run", *torchrun_args, "--nproc-per-node", str(nproc),
        ]  # fmt: skip
        if not any(a.startswith("--rdzv") or a == "--standalone" for a in torchrun_args):
            cmd += ["--master-addr", "127.0.0.1", "--master-port", port]
        entry_cmd = _entry_command(entry)
        cmd += ["--module", *entry_cmd[1:]] if entry_cmd[0] == "-m" else entry_cmd
    else:
        environment.setdefault("MASTER_ADDR", "127.0.0.1")
        environment["MASTER_PORT"] = port
        cmd = [python, *_entry_command(entry)]
    cmd += [str(a) for a in args]
    return Job(
        cmd,
        log_path=log_path,
        env=environment,
        cwd=cwd,
        torchrun=torchrun,
        signal_targets=signal_targets,
        timeout=timeout,
        stderr_path=stderr,
    )
