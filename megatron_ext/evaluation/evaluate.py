"""Evaluate training checkpoints: the paper's tables and figures for your own runs.

    python tools/evaluate.py perplexity --load ckpt/lev --data-path data/val_text_document
    python tools/evaluate.py perplexity --load ckpt/lev --split valid      # the loop's batches
    python tools/evaluate.py frequency --load ckpt/tied --load ckpt/lev --names tied lev \\
        --baseline tied --data-path data/val_text_document --output-dir eval/frequency
    python tools/evaluate.py wikitext --load ckpt/lev --file wikitext-103/wiki.test.tokens
    python tools/evaluate.py lm-eval --load ckpt/lev --tasks hellaswag,arc_easy,piqa
    python tools/evaluate.py curves --run tied=tb/tied --run lev=tb/lev --seq-length 512 \\
        --reference tied --output-dir eval/curves

Checkpoints of any arm saved at any TP/PP layout load at the layout asked for here
(--tensor-model-parallel-size/--pipeline-model-parallel-size; launch TP x PP ranks with
torchrun, or plain python for TP=PP=1). The options shared with training are the training
configs' own flags; the model and its sequence length come from the checkpoint's args.json.
docs/evaluation.md has a worked example of each.
Exit codes: 0 done, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Optional, Sequence

from megatron_ext._paths import atomic_write, display_path
from megatron_ext.cli import ArgumentParser, run_tool
from megatron_ext.config.flags import add_flags
from megatron_ext.config.layout import ParallelConfig
from megatron_ext.config.model import ModelConfig
from megatron_ext.config.run import BatchConfig
from megatron_ext.data.fingerprint import check_dataset_tokenizers, tokenizer_record
from megatron_ext.data.indexed import check_dataset, get_idx_path
from megatron_ext.data.readers import DataError
from megatron_ext.data.tokenizers import TokenizerError
from megatron_ext.evaluation.curves import plot_curves, read_run_curves, sample_efficiency
from megatron_ext.evaluation.frequency import (
    DEFAULT_EDGES,
    FrequencyBins,
    training_counts,
    write_frequency_report,
)
from megatron_ext.evaluation.outputs import (
    EvaluationError,
    format_markdown_table,
    write_json,
)

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
    g.add_argument(
        "--ckpt-step",
        "--iteration",
        dest="ckpt_step",
        type=int,
        default=None,
        help="iteration (default: latest)",
    )
    g.add_argument(
        "--tokenizer-model",
        default=None,
        help="the tokenizer file, if not where the run recorded it (for GPT2BPETokenizer: the "
        "directory holding its vocab and merge files)",
    )
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

    p = sub.add_parser("perplexity", help="loss and perplexity of one checkpoint")
    _add_model_args(p)
    _add_data_args(p)
    p.add_argument("--output-dir", default=None, help="write perplexity.json/.md here")

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

    p = sub.add_parser("wikitext", help="Wikitext-103 zero-shot perplexity")
    _add_model_args(p)
    p.add_argument("--file", required=True, help="wiki.test.tokens (or wiki.test.raw)")
    _add_encoding_arg(p)
    p.add_argument("--context", type=int, default=None, help="window (default --seq-length)")
    p.add_argument("--stride", type=int, default=None, help="window step (default context/2)")
    p.add_argument("--output-dir", default=None, help="write wikitext.json here")

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
    return parser


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


# ------------------------------------------------------------------------------ helpers


def _rank0() -> bool:
    # deferred: keeps torch (slow) out of this module's import
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _init(args):
    """This rank's `ProcessGroups` at the requested layout (initialised here if needed)."""
    # deferred: keeps megatron.core (slow) out of this module's import
    from megatron_ext.inference.loading import init_inference_parallel

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp * pp:
        raise EvaluationError(
            f"evaluation runs on TP x PP = {tp * pp} ranks but the world has {world}; launch "
            f"torchrun --nproc-per-node {tp * pp} (or plain python for TP=PP=1)"
        )
    if args.micro_batch_size < 1:
        raise EvaluationError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    return init_inference_parallel(tp, pp)


def _check_datasets_first(args) -> None:
    """A damaged evaluation or counts dataset is named before any checkpoint is loaded
    (`data.indexed.check_dataset`; a missing one is reported where it is read)."""
    for prefix in [getattr(args, "data_path", None), *(getattr(args, "counts_prefix", None) or [])]:
        if prefix and os.path.isfile(get_idx_path(prefix)):
            check_dataset(prefix)


def _load(args, load_dir: str, pg):
    # deferred: keeps torch (slow) out of this module's import
    from megatron_ext.evaluation.scoring import load_for_evaluation

    loaded = load_for_evaluation(
        load_dir, pg, iteration=args.ckpt_step, tokenizer_model=args.tokenizer_model
    )
    if _rank0():
        logger.info(
            "loaded %s (iteration %d, --embedding-type %s) at TP=%d PP=%d",
            display_path(loaded.run.root),
            loaded.run.iteration,
            loaded.run.embedding_type,
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
        )
    return loaded


def _batches(args, loaded):
    """(batches, target-token count, description) of the chosen evaluation set."""
    # deferred: keeps torch (slow) out of this module's import
    from megatron_ext.data.loading import check_vocab_sizes, dataset_vocab_size
    from megatron_ext.evaluation.perplexity import (
        dataset_documents,
        loop_validation_batches,
        pack_stream,
        text_documents,
    )

    mbs, seq = args.micro_batch_size, loaded.seq_length
    if args.split:
        batches, total = loop_validation_batches(loaded.run, loaded.tokenizer, mbs, args.split)
        return batches, total, f"the run's {args.split} batches (--eval-iters)"
    if args.data_path:
        documents, total = dataset_documents(args.data_path)
        check_vocab_sizes(
            loaded.tokenizer.vocab_size, dataset_vocab_size(args.data_path), None, args.data_path
        )
        check_dataset_tokenizers(
            [args.data_path],
            tokenizer_record(loaded.tokenizer),
            against="the checkpoint's tokenizer",
            fix="score the checkpoint on data made with its tokenizer",
        )
        return pack_stream(documents, seq, mbs), total - 1, args.data_path
    documents, total = text_documents(args.text, loaded.tokenizer, args.json_key, args.encoding)
    return pack_stream(documents, seq, mbs), total - 1, " ".join(args.text)


# ------------------------------------------------------------------------------ commands


def cmd_perplexity(args) -> int:
    # deferred: keeps torch (slow) out of this module's import
    from megatron_ext.evaluation.perplexity import LossTotals
    from megatron_ext.evaluation.scoring import score_batches

    pg = _init(args)
    _check_datasets_first(args)
    loaded = _load(args, args.load, pg)
    batches, total, source = _batches(args, loaded)
    totals = LossTotals()
    speed = score_batches(
        loaded.scorer, batches, [totals], total_targets=total, show_progress=not args.no_progress
    )
    if totals.tokens == 0:
        raise EvaluationError(f"{source}: no tokens were scored (empty evaluation set)")
    result = dict(
        checkpoint=loaded.run.path,
        embedding_type=loaded.run.embedding_type,
        data=source,
        **totals.as_dict(),
        tokens_per_second=speed["tokens_per_second"],
    )
    if _rank0():
        print(
            f"{display_path(loaded.run.path)}: {source}: {totals.tokens} tokens, "
            f"loss {totals.loss:.6f}, "
            f"perplexity {totals.perplexity:.4f} ({speed['tokens_per_second']:.0f} tokens/s)"
        )
        if args.output_dir:
            write_json(os.path.join(args.output_dir, "perplexity.json"), result)
            table = format_markdown_table(
                ["checkpoint", "data", "tokens", "loss", "perplexity"],
                [
                    [
                        loaded.run.path,
                        source,
                        totals.tokens,
                        f"{totals.loss:.4f}",
                        f"{totals.perplexity:.3f}",
                    ]
                ],
            )
            atomic_write(os.path.join(args.output_dir, "perplexity.md"), table)
    return 0


def cmd_frequency(args) -> int:
    # deferred: keeps torch (slow) out of this module's import
    from megatron_ext.data.loading import blend_prefixes
    from megatron_ext.evaluation.scoring import score_batches

    names = args.names or [os.path.basename(os.path.normpath(p)) for p in args.load]
    if len(names) != len(args.load) or len(set(names)) != len(names):
        raise EvaluationError("--names needs one distinct name per --load")
    if args.baseline is not None and args.baseline not in names:
        raise EvaluationError(f"--baseline {args.baseline} is not one of --names {names}")
    pg = _init(args)
    _check_datasets_first(args)
    results, counts, prefixes = {}, None, args.counts_prefix
    for name, load_dir in zip(names, args.load):
        loaded = _load(args, load_dir, pg)
        if counts is None:
            if prefixes is None:
                data = loaded.run.data
                blend = data.data_path or data.train_data_path
                prefixes = blend_prefixes(blend)
            counts = training_counts(
                prefixes, loaded.tokenizer.vocab_size, tokenizer_record(loaded.tokenizer)
            )
            if _rank0():
                logger.info("binning by the token counts of %s", ", ".join(prefixes))
        elif len(counts) != loaded.tokenizer.vocab_size:
            raise EvaluationError(
                f"{load_dir} uses a tokenizer of {loaded.tokenizer.vocab_size} ids, the counts "
                f"have {len(counts)}: compare runs trained with the same tokenizer"
            )
        bins = FrequencyBins(counts, args.bin_edges or DEFAULT_EDGES)
        batches, total, source = _batches(args, loaded)
        score_batches(
            loaded.scorer,
            batches,
            [bins],
            total_targets=total,
            desc=name,
            show_progress=not args.no_progress,
        )
        results[name] = bins.stats
        del loaded
    if _rank0():
        paths = write_frequency_report(results, args.baseline, args.output_dir)
        with open(paths["md"]) as handle:
            print(handle.read(), end="")
        print("wrote " + ", ".join(paths[k] for k in ("md", "csv", "json", "png")))
    return 0


def cmd_wikitext(args) -> int:
    # deferred: keeps torch (slow) out of this module's import
    from megatron_ext.evaluation.perplexity import LossTotals
    from megatron_ext.evaluation.scoring import score_batches
    from megatron_ext.evaluation.wikitext import (
        WikitextResult,
        prepare_streams,
        read_wikitext,
        rolling_windows,
        window_batches,
    )

    articles = read_wikitext(args.file, args.encoding)  # check it before loading anything
    pg = _init(args)
    loaded = _load(args, args.load, pg)
    context = args.context or loaded.seq_length
    stride = args.stride or max(1, context // 2)
    rolling_windows(1, context, stride)  # validates context/stride
    if context > loaded.seq_length:
        logger.warning("--context %d exceeds the run's --seq-length %d", context, loaded.seq_length)
    streams, num_tokens, words = prepare_streams(articles, loaded.tokenizer)
    totals = LossTotals()
    score_batches(
        loaded.scorer,
        window_batches(streams, context, stride, args.micro_batch_size),
        [totals],
        total_targets=num_tokens,
        desc="wikitext",
        show_progress=not args.no_progress,
    )
    result = WikitextResult(len(articles), words, totals.tokens, totals.loss_sum, context, stride)
    out = dict(checkpoint=loaded.run.path, file=args.file, **result.as_dict())
    if _rank0():
        print(
            f"{args.file}: {out['articles']} articles, {out['words']} words, {out['tokens']} "
            f"tokens | context {context} stride {stride} | token perplexity "
            f"{out['token_perplexity']:.4f} | word perplexity {out['word_perplexity']:.4f}"
        )
        if args.output_dir:
            write_json(os.path.join(args.output_dir, "wikitext.json"), out)
    return 0


def cmd_lm_eval(args) -> int:
    try:
        # optional: the [eval] extra
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ImportError:
        raise EvaluationError(
            "lm-eval is not installed: pip install -e '.[eval]' (pins lm-eval)"
        ) from None
    # deferred: keeps torch (slow) out of this module's import
    from megatron_ext.evaluation.lm_eval_adapter import LeviathanLM

    if args.log_samples and not args.output_dir:
        raise EvaluationError("--log-samples writes samples_<task>.jsonl: give --output-dir")
    pg = _init(args)
    loaded = _load(args, args.load, pg)
    lm = LeviathanLM(
        loaded=loaded, batch_size=args.micro_batch_size, max_gen_toks=args.max_gen_toks
    )
    limit = args.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=[t for t in args.tasks.split(",") if t],
        num_fewshot=args.num_fewshot,
        limit=limit,
        task_manager=TaskManager(include_path=args.include_path),
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
        log_samples=args.log_samples,
    )
    if _rank0() and results is not None:
        table = make_table(results)
        print(table)
        if args.output_dir:
            atomic_write(os.path.join(args.output_dir, "lm_eval.md"), table)
            write_json(
                os.path.join(args.output_dir, "lm_eval.json"),
                {
                    "results": results["results"],
                    "versions": results.get("versions", {}),
                    "n-shot": results.get("n-shot", {}),
                    "checkpoint": loaded.run.path,
                },
            )
            for task, samples in (results.get("samples") or {}).items():
                lines = [json.dumps(sample, default=str) for sample in samples]
                atomic_write(
                    os.path.join(args.output_dir, f"samples_{task}.jsonl"),
                    "".join(line + "\n" for line in lines),
                )
    return 0


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
    for row in rows:
        print(row.message())
    table = format_markdown_table(
        ["run", "reference", "target loss", "reference tokens", "run tokens", "ratio"],
        [
            [
                r.run,
                r.reference,
                f"{r.target_loss:.4f}",
                f"{r.reference_tokens:.4g}",
                "never" if r.tokens is None else f"{r.tokens:.4g}",
                "-" if r.ratio is None else f"{r.ratio:.2f}x",
            ]
            for r in rows
        ],
    )
    atomic_write(os.path.join(args.output_dir, "sample_efficiency.md"), table)
    write_json(os.path.join(args.output_dir, "sample_efficiency.json"), [r.as_dict() for r in rows])
    return 0


COMMANDS = {
    "perplexity": cmd_perplexity,
    "frequency": cmd_frequency,
    "wikitext": cmd_wikitext,
    "lm-eval": cmd_lm_eval,
    "curves": cmd_curves,
}


def _errors() -> tuple:
    # deferred: keeps megatron.core (slow) out of this module's import
    from megatron_ext.checkpoint.format import CheckpointError

    return (EvaluationError, DataError, TokenizerError, CheckpointError)


def _main(argv: Optional[Sequence[str]]) -> int:
    args = get_args(argv)
    return COMMANDS[args.command](args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command (tools/evaluate.py): parse ``argv``, run, return the exit code."""
    return run_tool(_main, argv, errors=_errors)


if __name__ == "__main__":
    sys.exit(main())
