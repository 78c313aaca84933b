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

from megatron_ext.config.flags import ArgumentParser, add_flags, flag_values
from megatron_ext.data.cli import run_tool
from megatron_ext.data.sample_corpus import SampleCorpusSpec, write_sample_corpus

logger = logging.getLogger("make_sample_corpus")


def build_parser() -> argparse.ArgumentParser:
    """The command line of this tool: the output and `SampleCorpusSpec`'s flags."""
    parser = ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--output", required=True, help="output directory")
    add_flags(parser, SampleCorpusSpec)
    return parser


def _run(args: argparse.Namespace) -> None:
    spec = SampleCorpusSpec(**flag_values(SampleCorpusSpec, args))
    paths = write_sample_corpus(args.output, spec)
    logger.info("wrote %d files under %s", len(paths), args.output)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command (tools/make_sample_corpus.py): parse ``argv``, run, return the exit code."""
    return run_tool(build_parser, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
