"""Write the token counts of existing datasets (e.g. made by Megatron-LM's preprocess_data.py,
which writes none), and with the tokenizer given its record, as this project's preprocess does.

    python tools/count_tokens.py --data-path data/pile_text_document \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2/vocab.json --merge-file gpt2/merges.txt

writes data/pile_text_document_counts.npy (int64, one count per id of the tokenizer's
vocabulary), which frequency evaluation (tools/evaluate.py frequency) reads, and
data/pile_text_document_tokenizer.json (which tokenizer made the ids; training and evaluation
then check it). Without a tokenizer the counts run to --vocab-size (default: the largest id + 1)
and no record is written. Each file is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Optional, Sequence

import numpy as np

from megatron_ext._paths import atomic_open
from megatron_ext.config.flags import ArgumentParser
from megatron_ext.data.cli import add_tokenizer_flags, run_tool
from megatron_ext.data.fingerprint import place_sidecar, sidecar_path, tokenizer_record
from megatron_ext.data.indexed import check_dataset, counts_path, get_bin_path, index_header
from megatron_ext.data.readers import DataError
from megatron_ext.data.tokenizers import Tokenizer, build_tokenizer

logger = logging.getLogger("count_tokens")

_CHUNK_TOKENS = 1 << 24


def count_tokens(prefix: str) -> np.ndarray:
    """int64 counts of every id in the dataset `prefix` ([largest id + 1]), read in chunks."""
    check_dataset(prefix)  # a damaged dataset is named before it is read
    dtype = index_header(prefix)[0]
    if not os.path.getsize(get_bin_path(prefix)):
        return np.zeros(0, np.int64)
    tokens = np.memmap(get_bin_path(prefix), dtype, "r")
    counts = np.zeros(0, np.int64)
    for start in range(0, tokens.size, _CHUNK_TOKENS):
        part = np.bincount(np.asarray(tokens[start : start + _CHUNK_TOKENS], np.int64))
        if part.size > counts.size:
            counts = np.pad(counts, (0, part.size - counts.size))
        counts[: part.size] += part
    del tokens
    return counts


def write_counts(
    prefix: str,
    tokenizer: Optional[Tokenizer] = None,
    vocab_size: Optional[int] = None,
    overwrite: bool = False,
) -> str:
    """Count the ids of `prefix` and write `<prefix>_counts.npy` (with `tokenizer`, also its
    record); the counts path. DataError: counts there already (without `overwrite`), or an id
    the vocabulary lacks."""
    path = counts_path(prefix)
    if os.path.exists(path) and not overwrite:
        raise DataError(f"{path} exists; pass --overwrite to count {prefix} again")
    counts = count_tokens(prefix)
    size = tokenizer.vocab_size if tokenizer is not None else vocab_size
    if size is not None and counts.size > size:
        what = f"the tokenizer ({tokenizer.type_name})" if tokenizer else "--vocab-size"
        raise DataError(
            f"{prefix} holds token id {counts.size - 1} but {what} has only {size} ids: the "
            "dataset was made with another tokenizer; pass the tokenizer it was made with"
        )
    if size is not None:
        counts = np.pad(counts, (0, size - counts.size))
    with atomic_open(path, "wb") as handle:  # a file object: no second ".npy" suffix
        np.save(handle, counts, allow_pickle=False)
    if tokenizer is not None:
        place_sidecar(prefix, tokenizer_record(tokenizer))
    return path


def build_parser() -> argparse.ArgumentParser:
    """The command line of this tool."""
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--data-path", nargs="+", required=True, help="dataset prefixes (without .bin/.idx)"
    )
    group = parser.add_argument_group("tokenizer (optional: the ids' vocabulary and its record)")
    add_tokenizer_flags(
        group,
        required=False,
        vocab_size_help="NullTokenizer's ids; without a tokenizer, the length of the counts "
        "(default: the largest id + 1)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace existing counts")
    return parser


def _run(args: argparse.Namespace) -> None:
    tokenizer = None
    if args.tokenizer_type is not None:
        tokenizer = build_tokenizer(**vars(args))
    for prefix in args.data_path:
        path = write_counts(prefix, tokenizer, args.vocab_size, overwrite=args.overwrite)
        counts = np.load(path, mmap_mode="r")
        logger.info(
            "%s: %d tokens, %d ids counted%s",
            path,
            int(counts.sum()),
            counts.size,
            f"; tokenizer record {sidecar_path(prefix)}"
            if tokenizer
            else " (no tokenizer given: the length is the largest id + 1 unless --vocab-size; "
            "frequency evaluation needs the tokenizer's vocabulary size)",
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command (tools/count_tokens.py): parse ``argv``, run, return the exit code."""
    return run_tool(build_parser, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
