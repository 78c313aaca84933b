"""Write a small deterministic Pile-format corpus (jsonl.zst) for demos and tests.

    python tools/make_sample_corpus.py --output data/sample --size-mb 4 --seed 1234

writes data/sample/train/00.jsonl.zst (more shards with --num-shards), data/sample/val.jsonl.zst
and data/sample/test.jsonl.zst: Zipf-distributed words with a long tail of rare ones, topic
structure per pile_set_name, and bigram structure a small model can learn.
"""

from __future__ import annotations

import argparse
import logging
from typing import Optional, Sequence

from megatron_ext.config.flags import ArgumentParser
from megatron_ext.data.cli import run_tool, setup_logging
from megatron_ext.data.sample_corpus import SampleCorpusSpec, write_sample_corpus

logger = logging.getLogger("make_sample_corpus")


def build_parser() -> argparse.ArgumentParser:
    """The command line of this tool."""
    parser = ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument(
        "--size-mb",
        type=float,
        default=4.0,
        help="approximate uncompressed size of the train split in MB",
    )
    parser.add_argument("--seed", type=int, default=1234, help="seed of the generated text")
    parser.add_argument("--num-shards", type=int, default=1, help="train shards")
    parser.add_argument("--vocab-words", type=int, default=20000, help="word types")
    return parser


def _main(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    spec = SampleCorpusSpec(
        size_mb=args.size_mb,
        seed=args.seed,
        num_train_shards=args.num_shards,
        vocab_words=args.vocab_words,
    )
    paths = write_sample_corpus(args.output, spec=spec)
    logger.info("wrote %d files under %s", len(paths), args.output)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command (tools/make_sample_corpus.py): parse ``argv``, run, return the exit code."""
    return run_tool(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
