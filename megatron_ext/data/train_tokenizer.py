"""Train a SentencePiece tokenizer (BPE by default, unigram by flag) on jsonl corpora.

    python tools/train_tokenizer.py --input pile/train/00.jsonl.zst --model-prefix tok/pile50k \
        --vocab-size 50000 --input-sentence-size 2000000 --num-threads 32

writes tok/pile50k.model and tok/pile50k.vocab, usable with
``--tokenizer-type SentencePieceTokenizer --tokenizer-model tok/pile50k.model`` (and with stock
Megatron-LM's GPTSentencePieceTokenizer). Ids 0-3 are <pad>, <unk>, <s>, </s> (end of document).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from typing import Optional, Sequence

from megatron_ext.config.flags import ArgumentParser
from megatron_ext.data.cli import add_config_flags, run_tool
from megatron_ext.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece

logger = logging.getLogger("train_tokenizer")


def build_parser() -> argparse.ArgumentParser:
    """The command line of this tool: `TokenizerTrainingConfig`'s flags."""
    parser = ArgumentParser(description=__doc__.split("\n")[1])
    add_config_flags(parser, TokenizerTrainingConfig, "input", "model_prefix")
    return parser


def _run(args: argparse.Namespace) -> None:
    args.num_threads = args.num_threads or os.cpu_count() or 1
    config = TokenizerTrainingConfig(**vars(args))
    logger.info("config: %s", json.dumps(dataclasses.asdict(config), sort_keys=True))
    train_sentencepiece(config)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command (tools/train_tokenizer.py): parse ``argv``, run, return the exit code."""
    return run_tool(build_parser, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
