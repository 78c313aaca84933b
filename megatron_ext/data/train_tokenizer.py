"""Train a SentencePiece tokenizer (BPE by default, unigram by flag) on jsonl corpora.

    python tools/train_tokenizer.py --input pile/train/00.jsonl.zst --model-prefix tok/pile50k \
        --vocab-size 50000 --input-sentence-size 2000000 --num-threads 32

writes tok/pile50k.model and tok/pile50k.vocab, usable with
``--tokenizer-type SentencePieceTokenizer --tokenizer-model tok/pile50k.model`` (and with stock
Megatron-LM's GPTSentencePieceTokenizer). Ids 0-3 are <pad>, <unk>, <s>, </s> (end of document).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict
from typing import Optional, Sequence

from megatron_ext.config.flags import ArgumentParser
from megatron_ext.data.cli import run_tool, setup_logging
from megatron_ext.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece

logger = logging.getLogger("train_tokenizer")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="jsonl files, globs or directories (.jsonl, .jsonl.zst, .json.gz)",
    )
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="json keys to read text from"
    )
    parser.add_argument(
        "--model-prefix",
        required=True,
        help="output: <model-prefix>.model and <model-prefix>.vocab",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=50000,
        help="vocabulary size including special and byte ids (paper: 50k/100k/200k)",
    )
    parser.add_argument(
        "--model-type", choices=["bpe", "unigram"], default="bpe", help="SentencePiece algorithm"
    )
    parser.add_argument(
        "--input-sentence-size",
        type=int,
        default=2_000_000,
        help="sentences sampled (reservoir) for training; bounds memory",
    )
    parser.add_argument(
        "--max-documents",
        type=int,
        default=None,
        help="stop reading input after this many documents",
    )
    parser.add_argument(
        "--max-sentence-length",
        type=int,
        default=4192,
        help="bytes; longer lines are cut into pieces",
    )
    parser.add_argument(
        "--character-coverage",
        type=float,
        default=0.9995,
        help="fraction of characters the vocabulary covers (the rest: byte fallback or <unk>)",
    )
    parser.add_argument(
        "--no-byte-fallback",
        dest="byte_fallback",
        action="store_false",
        help="disable byte fallback (unknown characters become <unk>)",
    )
    parser.add_argument(
        "--no-split-digits",
        dest="split_digits",
        action="store_false",
        help="let pieces hold several digits (default: one piece per digit)",
    )
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed")
    parser.add_argument(
        "--num-threads", type=int, default=None, help="training threads (default: the CPU count)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing model")
    return parser


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.num_threads = args.num_threads or os.cpu_count() or 1
    return args


def _main(argv: Optional[Sequence[str]]) -> int:
    args = get_args(argv)
    setup_logging()
    config = TokenizerTrainingConfig(**vars(args))
    logger.info("config: %s", json.dumps(asdict(config), sort_keys=True))
    train_sentencepiece(config)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command (tools/train_tokenizer.py): parse ``argv``, run, return the exit code."""
    return run_tool(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
