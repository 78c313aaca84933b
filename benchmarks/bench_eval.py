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
    add_defaults,
    add_timing_flags,
    apply_timing_flags,
    comparison,
    interleave,
    repeat_seconds,
)


def _model(args, pg, arm: str = "lev", vocab_size: int | None = None):
    """(config, model) of `arm` at the benchmark's shape, LEV with its evaluation table."""
    from benchmarks.hf_peer import bench_model

    return bench_model(
        pg, arm, eval_table=True, vocab_size=vocab_size or args.vocab_size,
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
    )  # fmt: skip


def bench_vs_transformers(args, pg, clock) -> None:
    import numpy as np
    import torch.nn.functional as F

    from benchmarks.hf_peer import hf_export
    from megatron_ext.evaluation.perplexity import LossTotals, pack_stream
    from megatron_ext.evaluation.scoring import ModelScorer, score_batches

    config, model = _model(args, pg)
    hf = hf_export(model, config)
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
    rates = {
        "ours (score_batches)": [targets / t for _, t, _, _ in runs],
        "transformers forward + CE": [targets / t for _, _, _, t in runs],
    }
    losses = [(a, b) for a, _, b, _ in runs]
    same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in losses)
    print(
        f"perplexity, LEV, {len(batches)} micro-batches of {args.peer_micro_batch} x "
        f"{args.seq_length} ({targets} targets), {args.num_layers} layers x D "
        f"{args.hidden_size}, V {args.vocab_size}, {args.pairs} pairs, clock {args.clock}, "
        f"{torch.get_num_threads()} threads:\n"
        + comparison(
            rates,
            [t_theirs / t_ours for _, t_ours, _, t_theirs in runs],
            f"   (loss {losses[0][0]:.6f} vs {losses[0][1]:.6f}, equal to rel 1e-5: {same})",
            8,
            0,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", nargs="+", default=["tied", "lev"])
    add_defaults(parser, num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256)
    add_defaults(parser, vocab_size=32000, micro_batch_size=4, eval_batch_multiplier=4, repeats=3)
    add_defaults(parser, warmup=1, peer_micro_batch=16, peer_documents=48, pairs=3)
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

    from megatron_ext.config.data import padded_vocab_size
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
        config, model = _model(args, pg, arm, padded_vocab_size(args.vocab_size))
        model = model.to(device)
        scorer = ModelScorer(model, config.hidden_size, args.vocab_size, pg)

        def train_forward():
            model.train()
            model(inputs[:b], positions[:b], None, labels=labels[:b]).float().mean()

        def eval_forward(n: int):
            model.eval()
            scorer.token_losses(inputs[:n], labels[:n], positions[:n])

        def seconds(fn) -> float:
            return repeat_seconds(fn, args.repeats, args.warmup, cuda=device == "cuda")

        train = b * s / seconds(train_forward)
        same = b * s / seconds(lambda: eval_forward(b))
        large = big * s / seconds(lambda: eval_forward(big))
        print(f"{arm:6} {train:16.0f} {same:12.0f} {same / train:6.2f}x "
              f"{large:22.0f} {large / train:6.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
