"""Concatenate indexed datasets (e.g. per-shard preprocess outputs) and sum their token counts.

    python tools/merge_datasets.py --input "data/shards/train_*_text_document" \
        --output-prefix data/pile_train_text_document

``--input`` takes dataset prefixes, globs of ``.idx`` files or prefixes, or a directory (every
dataset in it, as Megatron-LM's merge_datasets.py). Inputs are merged in sorted order. A prefix
with a dataset wins over a directory of the same name: training creates one next to each
dataset (megatron's index cache, ``<prefix>/cache/GPTDataset_indices``).
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
from typing import Optional, Sequence

from megatron_ext.config.flags import ArgumentParser
from megatron_ext.data.cli import run_tool
from megatron_ext.data.indexed import merge_datasets
from megatron_ext.data.readers import DataError

logger = logging.getLogger("merge_datasets")


def _prefixes(inputs: Sequence[str]) -> list[str]:
    prefixes: list[str] = []
    for arg in inputs:
        if os.path.isfile(arg + ".idx"):
            found = [arg + ".idx"]
        elif os.path.isdir(arg):
            found = sorted(glob.glob(os.path.join(glob.escape(arg), "*.idx")))
        else:
            pattern = arg if arg.endswith(".idx") else arg + "*.idx"
            found = sorted(glob.glob(pattern))
        if not found:
            raise DataError(f"no datasets found for --input {arg}")
        prefixes.extend(path[: -len(".idx")] for path in found)
    return list(dict.fromkeys(prefixes))


def build_parser() -> argparse.ArgumentParser:
    """The command line of this tool."""
    parser = ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="dataset prefixes, globs, or a directory of datasets",
    )
    parser.add_argument("--output-prefix", required=True, help="prefix of the merged dataset")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument(
        "--allow-missing-counts",
        action="store_true",
        help="merge even when some inputs lack _counts.npy (then none is written)",
    )
    return parser


def _run(args: argparse.Namespace) -> None:
    prefixes = [p for p in _prefixes(args.input) if p != args.output_prefix]
    logger.info("merging %d datasets into %s", len(prefixes), args.output_prefix)
    merge_datasets(
        prefixes,
        args.output_prefix,
        overwrite=args.overwrite,
        require_counts=not args.allow_missing_counts,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command (tools/merge_datasets.py): parse ``argv``, run, return the exit code."""
    return run_tool(build_parser, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
