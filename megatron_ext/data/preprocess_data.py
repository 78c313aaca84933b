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
import json
import logging
from typing import Optional, Sequence

from megatron_ext.config.flags import ArgumentParser
from megatron_ext.data.cli import add_tokenizer_flags, run_tool, setup_logging
from megatron_ext.data.preprocess import PreprocessConfig, config_dict, preprocess

logger = logging.getLogger("preprocess_data")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n")[1])
    group = parser.add_argument_group("input data")
    group.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="jsonl files, globs or directories (.jsonl, .jsonl.zst, .json.gz, .jsonl.gz)",
    )
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys to extract from each json record (default: text)",
    )
    group.add_argument(
        "--split-by",
        default=None,
        metavar="FIELD",
        help="write one dataset per value of this dotted field, e.g. meta.pile_set_name",
    )
    group.add_argument(
        "--strict", action="store_true", help="abort on the first bad record instead of skipping it"
    )
    group = parser.add_argument_group("tokenizer")
    add_tokenizer_flags(group, required=True, vocab_size_help="for NullTokenizer")
    group.add_argument(
        "--append-eod",
        action="store_true",
        help="append an end-of-document token to every document",
    )
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix",
        required=True,
        help="datasets are written to <output-prefix>_<key>_document.{bin,idx}",
    )
    group.add_argument(
        "--shard-output",
        action="store_true",
        help="one output per input file: <output-prefix>_<shard name>",
    )
    group.add_argument(
        "--skip-existing",
        action="store_true",
        help="resume: skip outputs already finished (their _summary.json exists)",
    )
    group.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer worker processes")
    group.add_argument(
        "--concurrent-shards",
        type=int,
        default=None,
        help="with --shard-output: shards processed at once (default workers/4)",
    )
    group.add_argument(
        "--chunk-size-mb", type=float, default=1.0, help="MB of jsonl per worker task (default 1)"
    )
    group.add_argument(
        "--log-interval", type=int, default=1000, help="log progress every this many documents"
    )
    return parser


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _main(argv: Optional[Sequence[str]]) -> int:
    args = get_args(argv)
    setup_logging()
    config = PreprocessConfig(
        input=args.input,
        output_prefix=args.output_prefix,
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        tiktoken_pattern=args.tiktoken_pattern,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        json_keys=args.json_keys,
        append_eod=args.append_eod,
        workers=args.workers,
        log_interval=args.log_interval,
        split_by=args.split_by,
        shard_output=args.shard_output,
        concurrent_shards=args.concurrent_shards,
        skip_existing=args.skip_existing,
        overwrite=args.overwrite,
        strict=args.strict,
        chunk_bytes=max(1, int(args.chunk_size_mb * (1 << 20))),
    )
    logger.info("config: %s", json.dumps(config_dict(config), sort_keys=True))
    summaries = preprocess(config)
    bad = sum(summary["bad_records"] for summary in summaries)
    logger.info(
        "done: %d output(s), %d documents, %d tokens, %d bad records skipped",
        len(summaries),
        sum(s["documents"] for s in summaries),
        sum(s["tokens"] for s in summaries),
        bad,
    )
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command (tools/preprocess_data.py): parse ``argv``, run, return the exit code."""
    return run_tool(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
