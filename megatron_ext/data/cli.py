"""The data tools' settings for the shared entry-point plumbing (megatron_ext.cli): log lines
with their level, DataError/TokenizerError -> ``error: ...`` and exit 2 (bad input, as every
command of the project), Ctrl-C or SIGTERM (Slurm preemption) -> exit 130 after the tool removed
its temporary files."""

from __future__ import annotations

import argparse
from typing import Callable, Optional, Sequence

from megatron_ext import cli
from megatron_ext.config.data import DataConfig
from megatron_ext.config.flags import add_flags, flag_fields
from megatron_ext.data.readers import DataError
from megatron_ext.data.tokenizers import TokenizerError

__all__ = ["add_config_flags", "add_tokenizer_flags", "run_tool"]


def add_tokenizer_flags(group, *, required: bool, vocab_size_help: str) -> None:
    """The tokenizer's flags, `DataConfig`'s (Megatron-LM's --tokenizer-type and the files or
    sizes each type reads)."""
    add_flags(group, DataConfig, "tokenizer_type", required=required, help="tokenizer kind")
    add_flags(group, DataConfig, "tokenizer_model")
    add_flags(group, DataConfig, "vocab_size", help=vocab_size_help)
    add_flags(group, DataConfig, "vocab_file", "merge_file", "tiktoken_pattern")


def add_config_flags(group, cls: type, *required: str) -> None:
    """Every flag of the config `cls`; those of the fields `required` must be given."""
    for field in flag_fields(cls):
        add_flags(group, cls, field.name, **({"required": True} if field.name in required else {}))


def run_tool(
    build_parser: Callable[[], argparse.ArgumentParser],
    run: Callable[[argparse.Namespace], None],
    argv: Optional[Sequence[str]] = None,
) -> int:
    """Parse ``argv`` and ``run`` the tool under ``megatron_ext.cli.run_tool`` with the data
    tools' settings (module docstring); the exit code."""

    def main(argv: Optional[Sequence[str]]) -> int:
        run(build_parser().parse_args(argv))
        return 0

    return cli.run_tool(
        main,
        argv,
        errors=(DataError, TokenizerError),
        log_format="[%(asctime)s] %(levelname)s %(message)s",
        interrupted="interrupted: temporary outputs removed, finished outputs kept",
        sigterm_interrupts=True,
    )
