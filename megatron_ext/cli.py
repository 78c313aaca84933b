"""Entry-point plumbing shared by every command (tools/, pretrain_leviathan, the console
scripts): logging set-up, and expected failures turned into one ``error:`` line and an exit
code (--help's layout is `config.flags.ArgumentParser`'s).

    def main(argv=None) -> int:
        return run_tool(_main, argv, errors=(CheckpointError, TokenizerError))

Library code raises its own exception classes and never exits; only entry points call this.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import warnings
from typing import Callable, Optional, Sequence, TextIO, Union

__all__ = [
    "LOG_FORMAT",
    "LevelFormatter",
    "rank",
    "setup_logging",
    "run_tool",
]

LOG_FORMAT = "[%(asctime)s] %(message)s"
# Import-time chatter of optional back-ends that are absent on CPU machines.
_QUIET_WARNINGS = ".*(Apex|Transformer Engine|apex|cuda_graph_scope|full scope is deprecated).*"

ErrorClasses = Union[tuple, Callable[[], tuple]]


def rank() -> int:
    """This process's global rank under torchrun (0 when not launched by it)."""
    return int(os.environ.get("RANK", "0"))


class LevelFormatter(logging.Formatter):
    """Megatron-style lines; a warning or an error says so after the ``]`` of the prefix."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The formatted line, its level named when it is a warning or worse."""
        line = super().formatMessage(record)
        if record.levelno < logging.WARNING:
            return line
        return line.replace("] ", f"] {record.levelname}: ", 1)


def setup_logging(
    *,
    verbose: bool = False,
    stream: Optional[TextIO] = None,
    fmt: str = LOG_FORMAT,
    rank_prefix: bool = False,
    quiet_megatron: bool = True,
) -> None:
    """INFO (DEBUG with ``verbose``) lines on rank 0, errors only on the other ranks, to
    ``stream`` (default stderr); once per process (logging.basicConfig).

    ``rank_prefix``: the other ranks' lines start ``[rank N]`` instead of the time, and
    warnings and errors name their level. ``quiet_megatron``: drop megatron-core's INFO lines.
    """
    level = logging.DEBUG if verbose else logging.INFO
    handler = logging.StreamHandler(stream or sys.stderr)
    if rank_prefix:
        prefix_fmt = fmt if rank() == 0 else f"[rank {rank()}] %(message)s"
        handler.setFormatter(LevelFormatter(prefix_fmt, datefmt="%Y-%m-%d %H:%M:%S"))
    else:
        handler.setFormatter(logging.Formatter(fmt, datefmt="%Y-%m-%d %H:%M:%S"))
    # Warnings are the run's (every rank would repeat rank 0's): the other ranks show errors.
    logging.basicConfig(level=level if rank() == 0 else logging.ERROR, handlers=[handler])
    warnings.filterwarnings("ignore", message=_QUIET_WARNINGS)
    if quiet_megatron:
        logging.getLogger("megatron").setLevel(logging.WARNING)


def quiet_import_warnings() -> None:
    """Drop megatron-core's import-time notes a user cannot act on (Apex / Transformer Engine
    missing, deprecations), for a command that imports it before `setup_logging`."""
    warnings.filterwarnings("ignore", message=_QUIET_WARNINGS)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _shutdown_distributed() -> None:
    """Destroy the process groups a command created (no-op if torch.distributed is unused)."""
    dist = sys.modules.get("torch.distributed")  # loaded by the command if it used it
    if dist is not None and dist.is_available() and dist.is_initialized():
        # deferred: keeps torch and megatron.core (slow) out of this module's import
        from megatron_ext.parallel import destroy_parallel

        destroy_parallel()
        dist.destroy_process_group()


def run_tool(
    main: Callable[[Optional[Sequence[str]]], int],
    argv: Optional[Sequence[str]] = None,
    *,
    errors: ErrorClasses = (),
    error_code: int = 2,
    log_format: Optional[str] = LOG_FORMAT,
    log_stream: Optional[TextIO] = None,
    interrupted: str = "interrupted",
    sigterm_interrupts: bool = False,
    shutdown_distributed: bool = True,
) -> int:
    """Run a command's ``main(argv)`` and return its exit code.

    Args:
        errors: the expected failure classes (or a function returning them, so that heavy
            modules are imported only when the command runs): each becomes ``error: <message>``
            on stderr (rank 0 only) and ``error_code``; anything else keeps its traceback.
        log_format: the logging format (see :func:`setup_logging`); None leaves logging alone.
        interrupted: the line printed on Ctrl-C (exit 130).
        sigterm_interrupts: treat SIGTERM (Slurm preemption, ``kill``) as Ctrl-C.
        shutdown_distributed: destroy the process groups the command left initialized.
    """
    if log_format is not None:
        setup_logging(stream=log_stream, fmt=log_format)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if sigterm_interrupts else None
    try:
        return main(argv)
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr, flush=True)
        return 130
    except Exception as error:
        expected = errors() if callable(errors) else errors
        if not isinstance(error, tuple(expected)):
            raise
        if rank() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return error_code
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if shutdown_distributed:
            _shutdown_distributed()
