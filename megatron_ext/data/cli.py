"""Shared plumbing for the data tools: logging to stderr and one-line errors."""

from __future__ import annotations

import logging
import signal
import sys
from typing import Callable, Optional, Sequence

from megatron_ext.data.readers import DataError
from megatron_ext.data.tokenizers import TokenizerError

__all__ = ["setup_logging", "run_tool"]


def setup_logging(verbose: bool = False) -> None:
    """INFO (or DEBUG) lines to stderr, Megatron-style, once per process."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        stream=sys.stderr,
        format="[%(asctime)s] %(levelname)s %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_tool(
    main: Callable[[Optional[Sequence[str]]], int], argv: Optional[Sequence[str]] = None
) -> int:
    """Run a tool's ``main``; turn expected failures into one-line messages and exit codes.

    DataError/TokenizerError -> ``error: ...`` and exit 1; Ctrl-C or SIGTERM (Slurm preemption)
    -> exit 130 after the tool removed its temporary files.
    """
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return main(argv)
    except (DataError, TokenizerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: temporary outputs removed, finished outputs kept", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
