"""Paths: how they are shown to users, and files written under them atomically.

What tools print goes through :func:`display_path` (``runs/x/ckpt``, not the machine's absolute
path). Every file written under a temporary name and renamed when complete goes through
:func:`atomic_path` / :func:`atomic_open` / :func:`atomic_write`.
"""

from __future__ import annotations

import contextlib
import os
from typing import IO, Iterator, Union

__all__ = ["atomic_open", "atomic_path", "atomic_write", "display_path", "fsync_dir"]


def display_path(path: str | os.PathLike) -> str:
    """``path`` relative to the current directory when it lies below it, else as given."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        return text
    rel = os.path.relpath(text)
    return text if rel == ".." or rel.startswith(".." + os.sep) else rel


def fsync_dir(path: str) -> None:
    """Make a rename inside directory ``path`` durable (best effort: not every OS can)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary name beside ``path`` (whose directory is created) for the block to write; it
    replaces ``path`` when the block completes and is removed when it raises."""
    path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, fsync: bool = False) -> Iterator[IO]:
    """`open` (text: UTF-8) of a temporary name that replaces ``path`` when the block completes;
    ``fsync``: the file and the rename reach the disk before it returns."""
    encoding = {} if "b" in mode else {"encoding": "utf-8"}
    with atomic_path(path) as tmp, open(tmp, mode, **encoding) as handle:
        yield handle
        if fsync:
            handle.flush()
            os.fsync(handle.fileno())
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write(path: str | os.PathLike, data: Union[str, bytes], *, fsync: bool = False) -> str:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary name; returns ``path``."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w", fsync=fsync) as handle:
        handle.write(data)
    return os.fspath(path)
