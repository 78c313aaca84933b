"""A real single-host Slurm for the tests (scripts/slurm_local.sh: munged, slurmctld and two
slurmd on this machine, configuration in a temporary directory), and what the tests ask of it:
submit with `sbatch`, read a job with `scontrol show job`, wait for a state, find a job's
processes and ranks (by their environment).

    cluster = Cluster.start(tmp / "slurm")      # ... cluster.stop() leaves nothing running
    job = cluster.sbatch(["--nodes", "1", script, *args], env={...})
    info = cluster.wait(job, "COMPLETED")
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

from megatron_ext.launch import job_environment
from tests.support.runs import REPO

__all__ = [
    "ENDED", "INSTALL", "SLURM_LOCAL", "Cluster", "missing", "pids_with_environ", "signal_caught",
    "signal_pending",
]  # fmt: skip

SLURM_LOCAL = REPO / "scripts" / "slurm_local.sh"
INSTALL = "apt-get update && apt-get install -y slurm-wlm munge (or bash scripts/install_slurm.sh)"
# Job states after which a job runs no more (until a requeue).
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def missing() -> Optional[str]:
    """Why a real Slurm cannot run here (None if it can)."""
    absent = [exe for exe in ("munged", "slurmctld", "slurmd", "sbatch") if not shutil.which(exe)]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} not found): {INSTALL}"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs (run the tests as root)"
    return None


def _free_port_run(count: int) -> int:
    """The first of `count` consecutive free TCP ports (slurmctld, then one slurmd per node)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count > 65535:
            continue
        socks = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def pids_with_environ(*items: str) -> list[int]:
    """The processes whose environment holds every "KEY=value" of `items` (how a job's
    processes are found: they all have SLURM_CONF and SLURM_JOB_ID; `scontrol listpids` asks
    one slurmd of the host, not the one of the job's node)."""
    needles = {item.encode() for item in items}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if needles <= environ:
            found.append(int(entry.name))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


@dataclass
class Cluster:
    """A running single-host cluster; `env` is the environment jobs are submitted with (this
    process's, SLURM_CONF, the virtual environment's bin/ first on PATH)."""

    directory: Path
    nodes: int
    env: dict

    @classmethod
    def start(cls, directory: Path, nodes: int = 2) -> "Cluster":
        directory.mkdir(parents=True, exist_ok=True)
        port = _free_port_run(nodes + 1)
        env = job_environment(
            {
                "SLURM_CONF": directory / "slurm.conf",
                "SLURMCTLD_PORT": port,
                "SLURMD_PORT": port + 1,
                "SLURM_LOCAL_NODES": nodes,
                "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
            }
        )
        proc = subprocess.run(
            ["bash", str(SLURM_LOCAL), "start", str(directory)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"slurm_local.sh start failed:\n{proc.stdout}\n{proc.stderr}")
        return cls(directory, nodes, env)

    def daemons(self) -> dict[str, int]:
        """slurmctld, every slurmd and munged: name -> pid (those that run)."""
        found = {}
        for pidfile in [self.directory / "slurmctld.pid", *self.directory.glob("slurmd-*.pid")]:
            try:
                found[pidfile.stem] = int(pidfile.read_text())
            except (OSError, ValueError):
                pass
        munged = subprocess.run(
            ["pgrep", "-f", "--", f"--socket={self.directory}/munge/munge.socket"],
            capture_output=True, text=True,
        )  # fmt: skip
        for pid in munged.stdout.split():
            found["munged"] = int(pid)
        return {name: pid for name, pid in found.items() if _running(pid)}

    def leftovers(self) -> list[str]:
        """What of this cluster still runs: "pid command line" of its daemons and of every
        process with its SLURM_CONF (jobs, slurmstepd), as `pgrep -a` shows them."""
        pids = set(self.daemons().values())
        pids |= set(pids_with_environ(f"SLURM_CONF={self.env['SLURM_CONF']}"))
        pids.discard(os.getpid())
        return [f"{pid} {_cmdline(pid)}" for pid in sorted(pids) if _running(pid)]

    def stop(self) -> None:
        subprocess.run(
            ["bash", str(SLURM_LOCAL), "stop", str(self.directory)],
            env=self.env, capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}"
                f"{proc.stdout.strip()}\n{self._log_tails()}"
            )
        return proc

    def sbatch(self, args: Iterable[str], env: Optional[dict] = None, cwd: Path = REPO) -> int:
        """Submit as a user does (`sbatch ARGS` from `cwd`, the cluster's environment with
        `env` added); the job id."""
        proc = subprocess.run(
            ["sbatch", "--parsable", *map(str, args)], cwd=cwd,
            env={**self.env, **{k: str(v) for k, v in (env or {}).items()}},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, f"sbatch failed:\n{proc.stderr}"
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: Union[int, str]) -> dict[str, str]:
        """`scontrol show job -o`'s fields (JobState, ExitCode, Restarts, NodeList, ...); an
        array task as "ARRAY_TASK"."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        fields = {}
        for item in out.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait(
        self, job_id: int, *states: str, timeout: float = 300, restarts: int = 0
    ) -> dict[str, str]:
        """Wait until the job is in one of `states` (default: any ended state) after at
        least `restarts` requeues; its fields. Fails on timeout, or if it ended otherwise."""
        states = states or ENDED
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info["JobState"] in states and int(info.get("Restarts", 0)) >= restarts:
                return info
            if info["JobState"] in ENDED and int(info.get("Restarts", 0)) >= restarts:
                raise AssertionError(f"job {job_id} ended {info['JobState']}, not {states}")
            if info.get("Reason", "").startswith("launch_failed"):
                raise AssertionError(f"job {job_id} failed to launch: {info}\n{self._log_tails()}")
            if info.get("Reason") == "DependencyNeverSatisfied":
                raise AssertionError(f"job {job_id} waits for a job that failed: {info}")
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not {states} within {timeout} s: {info}")
            time.sleep(0.5)

    def _log_tails(self, lines: int = 15) -> str:
        """The last lines of the daemons' logs (why a job is gone or did not launch)."""
        tails = []
        for log in [self.directory / "slurmctld.log", *sorted(self.directory.glob("slurmd-*.log"))]:
            try:
                tails.append(f"{log}:\n" + "\n".join(log.read_text().splitlines()[-lines:]))
            except OSError as e:
                tails.append(f"{log}: {e}")
        return "\n".join(tails)

    def processes(self, job_id: int) -> list[int]:
        """The job's processes (its batch script, srun, torchrun, the ranks...)."""
        conf = f"SLURM_CONF={self.env['SLURM_CONF']}"
        return sorted(set(pids_with_environ(conf, f"SLURM_JOB_ID={job_id}")) - {os.getpid()})

    def ranks(self, job_id: int) -> dict[int, int]:
        """Training ranks of the job: global rank -> pid (processes of the job that torchrun
        started, found by their RANK)."""
        ranks = {}
        for pid in self.processes(job_id):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"pretrain_leviathan" not in cmdline or b"torch.distributed.run" in cmdline:
                continue
            for item in environ:
                if item.startswith(b"RANK="):
                    ranks[int(item[5:])] = pid
        return ranks


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _signal_mask(pid: int, sig: int, *fields: str) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    bit = 1 << (sig - 1)
    for line in status.splitlines():
        if line.startswith(fields) and int(line.split()[1], 16) & bit:
            return True
    return False


def signal_pending(pid: int, sig: int) -> bool:
    """Whether `sig` waits to be delivered to the (stopped) process `pid`."""
    return _signal_mask(pid, sig, "SigPnd:", "ShdPnd:")


def signal_caught(pid: int, sig: int) -> bool:
    """Whether the process `pid` has a handler for `sig`."""
    return _signal_mask(pid, sig, "SigCgt:")
