"""Checkpoint errors: the exception classes (`CheckpointError` and its kinds, one line naming the
file and what to do), and I/O failures as one clear line agreed on by every rank:
`check_save_directory` (a read-only or full --save found before the first iteration),
`describe_io_error` (the reason behind a failed write), `agree_on_failure` (every rank stops
together) and `check_shard_files` (a truncated shard named instead of a bare EOFError).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from typing import Iterator, Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "CheckpointError",
    "CheckpointDigestError",
    "CheckpointSaveError",
    "NonFiniteStateError",
    "SaveLockError",
    "UnsafeCheckpointError",
    "CHECKPOINT_IO_ERRORS",
    "ITER_RE",
    "agree_on_failure",
    "check_save_directory",
    "describe_io_error",
    "causes",
    "older_checkpoints_hint",
    "older_iterations",
    "saved_iterations",
    "check_shard_files",
]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or incompatible with this model."""


class NonFiniteStateError(CheckpointError):
    """Refused to save a model with NaN/inf parameters."""


class CheckpointSaveError(CheckpointError):
    """A save failed (on some rank); its partial `.tmp` was removed, the latest is unchanged."""


class CheckpointDigestError(CheckpointError):
    """A file of a checkpoint differs from the digest recorded when it was saved (a bad copy,
    a failing disk), or is missing or of another size."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds something that reading would execute (a pickled object other
    than the checkpoint's own types): refused, nothing of it ran."""


class SaveLockError(CheckpointError):
    """`--save` is held by another run (or its lock cannot be taken or kept)."""


# What a failed read or write of a checkpoint can raise (DCP's wrapper is a BaseException).
CHECKPOINT_IO_ERRORS = (Exception, CheckpointException)

_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.EFBIG: "file too large",
    errno.EIO: "input/output error",
}
ITER_RE = re.compile(r"^iter_(\d{7,})$")


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def causes(error: BaseException) -> Iterator[BaseException]:
    """`error`, its chained causes and, for DCP's CheckpointException, each rank's exception."""
    stack, seen = [error], set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack += [current.__cause__, current.__context__]
        if isinstance(current, CheckpointException):
            stack += [pair[0] for pair in current.failures.values()]


def _free_bytes(directory: str) -> Optional[int]:
    while directory and not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    try:
        return shutil.disk_usage(directory or ".").free
    except OSError:
        return None


def describe_io_error(
    error: BaseException, directory: str, needed_bytes: Optional[int] = None
) -> str:
    """Why a checkpoint write failed, in a few words, naming the failing ranks DCP reports;
    a full disk without an errno (torch's "unexpected pos") is recognised by the free space."""
    found = list(causes(error))
    ranks = sorted({r for c in found if isinstance(c, CheckpointException) for r in c.failures})
    on = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
    for cause in found:
        if isinstance(cause, OSError) and cause.errno in _REASONS:
            where = f": {cause.filename}" if cause.filename else ""
            return f"{_REASONS[cause.errno]}{on} ({errno.errorcode[cause.errno]}{where})"
    free = _free_bytes(directory)
    if free is not None and needed_bytes and free < needed_bytes:
        return (
            f"no space left on device{on} ({_human(free)} free on {directory}, a checkpoint "
            f"needs about {_human(needed_bytes)})"
        )
    root = found[-1]
    first_line = (str(root).strip().splitlines() or [""])[0]
    return f"{type(root).__name__}{on}: {first_line}"


def agree_on_failure(local: Optional[str]) -> Optional[str]:
    """Collective: the first failing rank's reason (prefixed "rank r: " unless it names its
    ranks itself), or None on every rank when no rank failed."""
    if not dist.is_initialized():
        return local
    reasons: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, local)
    for rank, reason in enumerate(reasons):
        if reason is not None:
            named = dist.get_world_size() == 1 or " on rank" in reason
            return reason if named else f"rank {rank}: {reason}"
    return None


def check_save_directory(root: str, needed_bytes: int) -> Optional[str]:
    """Collective: create `root`, have every rank write and remove a probe file in it, and
    compare the free space with `needed_bytes` (one checkpoint). Returns the problem, or None."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = None
    try:
        if rank == 0:
            os.makedirs(root, exist_ok=True)
    except OSError as error:
        problem = describe_io_error(error, root)
    problem = agree_on_failure(problem)
    if problem is not None:
        return problem
    probe = os.path.join(root, f".write_test.{rank}.{os.getpid()}")
    try:
        with open(probe, "wb") as handle:
            handle.write(b"\0" * 4096)
            handle.flush()
            os.fsync(handle.fileno())
        os.remove(probe)
    except OSError as error:
        problem = describe_io_error(error, root)
    if problem is None and rank == 0:
        free = _free_bytes(root)
        if free is not None and free < needed_bytes:
            problem = (
                f"only {_human(free)} free, but a checkpoint needs about {_human(needed_bytes)}"
            )
    return agree_on_failure(problem)


def saved_iterations(root: str) -> list[int]:
    """The iterations of the `iter_XXXXXXX` directories in `root`, oldest first."""
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    return sorted(int(m.group(1)) for m in map(ITER_RE.match, names) if m)


def older_iterations(root: str, iteration: int) -> list[int]:
    """The iterations of the checkpoints in `root` older than `iteration`, newest first."""
    return [i for i in reversed(saved_iterations(root)) if i < iteration]


def older_checkpoints_hint(root: str, iteration: int) -> str:
    """'load an older one with --ckpt-step N' (the newest older one), or that there is none."""
    older = older_iterations(root, iteration)
    if not older:
        return f"there is no older checkpoint in {root}"
    also = f" (also kept: {', '.join(map(str, older[1:]))})" if older[1:] else ""
    return f"load an older one with --ckpt-step {older[0]}{also}"


def check_shard_files(root: str, path: str, iteration: int, metadata) -> None:
    """Raise CheckpointError naming the first file of checkpoint `path` (iteration `iteration`
    of `root`) that is missing or shorter than its DCP `metadata` says, and what to load."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for relative, size in sorted(needed.items()):
        file = os.path.join(path, relative)
        actual = os.path.getsize(file) if os.path.isfile(file) else None
        if actual is None or actual < size:
            what = "is missing" if actual is None else f"is truncated ({actual} of {size} bytes)"
            raise CheckpointError(
                f"checkpoint iteration {iteration} cannot be loaded: {file} {what} (an "
                f"interrupted copy or a full disk?); {older_checkpoints_hint(root, iteration)}"
            )
