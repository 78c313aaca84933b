"""Starting worker processes that leave SIGINT/SIGTERM to their parent.

A terminal's Ctrl-C, torchrun and Slurm signal whole process groups, so forked workers get the
parent's signals too. `blocked` keeps the signals pending while workers are forked (they
inherit the mask, and a fork starts with no pending signals); each worker then installs its own
dispositions and unblocks them, so a signal arriving during start-up cannot reach a worker that
still runs the parent's handlers.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator

__all__ = ["TERMINATION_SIGNALS", "blocked", "unblock"]

TERMINATION_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def blocked(signals=TERMINATION_SIGNALS) -> Iterator[None]:
    """Block `signals` in this thread for the duration (threads and processes started inside
    inherit the mask); the previous mask is restored after, delivering what arrived."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock(signals=TERMINATION_SIGNALS) -> None:
    """In a worker started under `blocked`, after it set its dispositions."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
