"""Tokenise jsonl corpora into Megatron-Core indexed datasets (Megatron-LM's flags).

    python tools/preprocess_data.py --input pile/val.jsonl.zst --output-prefix data/pile_val \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod \
        --workers 16

writes data/pile_val_text_document.{bin,idx}, data/pile_val_text_document_counts.npy and
data/pile_val_summary.json. With --shard-output every input file gets its own output
(``<output-prefix>_<shard>``), shards run in parallel and --skip-existing resumes a stopped run;
tools/merge_datasets.py joins them. See docs/data.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from typing import Optional, Sequence

from megatron_ext.config.flags import ArgumentParser, add_flags
from megatron_ext.data.cli import add_tokenizer_flags, run_tool
from megatron_ext.data.preprocess import PreprocessConfig, preprocess

logger = logging.getLogger("preprocess_data")


def build_parser() -> argparse.ArgumentParser:
    """The command line of this tool: `PreprocessConfig`'s flags and the tokenizer's."""
    parser = ArgumentParser(description=__doc__.split("\n")[1])
    group = parser.add_argument_group("input data")
    add_flags(group, PreprocessConfig, "input", required=True)
    add_flags(group, PreprocessConfig, "json_keys", "split_by", "strict")
    group = parser.add_argument_group("tokenizer")
    add_tokenizer_flags(group, required=True, vocab_size_help="for NullTokenizer")
    add_flags(group, PreprocessConfig, "append_eod")
    group = parser.add_argument_group("output data")
    add_flags(group, PreprocessConfig, "output_prefix", required=True)
    add_flags(group, PreprocessConfig, "shard_output", "skip_existing", "overwrite")
    group = parser.add_argument_group("runtime")
    add_flags(group, PreprocessConfig, "workers", "concurrent_shards", "chunk_size_mb")
    add_flags(group, PreprocessConfig, "log_interval")
    return parser


def _run(args: argparse.Namespace) -> None:
    config = PreprocessConfig(**vars(args))
    logger.info("config: %s", json.dumps(dataclasses.asdict(config), sort_keys=True))
    summaries = preprocess(config)
    logger.info(
        "done: %d output(s), %d documents, %d tokens, %d bad records skipped",
        len(summaries),
        sum(s["documents"] for s in summaries),
        sum(s["tokens"] for s in summaries),
        sum(s["bad_records"] for s in summaries),
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command (tools/preprocess_data.py): parse ``argv``, run, return the exit code."""
    return run_tool(build_parser, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
