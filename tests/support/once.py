"""Expensive test artifacts (a corpus, trained checkpoints) built once per test session, also
when pytest-xdist runs the session on several worker processes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from filelock import FileLock

__all__ = ["session_dir", "build_once"]


def session_dir(tmp_path_factory) -> Path:
    """The temporary directory the whole pytest session shares: under xdist each worker's
    basetemp is ``<session tmp>/popen-gwN``, so its parent; otherwise the basetemp itself."""
    base = Path(tmp_path_factory.getbasetemp())
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(shared: Path, name: str, build: Callable[[Path], object]):
    """``build(shared / name)``'s JSON-able result, computed by the first process that asks
    (under a file lock) and read back by the others, which wait for it meanwhile. A failed
    build is not recorded: the next process to ask starts over and reports its own failure.

    Builds that need other shared artifacts must ask for them inside ``build`` (locks are
    then taken in dependency order and cannot deadlock).
    """
    directory = Path(shared) / name
    done = Path(shared) / f"{name}.json"
    with FileLock(str(Path(shared) / f"{name}.lock")):
        if not done.is_file():
            if directory.exists():
                shutil.rmtree(directory)
            directory.mkdir(parents=True)
            result = build(directory)
            tmp = done.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(result))
            tmp.rename(done)
    return json.loads(done.read_text())
