"""One run per --save: a run holds `<save>/save.lock` (host, pid, job id, start, lease) while it
runs, created atomically by rank 0 (a temporary file hard-linked into place). A lock held by:

- a live run: refused at start (`SaveLockError`, one line naming the holder);
- the same job (Slurm job id, torchrun run or agent: a restart or requeue): taken over;
- a run that is gone (its process on this host, or its lease not renewed for `LEASE_SECONDS`
  on another; rank 0 renews it every `RENEW_SECONDS`): taken over with one warning.

It is removed when the run ends; a run killed outright leaves it for the rules above, and
`tools/convert_checkpoint.py unlock --save DIR` breaks it by hand. Rank 0 decides and every rank
learns the outcome (a broadcast).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_ext._paths import display_path
from megatron_ext.checkpoint.io_errors import SaveLockError, describe_io_error

logger = logging.getLogger(__name__)

__all__ = [
    "LEASE_SECONDS",
    "LOCK_FILENAME",
    "LockHolder",
    "RENEW_SECONDS",
    "SaveLock",
    "break_lock",
    "current_job_id",
    "read_lock",
]

LOCK_FILENAME = "save.lock"
LEASE_SECONDS = 300.0
"""A lock of another host not renewed for this long belongs to a run that is gone."""
RENEW_SECONDS = 30.0


def current_job_id() -> Optional[str]:
    """This process's job: the Slurm job id, else torchrun's run id (`--rdzv-id`, a uuid under
    `--standalone`), else, under torchrun without an id, its agent process; None for a plain
    process. Restarts and requeues of one job keep it."""
    slurm = os.environ.get("SLURM_JOB_ID")
    if slurm:
        return f"slurm:{slurm}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    agent = os.getppid()
    return f"torchrun-agent:{socket.gethostname()}:{agent}:{_process_start(agent)}"


def _process_start(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (with the pid it names one process,
    even after the pid is reused); None where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class LockHolder:
    """Who holds a --save directory."""

    host: str
    pid: int
    job_id: Optional[str]
    started: float
    """When the run took the lock (epoch seconds)."""
    renewed: float
    """When its lease was last renewed (epoch seconds)."""
    token: str
    """Unique per taking of the lock (the holder recognises its own lock by it)."""
    pid_start: Optional[int] = None
    """The holder's process start time (clock ticks since boot) where known."""

    @classmethod
    def me(cls) -> "LockHolder":
        """This process, now."""
        now = time.time()
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            job_id=current_job_id(),
            started=now,
            renewed=now,
            token=uuid.uuid4().hex,
            pid_start=_process_start(os.getpid()),
        )

    def describe(self, lease: bool = True, job: bool = True) -> str:
        """'pid 123 on host n1 (job slurm:42), started 2026-... , lease renewed 5 s ago'."""
        job = f" (job {self.job_id})" if self.job_id and job else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        age = max(0.0, time.time() - self.renewed)
        renewed = f", lease renewed {age:.0f} s ago" if lease else ""
        return f"pid {self.pid} on host {self.host}{job}, started {started}{renewed}"

    def is_running_here(self) -> bool:
        """On this host: whether the holder's process still runs (the same process: a reused
        pid with another start time does not count)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process of that pid
        if self.pid_start is not None and _process_start(self.pid) not in (None, self.pid_start):
            return False
        try:
            with open(f"/proc/{self.pid}/stat") as handle:
                return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return True

    def gone_because(self) -> Optional[str]:
        """Why the holder is gone (its lock is stale), or None while it may still run."""
        if self.host == socket.gethostname():
            if not self.is_running_here():
                return f"pid {self.pid} on this host is not running"
            return None
        age = time.time() - self.renewed
        if age > LEASE_SECONDS:
            return (
                f"its lease on host {self.host} was last renewed {age:.0f} s ago "
                f"(stale after {LEASE_SECONDS:.0f} s)"
            )
        return None


def read_lock(root: str) -> Optional[LockHolder]:
    """The holder recorded in `<root>/save.lock`, None without a lock.

    Raises:
        ValueError: the file is not a lock this project wrote.
    """
    try:
        with open(os.path.join(root, LOCK_FILENAME)) as handle:
            record = json.load(handle)
    except FileNotFoundError:
        return None
    fields = {f.name for f in dataclasses.fields(LockHolder)}
    try:
        return LockHolder(**{k: v for k, v in record.items() if k in fields})
    except TypeError as error:
        raise ValueError(f"not a lock file ({error})") from None


def _write(path: str, holder: LockHolder, replace: bool = False) -> bool:
    """Write the lock `path` holding `holder` through a synced temporary file beside it, complete
    or not at all: replacing it, or creating it (False when it exists)."""
    tmp = f"{path}.{holder.token}.tmp"
    with open(tmp, "w") as handle:
        json.dump(dataclasses.asdict(holder), handle)
        handle.flush()
        os.fsync(handle.fileno())
    try:
        (os.replace if replace else os.link)(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        if not replace:
            os.remove(tmp)


def _broadcast(value):
    """Rank 0's `value` on every rank (collective over the default group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


class SaveLock:
    """The lock a run holds in its --save directory (`acquire` ... `release`)."""

    def __init__(self, root: str, holder: Optional[LockHolder]) -> None:
        self.root = root
        self.path = os.path.join(root, LOCK_FILENAME)
        self.holder = holder
        """Ours on rank 0; None on the other ranks."""
        self.lost: Optional[str] = None
        """Set by the renewal thread when another run took the lock over."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def acquire(cls, root: str) -> "SaveLock":
        """Take the lock of `root` (collective: rank 0 decides, every rank learns).

        Raises:
            SaveLockError: another run holds it, or it cannot be created (every rank).
        """
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        outcome: tuple[Optional[str], Optional[LockHolder]] = (None, None)
        if rank0:
            try:
                outcome = cls._take(root)
            except OSError as error:
                outcome = (
                    f"--save {os.path.abspath(root)} cannot hold checkpoints: "
                    f"{describe_io_error(error, root)}; point --save at a writable directory "
                    "with enough space",
                    None,
                )
        problem, holder = _broadcast(outcome[0]), outcome[1]
        if problem is not None:
            raise SaveLockError(problem)
        lock = cls(root, holder)
        if rank0:  # a run killed mid-save left these; loads never look at them
            for name in remove_partial_saves(root):
                logger.info("removed %s, a save that an earlier run did not complete", name)
            lock._thread = threading.Thread(target=lock._renew, name="save-lock", daemon=True)
            lock._thread.start()
        return lock

    @staticmethod
    def _take(root: str) -> tuple[Optional[str], Optional[LockHolder]]:
        """(why not, None) or (None, our holder record); rank 0 only."""
        os.makedirs(root, exist_ok=True)
        path = os.path.join(root, LOCK_FILENAME)
        where = display_path(root)
        me = LockHolder.me()
        for _ in range(3):  # a lock removed between our link and our read: try again
            if _write(path, me):
                return None, me
            try:
                held = read_lock(root)
            except ValueError as error:
                return (
                    f"--save {where} holds {LOCK_FILENAME}, which is not a lock file ({error}); "
                    f"remove it with `python tools/convert_checkpoint.py unlock --save {where}`",
                    None,
                )
            if held is None:
                continue
            same_job = me.job_id is not None and held.job_id == me.job_id
            # A restart or requeue starts once the job's previous processes ended: a holder of
            # the same job still running on this host is another run of it (two srun steps).
            if same_job and not (held.host == me.host and held.is_running_here()):
                logger.info(
                    "--save %s: taking over the lock of this job's previous run (%s): a "
                    "restart or requeue of job %s",
                    where,
                    held.describe(lease=False, job=False),
                    me.job_id,
                )
            else:
                gone = held.gone_because()
                if gone is None:
                    return (
                        f"--save {where} is in use by another run: {held.describe()}. Two runs "
                        "on one --save overwrite each other's checkpoints: wait for it to end or "
                        f"point --save elsewhere; if that run is gone, break its lock with "
                        f"`python tools/convert_checkpoint.py unlock --save {where}`",
                        None,
                    )
                logger.warning(
                    "--save %s: taking over the lock of a run that is gone (%s): %s",
                    where,
                    gone,
                    held.describe(lease=False),
                )
            _write(path, me, replace=True)
            if (read_lock(root) or held).token == me.token:
                return None, me
        return f"--save {where}: could not take {LOCK_FILENAME} (another run took it)", None

    def _renew(self) -> None:
        """Rank 0's thread: renew the lease until released; notice a takeover."""
        while not self._stop.wait(RENEW_SECONDS):
            try:
                held = read_lock(self.root)
                if held is None or held.token != self.holder.token:
                    self.lost = held.describe() if held is not None else "the lock was removed"
                    return
                self.holder = dataclasses.replace(self.holder, renewed=time.time())
                _write(self.path, self.holder, replace=True)
            except (OSError, ValueError) as error:
                logger.warning("--save %s: could not renew the lock (%s)", self.root, error)

    def check(self) -> None:
        """Collective: raise SaveLockError on every rank if another run took the lock over
        (or it was broken) since this run took it; the caller must not write into --save."""
        problem = None
        if self.holder is not None:  # rank 0
            try:
                held = read_lock(self.root)
            except ValueError:
                held = None
            if held is None or held.token != self.holder.token:
                problem = self.lost or (
                    held.describe() if held is not None else "the lock was removed"
                )
        problem = _broadcast(problem)
        if problem is not None:
            raise SaveLockError(
                f"--save {display_path(self.root)} is no longer this run's (now: {problem}); "
                "stopping without saving so that the two runs do not overwrite each other's "
                "checkpoints"
            )

    def release(self) -> None:
        """Remove the lock if it is still ours (rank 0; harmless on the others and twice)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.holder is None:
            return
        try:
            held = read_lock(self.root)
            if held is not None and held.token == self.holder.token:
                os.remove(self.path)
        except (OSError, ValueError):
            pass
        self.holder = None


def remove_partial_saves(root: str) -> list[str]:
    """Remove the `iter_XXXXXXX.tmp/` directories in `root` (saves that never completed: a
    process killed mid-save cannot remove its own); the names removed. Only the run that
    holds --save's lock may call this."""
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith("iter_") and n.endswith(".tmp"))
    except FileNotFoundError:
        return []
    for name in names:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return names


def break_lock(root: str, force: bool = False) -> Optional[str]:
    """Remove the lock of `root` by hand; returns who held it (None: there was no lock).

    Raises:
        SaveLockError: the holder runs on this host (unless `force`).
    """
    path = os.path.join(root, LOCK_FILENAME)
    try:
        held = read_lock(root)
    except ValueError as error:
        os.remove(path)
        return f"an unreadable lock file: {error}"
    if held is None:
        return None
    if not force and held.host == socket.gethostname() and held.is_running_here():
        raise SaveLockError(
            f"--save {display_path(root)} is held by a running process: {held.describe()}; "
            "stop that run first (or pass --force to break the lock anyway)"
        )
    os.remove(path)
    return held.describe()
