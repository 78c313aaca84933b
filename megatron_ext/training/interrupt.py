"""Ctrl-C during training: one line saying what was kept and what was lost.

A terminal delivers SIGINT to every process of the job, and torchrun forwards it again: each
rank turns the first one into KeyboardInterrupt and ignores the repeats (so that the clean-up is
not cut short). `pretrain` turns it, or a collective that failed after it, into
`TrainingInterrupted`.
"""

from __future__ import annotations

import signal
from typing import Optional

from megatron_ext.checkpoint.format import read_latest_iteration

__all__ = ["SignalWatch", "TrainingInterrupted", "interrupted_line"]


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run; the message says what was kept and what was lost."""


class SignalWatch:
    """Notes that one of `signals` arrived (`received`); with `interrupt`, the first raises
    KeyboardInterrupt and repeats are ignored (SIGINT while training). `release` puts the
    previous handlers back; outside the main thread none is installed. After an interrupt the
    repeats stay ignored: torchrun forwards the terminal's SIGINT again, which may land after
    the clean-up, while the command prints its one line and exits 130."""

    def __init__(self, signals=(signal.SIGINT,), interrupt: bool = True) -> None:
        self.received, self.interrupt = False, interrupt
        self._previous: dict = {}
        try:
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: leave the signals alone
            pass

    def _handle(self, signum: int, frame: object) -> None:
        if not self.received:
            self.received = True
            if self.interrupt:
                raise KeyboardInterrupt

    def release(self) -> None:
        """Put back the handlers that were there before (after an interrupt: ignore them)."""
        stay_ignored = self.interrupt and self.received
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if stay_ignored else previous)
        self._previous = {}


def interrupted_line(save: Optional[str], started: int, reached: Optional[int]) -> str:
    """What Ctrl-C kept and lost: `started` is the iteration the run loaded (0: none),
    `reached` the last completed iteration (None: interrupted before training began)."""
    if reached is None:
        return "interrupted before training began: nothing was trained or saved"
    latest = read_latest_iteration(save) if save else None
    resume = f" (resume with --load {save})" if latest is not None else ""
    if latest is not None and latest >= reached:
        return (
            f"interrupted after iteration {reached}: its checkpoint in --save {save} is "
            f"complete, nothing was lost{resume}"
        )
    first = max(latest or 0, started) + 1
    if reached < first:
        lost = "no iteration completed since the start, so none was"
    elif first == reached:
        lost = f"iteration {reached} was"
    else:
        lost = f"iterations {first}-{reached} were"
    if latest is not None:
        kept = f"kept the last complete checkpoint, iteration {latest} in --save {save}"
    elif save:
        kept = f"no checkpoint was saved in --save {save}"
    else:
        kept = "no checkpoint was saved (no --save)"
    return f"interrupted after iteration {reached}: {kept}; {lost} lost{resume}"
