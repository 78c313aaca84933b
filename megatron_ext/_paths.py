"""How paths are shown to users: relative to the working directory when below it.

Tools resolve paths to absolute ones internally (checkpoints, outputs); what they print and log
goes through :func:`display_path`, so output run from the repository root reads
``runs/x/ckpt`` rather than the machine's absolute path.
"""

from __future__ import annotations

import os

__all__ = ["display_path"]


def display_path(path: str | os.PathLike) -> str:
    """``path`` relative to the current directory when it lies below it, else as given."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        return text
    rel = os.path.relpath(text)
    return text if rel == ".." or rel.startswith(".." + os.sep) else rel
