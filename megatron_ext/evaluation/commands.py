"""The subcommands of tools/evaluate.py that score a checkpoint (perplexity, frequency,
wikitext, lm-eval): each loads the checkpoint at the layout asked for and writes its results."""

from __future__ import annotations

import json
import logging
import math
import os

from megatron_ext._paths import atomic_write, display_path
from megatron_ext.data.fingerprint import check_dataset_tokenizers, tokenizer_record
from megatron_ext.data.indexed import check_dataset, get_idx_path
from megatron_ext.data.loading import blend_prefixes, check_vocab_sizes, dataset_vocab_size
from megatron_ext.evaluation.frequency import (
    DEFAULT_EDGES,
    FrequencyBins,
    training_counts,
    write_frequency_report,
)
from megatron_ext.evaluation.outputs import EvaluationError, format_markdown_table, write_json
from megatron_ext.evaluation.perplexity import (
    LossTotals,
    dataset_documents,
    loop_validation_batches,
    pack_stream,
    text_documents,
)
from megatron_ext.evaluation.scoring import load_for_evaluation, rank0, score_batches
from megatron_ext.evaluation.wikitext import (
    prepare_streams,
    read_wikitext,
    rolling_windows,
    window_batches,
)
from megatron_ext.inference.loading import init_inference_parallel

logger = logging.getLogger("evaluate")


def _init(args):
    """This rank's `ProcessGroups` at the requested layout (initialised here if needed), once
    the evaluation and counts datasets are checked: a damaged one is named before any
    checkpoint is loaded (a missing one where it is read)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp * pp:
        raise EvaluationError(
            f"evaluation runs on TP x PP = {tp * pp} ranks but the world has {world}; launch "
            f"torchrun --nproc-per-node {tp * pp} (or plain python for TP=PP=1)"
        )
    if args.micro_batch_size < 1:
        raise EvaluationError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    pg = init_inference_parallel(tp, pp)
    for prefix in [getattr(args, "data_path", None), *(getattr(args, "counts_prefix", None) or [])]:
        if prefix and os.path.isfile(get_idx_path(prefix)):
            check_dataset(prefix)
    return pg


def _load(args, load_dir: str, pg):
    loaded = load_for_evaluation(
        load_dir, pg, iteration=args.ckpt_step, tokenizer_model=args.tokenizer_model
    )
    if rank0():
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


def cmd_perplexity(args) -> int:
    pg = _init(args)
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
    if rank0():
        print(
            f"{display_path(loaded.run.path)}: {source}: {totals.tokens} tokens, "
            f"loss {totals.loss:.6f}, "
            f"perplexity {totals.perplexity:.4f} ({speed['tokens_per_second']:.0f} tokens/s)"
        )
        if args.output_dir:
            write_json(os.path.join(args.output_dir, "perplexity.json"), result)
            row = [loaded.run.path, source, totals.tokens, f"{totals.loss:.4f}"]
            table = format_markdown_table(
                ["checkpoint", "data", "tokens", "loss", "perplexity"],
                [[*row, f"{totals.perplexity:.3f}"]],
            )
            atomic_write(os.path.join(args.output_dir, "perplexity.md"), table)
    return 0


def cmd_frequency(args) -> int:
    names = args.names or [os.path.basename(os.path.normpath(p)) for p in args.load]
    if len(names) != len(args.load) or len(set(names)) != len(names):
        raise EvaluationError("--names needs one distinct name per --load")
    if args.baseline is not None and args.baseline not in names:
        raise EvaluationError(f"--baseline {args.baseline} is not one of --names {names}")
    pg = _init(args)
    results, counts, prefixes = {}, None, args.counts_prefix
    for name, load_dir in zip(names, args.load):
        loaded = _load(args, load_dir, pg)
        if counts is None:
            if prefixes is None:
                data = loaded.run.data
                prefixes = blend_prefixes(data.data_path or data.train_data_path)
            counts = training_counts(
                prefixes, loaded.tokenizer.vocab_size, tokenizer_record(loaded.tokenizer)
            )
            if rank0():
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
    if rank0():
        paths = write_frequency_report(results, args.baseline, args.output_dir)
        with open(paths["md"]) as handle:
            print(handle.read(), end="")
        print("wrote " + ", ".join(paths[k] for k in ("md", "csv", "json", "png")))
    return 0


def cmd_wikitext(args) -> int:
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
    out = dict(
        checkpoint=loaded.run.path,
        file=args.file,
        articles=len(articles),
        words=words,
        tokens=totals.tokens,
        token_loss=totals.loss,
        token_perplexity=totals.perplexity,
        word_perplexity=math.exp(totals.loss_sum / words),  # the same loss per original word
        context=context,
        stride=stride,
    )
    if rank0():
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
        from lm_eval import simple_evaluate, tasks, utils
    except ImportError:
        raise EvaluationError(
            "lm-eval is not installed: pip install -e '.[eval]' (pins lm-eval)"
        ) from None
    # optional: imports lm-eval
    from megatron_ext.evaluation.lm_eval_adapter import LeviathanLM

    if args.log_samples and not args.output_dir:
        raise EvaluationError("--log-samples writes samples_<task>.jsonl: give --output-dir")
    pg = _init(args)
    loaded = _load(args, args.load, pg)
    lm = LeviathanLM(
        loaded=loaded, batch_size=args.micro_batch_size, max_gen_toks=args.max_gen_toks
    )
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = simple_evaluate(
        model=lm,
        tasks=[t for t in args.tasks.split(",") if t],
        num_fewshot=args.num_fewshot,
        limit=limit,
        task_manager=tasks.TaskManager(include_path=args.include_path),
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
        log_samples=args.log_samples,
    )
    if rank0() and results is not None:
        table = utils.make_table(results)
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
                lines = "".join(json.dumps(sample, default=str) + "\n" for sample in samples)
                atomic_write(os.path.join(args.output_dir, f"samples_{task}.jsonl"), lines)
    return 0


COMMANDS = {
    "perplexity": cmd_perplexity,
    "frequency": cmd_frequency,
    "wikitext": cmd_wikitext,
    "lm-eval": cmd_lm_eval,
}
