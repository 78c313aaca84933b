"""Evaluate training checkpoints: the paper's tables and figures for your own runs.

    python tools/evaluate.py perplexity --load ckpt/lev --data-path data/val_text_document
    python tools/evaluate.py frequency --load ckpt/tied --load ckpt/lev --names tied lev \\
        --baseline tied --data-path data/val_text_document --output-dir eval/frequency

Subcommands perplexity, frequency, wikitext, lm-eval and curves (docs/evaluation.md has an
example of each). A checkpoint of any arm and layout loads at the layout asked for here (TP x PP
ranks under torchrun, or plain python for TP=PP=1). Exit codes: 0 done, 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from megatron_ext._paths import atomic_write
from megatron_ext.cli import run_tool
from megatron_ext.config.flags import ArgumentParser, add_flags
from megatron_ext.config.layout import ParallelConfig
from megatron_ext.config.model import ModelConfig
from megatron_ext.config.run import BatchConfig
from megatron_ext.data.readers import DataError
from megatron_ext.data.tokenizers import TokenizerError
from megatron_ext.evaluation.curves import plot_curves, read_run_curves, sample_efficiency
from megatron_ext.evaluation.outputs import EvaluationError, format_markdown_table, write_json
from megatron_ext.inference.generate import add_checkpoint_flags

logger = logging.getLogger("evaluate")


def _add_model_args(p: argparse.ArgumentParser, multiple: bool = False) -> None:
    g = p.add_argument_group("checkpoint and layout")
    if multiple:
        g.add_argument(
            "--load",
            action="append",
            required=True,
            help="a run's --save directory (repeat for several runs)",
        )
        g.add_argument("--names", nargs="+", help="a name per --load (default: directory names)")
    else:
        g.add_argument("--load", required=True, help="the run's --save directory")
    add_checkpoint_flags(g)
    add_flags(
        g,
        ParallelConfig,
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        help="the layout to evaluate at (any checkpoint loads at any layout)",
    )
    add_flags(
        g,
        BatchConfig,
        "micro_batch_size",
        default=16,
        help="sequences per forward (evaluation has no activations to keep)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to evaluate (one of)").add_mutually_exclusive_group(
        required=True
    )
    g.add_argument("--data-path", help="an indexed dataset prefix: every token once")
    g.add_argument("--text", nargs="+", help="text files (one document each) or jsonl files")
    g.add_argument(
        "--split",
        choices=("valid", "test"),
        help="the batches the training loop validated on (--eval-iters)",
    )
    p.add_argument("--json-key", default="text", help="jsonl field holding the text")
    _add_encoding_arg(p)


def _add_encoding_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--encoding",
        default="utf-8",
        help="text encoding of plain-text inputs (default utf-8; e.g. latin-1)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in (_add_perplexity, _add_frequency, _add_wikitext, _add_lm_eval, _add_curves):
        add_command(sub)
    return parser


def _add_perplexity(sub) -> None:
    p = sub.add_parser("perplexity", help="loss and perplexity of one checkpoint")
    _add_model_args(p)
    _add_data_args(p)
    p.add_argument("--output-dir", default=None, help="write perplexity.json/.md here")


def _add_frequency(sub) -> None:
    p = sub.add_parser("frequency", help="frequency-stratified perplexity of several runs")
    _add_model_args(p, multiple=True)
    _add_data_args(p)
    p.add_argument("--baseline", default=None, help="name of the run to compare against")
    p.add_argument(
        "--counts-prefix",
        nargs="+",
        default=None,
        help="training dataset prefixes whose _counts.npy bin the tokens "
        "(default: the first run's training data)",
    )
    p.add_argument(
        "--bin-edges",
        type=float,
        nargs="+",
        default=None,
        help="relative-frequency edges (default 1e-7 1e-6 1e-5 1e-4)",
    )
    p.add_argument("--output-dir", required=True, help="write frequency.json/.md and plots here")


def _add_wikitext(sub) -> None:
    p = sub.add_parser("wikitext", help="Wikitext-103 zero-shot perplexity")
    _add_model_args(p)
    p.add_argument("--file", required=True, help="wiki.test.tokens (or wiki.test.raw)")
    _add_encoding_arg(p)
    p.add_argument("--context", type=int, default=None, help="window (default --seq-length)")
    p.add_argument("--stride", type=int, default=None, help="window step (default context/2)")
    p.add_argument("--output-dir", default=None, help="write wikitext.json here")


def _add_lm_eval(sub) -> None:
    p = sub.add_parser("lm-eval", help="downstream tasks with lm-evaluation-harness")
    _add_model_args(p)
    p.add_argument(
        "--tasks",
        required=True,
        help="comma-separated, e.g. hellaswag,arc_easy,arc_challenge,piqa,"
        "winogrande,lambada_openai",
    )
    p.add_argument(
        "--num-fewshot",
        type=int,
        default=None,
        help="examples in each prompt (default: the task's)",
    )
    p.add_argument("--limit", type=float, default=None, help="items per task (for a smoke test)")
    p.add_argument("--include-path", default=None, help="a directory of extra task YAMLs")
    p.add_argument(
        "--max-gen-toks", type=int, default=256, help="most tokens a generation task generates"
    )
    p.add_argument("--seed", type=int, default=1234, help="seed of the harness's sampling")
    p.add_argument(
        "--log-samples",
        action="store_true",
        help="keep every item's requests and log-likelihoods (the harness's own flag); "
        "written to samples_<task>.jsonl in --output-dir",
    )
    p.add_argument("--output-dir", default=None, help="write lm_eval.json/.md here")


def _add_curves(sub) -> None:
    p = sub.add_parser("curves", help="loss curves and sample efficiency of several runs")
    p.add_argument(
        "--run",
        action="append",
        required=True,
        metavar="NAME=PATH",
        help="a run's TensorBoard directory or --log-jsonl file",
    )
    add_flags(
        p,
        ModelConfig,
        "seq_length",
        help="tokens per sample (default: each run's own, recorded in its TensorBoard "
        "directory; needed for a --log-jsonl file)",
    )
    p.add_argument("--smoothing", type=float, default=0.0, help="EMA weight for train losses")
    p.add_argument(
        "--reference",
        default=None,
        help="sample efficiency: tokens each run needs to reach this run's final validation "
        "loss; with more than two runs, curves.png shows each run's loss minus this run's "
        "(the absolute curves go to curves_absolute.png)",
    )
    p.add_argument("--output-dir", required=True, help="write curves.png and the tables here")


def cmd_curves(args) -> int:
    runs = []
    for spec in args.run:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise EvaluationError(f"--run {spec!r}: expected NAME=PATH")
        runs.append(read_run_curves(name, path, args.seq_length))
    by_name = {r.name: r for r in runs}
    if len(by_name) != len(runs):
        raise EvaluationError("--run names must be distinct")
    if args.reference is not None and args.reference not in by_name:
        raise EvaluationError(f"--reference {args.reference} is not one of {list(by_name)}")
    rows = []
    if args.reference is not None:
        reference = by_name[args.reference]
        # Computed before anything is written: a reference without validation losses fails here.
        rows = [sample_efficiency(r, reference) for r in runs if r is not reference]
    for png in plot_curves(
        runs, os.path.join(args.output_dir, "curves.png"), args.smoothing, args.reference
    ):
        print(f"wrote {png}")
    if args.reference is None:
        return 0
    cells = []
    for r in rows:
        print(r.message())
        target = [f"{r.target_loss:.4f}", f"{r.reference_tokens:.4g}"]
        tokens = "never" if r.tokens is None else f"{r.tokens:.4g}"
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        cells.append([r.run, r.reference, *target, tokens, ratio])
    header = ["run", "reference", "target loss", "reference tokens", "run tokens", "ratio"]
    table = format_markdown_table(header, cells)
    atomic_write(os.path.join(args.output_dir, "sample_efficiency.md"), table)
    write_json(os.path.join(args.output_dir, "sample_efficiency.json"), [r.as_dict() for r in rows])
    return 0


def _errors() -> tuple:
    # deferred: keeps megatron.core (slow) out of this module's import
    from megatron_ext.checkpoint.format import CheckpointError

    return (EvaluationError, DataError, TokenizerError, CheckpointError)


def _main(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "curves":
        return cmd_curves(args)
    # deferred: keeps torch and megatron.core (slow) out of this module's import (--help)
    from megatron_ext.evaluation.commands import COMMANDS

    return COMMANDS[args.command](args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command (tools/evaluate.py): parse ``argv``, run, return the exit code."""
    return run_tool(_main, argv, errors=_errors)


if __name__ == "__main__":
    sys.exit(main())
