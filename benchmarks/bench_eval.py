#!/usr/bin/env python
"""Evaluation throughput against the training forward pass, per arm, measured in one run.

Per arm: the training forward (a), `ModelScorer`'s evaluation forward (b) and evaluation at
--eval-batch-multiplier times the micro-batch (c); prints median tokens/s and (b)/(a), (c)/(a).
Then perplexity against a plain transformers forward of our HF export on the same packed
windows: --pairs interleaved runs, the ours/theirs ratio (min, median) and both losses.

    python benchmarks/bench_eval.py
    python benchmarks/bench_eval.py --skip-arms --threads 1 --clock cpu_seconds  # loaded host
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    add_timing_flags,
    apply_timing_flags,
    interleave,
    median_rate,
    median_seconds,
    ratio_line,
)


def _model(arm: str, args, pg):
    from megatron_ext.config.arguments import parse_config
    from megatron_ext.config.data import padded_vocab_size
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.models import build_model

    run = parse_config([
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
        "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(args.vocab_size), "--embedding-type", arm, "--lev-eval-table",
    ], world_size=1)  # fmt: skip
    config = run.model.replace(vocab_size=padded_vocab_size(args.vocab_size))
    model = build_model(config, parallel=ParallelConfig(), precision=PrecisionConfig(), pg=pg)
    if torch.cuda.is_available():
        model = model.cuda()
    return model, config


def bench_vs_transformers(args, pg, clock) -> None:
    import dataclasses

    import numpy as np
    import torch.nn.functional as F

    from benchmarks.hf_peer import hf_export
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.config.model import ModelConfig
    from megatron_ext.evaluation.perplexity import LossTotals, pack_stream
    from megatron_ext.evaluation.scoring import ModelScorer, score_batches
    from megatron_ext.models import build_model

    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=args.vocab_size,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        embedding=dict(embedding_type="lev"),
    )
    lev = dataclasses.replace(config.embedding.lev, eval_table=True)  # as load_for_evaluation
    config = config.replace(embedding=dataclasses.replace(config.embedding, lev=lev))
    model = build_model(
        config, parallel=ParallelConfig(), precision=PrecisionConfig(), pg=pg
    ).eval()
    hf = hf_export(model, config, tied=config.embedding.tied)
    scorer = ModelScorer(model, config.hidden_size, args.vocab_size, pg)
    rng = np.random.default_rng(0)
    documents = [
        rng.integers(0, args.vocab_size, size=int(n)) for n in rng.integers(
            50, 2 * args.seq_length, size=args.peer_documents)
    ]  # fmt: skip
    batches = list(pack_stream(documents, args.seq_length, args.peer_micro_batch))
    targets = int(sum(b.loss_mask.sum() for b in batches))

    def ours() -> float:
        totals = LossTotals()
        score_batches(scorer, batches, [totals], show_progress=False)
        return totals.loss

    def theirs() -> float:
        loss_sum = 0.0
        with torch.inference_mode():
            for batch in batches:
                logits = hf(batch.tokens, position_ids=batch.position_ids).logits
                losses = F.cross_entropy(
                    logits.float().flatten(0, 1), batch.labels.flatten(), reduction="none"
                )
                mask = batch.loss_mask.flatten() > 0
                loss_sum += float(losses[mask].double().sum())
        return loss_sum / targets

    ours(), theirs()  # warm-up (LEV eval table built here)
    runs = interleave(args.pairs, ours, theirs, clock)
    ratios = [t_theirs / t_ours for _, t_ours, _, t_theirs in runs]
    rates = [targets / t_ours for _, t_ours, _, _ in runs]
    rates_peer = [targets / t_theirs for _, _, _, t_theirs in runs]
    losses = [(a, b) for a, _, b, _ in runs]
    same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in losses)
    print(
        f"perplexity, LEV, {len(batches)} micro-batches of {args.peer_micro_batch} x "
        f"{args.seq_length} ({targets} targets), {args.num_layers} layers x D "
        f"{args.hidden_size}, V {args.vocab_size}, {args.pairs} pairs, clock {args.clock}, "
        f"{torch.get_num_threads()} threads:\n"
        f"    ours (score_batches)      {median_rate(rates, 8, 0)}\n"
        f"    transformers forward + CE {median_rate(rates_peer, 8, 0)}\n"
        + ratio_line(ratios, "   ")
        + f"(loss {losses[0][0]:.6f} vs {losses[0][1]:.6f}, equal to rel 1e-5: {same})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", nargs="+", default=["tied", "lev"])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--eval-batch-multiplier", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--peer-micro-batch", type=int, default=16)
    parser.add_argument("--peer-documents", type=int, default=48)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--skip-arms", action="store_true", help="only the transformers row")
    parser.add_argument("--skip-transformers", action="store_true")
    add_timing_flags(
        parser,
        "what the transformers comparison times: wall seconds, or this process's CPU seconds "
        "(steadier when other work shares the machine)",
        "torch intra-op threads for both sides (default: torch's own choice); 1 gives the "
        "steadiest A/B on a shared machine",
    )
    args = parser.parse_args()
    clock = apply_timing_flags(parser, args)

    from megatron_ext.evaluation.scoring import ModelScorer
    from megatron_ext.inference.loading import init_inference_parallel

    pg = init_inference_parallel(1, 1)
    if not args.skip_transformers:
        bench_vs_transformers(args, pg, clock)
    if args.skip_arms:
        return
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    b, s = args.micro_batch_size, args.seq_length
    big = b * args.eval_batch_multiplier
    tokens = torch.randint(0, args.vocab_size, (big, s + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(s, device=device).unsqueeze(0).expand(big, s)
    wide = f"eval x{args.eval_batch_multiplier} batch tok/s"
    print(f"{'arm':6} {'train fwd tok/s':>16} {'eval tok/s':>12} {'ratio':>7} {wide:>22} ratio")
    for arm in args.arms:
        model, config = _model(arm, args, pg)
        scorer = ModelScorer(model, config.hidden_size, args.vocab_size, pg)

        def train_forward():
            model.train()
            model(inputs[:b], positions[:b], None, labels=labels[:b]).float().mean()

        def eval_forward(n: int):
            model.eval()
            scorer.token_losses(inputs[:n], labels[:n], positions[:n])

        cuda = torch.cuda.is_available()
        train = b * s / median_seconds(train_forward, args.repeats, args.warmup, cuda)
        same = b * s / median_seconds(lambda: eval_forward(b), args.repeats, args.warmup, cuda)
        large = big * s / median_seconds(lambda: eval_forward(big), args.repeats, args.warmup, cuda)
        print(f"{arm:6} {train:16.0f} {same:12.0f} {same / train:6.2f}x "
              f"{large:22.0f} {large / train:6.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
