"""The data tools' settings for the shared entry-point plumbing (megatron_ext.cli): log lines
with their level, DataError/TokenizerError -> ``error: ...`` and exit 2 (bad input, as every
command of the project), Ctrl-C or SIGTERM (Slurm preemption) -> exit 130 after the tool removed
its temporary files."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from megatron_ext import cli
from megatron_ext.data.readers import DataError
from megatron_ext.data.tokenizers import TokenizerError

__all__ = ["LOG_FORMAT", "setup_logging", "run_tool"]

LOG_FORMAT = "[%(asctime)s] %(levelname)s %(message)s"


def setup_logging(verbose: bool = False) -> None:
    """INFO (or DEBUG) lines to stderr with their level, once per process."""
    cli.setup_logging(verbose=verbose, fmt=LOG_FORMAT)


def run_tool(
    main: Callable[[Optional[Sequence[str]]], int], argv: Optional[Sequence[str]] = None
) -> int:
    """``megatron_ext.cli.run_tool`` with the data tools' settings (module docstring)."""
    return cli.run_tool(
        main,
        argv,
        errors=(DataError, TokenizerError),
        error_code=2,
        log_format=None,  # each tool sets logging up after parsing its flags
        interrupted="interrupted: temporary outputs removed, finished outputs kept",
        sigterm_interrupts=True,
    )
