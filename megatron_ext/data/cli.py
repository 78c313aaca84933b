"""The data tools' settings for the shared entry-point plumbing (megatron_ext.cli): log lines
with their level, DataError/TokenizerError -> ``error: ...`` and exit 2 (bad input, as every
command of the project), Ctrl-C or SIGTERM (Slurm preemption) -> exit 130 after the tool removed
its temporary files."""

from __future__ import annotations

import argparse
from typing import Callable, Optional, Sequence

from megatron_ext import cli
from megatron_ext.data.readers import DataError
from megatron_ext.data.tokenizers import TOKENIZER_TYPES, TokenizerError

__all__ = ["LOG_FORMAT", "add_tokenizer_flags", "setup_logging", "run_tool"]

LOG_FORMAT = "[%(asctime)s] %(levelname)s %(message)s"


def add_tokenizer_flags(
    group: argparse._ArgumentGroup, *, required: bool, vocab_size_help: str
) -> None:
    """The tokenizer's flags as Megatron-LM's data tools spell them (--tokenizer-type and the
    files or sizes each type reads)."""
    group.add_argument(
        "--tokenizer-type",
        required=required,
        default=None,
        choices=sorted(TOKENIZER_TYPES),
        help="tokenizer kind",
    )
    group.add_argument(
        "--tokenizer-model",
        default=None,
        help="SentencePiece .model, .tiktoken file, or HF tokenizer directory",
    )
    group.add_argument("--vocab-size", type=int, default=None, help=vocab_size_help)
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer merges.txt")
    group.add_argument(
        "--tiktoken-pattern",
        default="o200k",
        help="TikTokenizer split pattern: o200k, cl100k or a regex",
    )


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
