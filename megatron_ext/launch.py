"""The one launcher of training processes: an entry point (a module name, run with ``-m``, or a
``.py`` path) on N ranks under torchrun (plain ``python`` for one rank), in its own session, its
output captured to a log, and nothing left running when it is done. The children import the
caller's ``megatron_ext`` (its parent directory goes first on their PYTHONPATH)::

    with launch("pretrain_leviathan", 2, args, log=workdir / "output.log") as job:
        returncode = job.wait(on_line=print)
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
from typing import Callable, Optional, Sequence, Union

import megatron_ext

_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LISTEN_PORTS = (20000, 32768)
"""Where `find_free_port` draws from when the kernel's ephemeral range cannot be read."""


def _listen_port_range() -> tuple[int, int]:
    """Ports [low, high) that the kernel never hands out as ephemeral (outgoing) ports: below
    (down to 10000) or above Linux's ephemeral range, else 20000-32767."""
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
    """A TCP port on loopback that was free a moment ago, for a rendezvous to listen on.

    Drawn at random outside the ephemeral range: an ephemeral port (bind to port 0) may be taken
    by any outgoing connection (gloo opens many) before the listener binds it; the random draw
    keeps concurrent callers apart, and one process never gets the same port twice.
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
    "launch",
    "job_environment",
    "child_pids",
    "descendant_pids",
    "process_children",
    "find_free_port",
]

# The directory holding the `megatron_ext` the caller imported (a checkout or site-packages).
PACKAGE_ROOT = Path(megatron_ext.__file__).resolve().parents[1]


def _stat(pid: int) -> Optional[list[str]]:
    """The fields of /proc/PID/stat after the command name (state first), None if gone."""
    try:
        # The command name may hold spaces and parentheses: fields follow the last ')'.
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_children() -> dict[int, list[int]]:
    """Parent pid -> its children in pid order, of every process now running, from one read of
    /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in sorted(int(e) for e in os.listdir("/proc") if e.isdigit()):
        stat = _stat(entry)
        if stat is not None:
            children.setdefault(int(stat[1]), []).append(entry)
    return children


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``, in pid order."""
    return process_children().get(pid, [])


def descendant_pids(pid: int, children: Optional[dict[int, list[int]]] = None) -> list[int]:
    """Every process below ``pid``, children before grandchildren, in ``children`` (one
    `process_children()` snapshot, several questions) or in a fresh read of /proc (one read: a
    job's wait polls this every 50 ms)."""
    children, found = process_children() if children is None else children, []
    level = children.get(pid, [])
    while level:
        found += level
        level = [c for p in level for c in children.get(p, [])]
    return found


def _same_process_running(pid: int, started: Optional[int]) -> bool:
    """Whether the process seen as (pid, start time) still runs (a zombie does not)."""
    stat = _stat(pid)
    return stat is not None and int(stat[19]) == started and stat[0] not in ("Z", "X")


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
        timeout: Optional[float],
        stderr_path: Optional[Path] = None,
    ):
        self.cmd = cmd
        self.log_path = Path(log_path)
        self.torchrun = torchrun
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        # pid -> start time in clock ticks since boot (names one process after a pid reuse)
        self.seen: dict[int, Optional[int]] = {}
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
                stat = _stat(pid)
                self.seen[pid] = None if stat is None else int(stat[19])

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

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        self._log.close()
        if self._err is not None:
            self._err.close()


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
    timeout: Optional[float] = 300,
    log: Optional[Path] = None,
    stderr: Optional[Path] = None,
    cwd: Optional[Path] = None,
    torchrun: Optional[bool] = None,
    torchrun_args: Sequence[str] = (),
    python: str = sys.executable,
    job: Callable[..., Job] = Job,
) -> Job:
    """Start ``entry`` (a module name or a script path) with ``args`` on ``nproc`` ranks and
    return the running :class:`Job`.

    Args:
        env: variables added to the environment (see `job_environment`).
        timeout: seconds from the start after which :meth:`Job.wait` kills the job and raises
            TimeoutError (None: no limit).
        log: the output file (default: ``output.log`` in ``cwd``); ``stderr``: a separate file
            for standard error (default: interleaved into ``log``).
        torchrun: run under ``torch.distributed.run`` (default: when ``nproc > 1``); without it
            one plain process gets MASTER_ADDR/MASTER_PORT.
        torchrun_args: extra torchrun flags (e.g. ``--max-restarts 2``).
        job: the class of the returned job (tests/support/jobs.py: one that signals it).
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
    return job(
        cmd,
        log_path=log_path,
        env=environment,
        cwd=cwd,
        torchrun=torchrun,
        timeout=timeout,
        stderr_path=stderr,
    )
