"""Training speed against the loop users would write instead.

Ours: `pretrain_leviathan.py`, one process, TIED, mock data, AdamW, clip 1.0 (its --log-jsonl
times). Theirs: a plain PyTorch loop training transformers' `LlamaForCausalLM` from our initial
weights on the same samples with the same AdamW, so the losses must agree. --pairs interleaved
runs: the min and median ours/theirs ratio of the median tokens/s after --warmup.

    python benchmarks/bench_train_peer.py --threads 1 --clock cpu_seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

# The repository root, so that `benchmarks.hf_peer` imports when this file runs as a script.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    RECORD_FIELD,
    add_defaults,
    add_timing_flags,
    apply_timing_flags,
    comparison,
)


def _flags(args) -> list[str]:
    return [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
        "--max-position-embeddings", str(args.seq), "--embedding-type", "tied",
        "--micro-batch-size", str(args.micro_batch), "--global-batch-size", str(args.micro_batch),
        "--train-iters", str(args.iters), "--lr", str(args.lr), "--lr-decay-style", "constant",
        "--weight-decay", str(args.weight_decay), "--clip-grad", "1.0",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab - 1),
        "--seed", str(args.seed), "--eval-iters", "0", "--num-workers", "0",
        "--log-interval", str(args.iters), "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    ]  # fmt: skip


def run_ours(args, workdir: str) -> tuple[list[float], list[float]]:
    """(losses, seconds per iteration) of `pretrain_leviathan.py` on one process."""
    from megatron_ext.launch import launch

    log = Path(workdir) / "ours.jsonl"
    log.unlink(missing_ok=True)
    env = {"OMP_NUM_THREADS": str(args.threads)}
    argv = [*_flags(args), "--log-jsonl", str(log)]
    output = Path(workdir) / "ours.log"
    with launch("pretrain_leviathan", 1, argv, env=env, log=output, timeout=None) as job:
        if job.wait() != 0:
            raise SystemExit(f"error: pretrain_leviathan failed:\n{job.output()[-3000:]}")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    field = RECORD_FIELD[args.clock]
    return [r["loss"] for r in records], [r[field] for r in records]


def _build_peer(args):
    """transformers' Llama with our initial weights, its optimizer, and the training samples."""
    from benchmarks.hf_peer import hf_export
    from megatron_ext.config.arguments import parse_config
    from megatron_ext.config.data import DataConfig
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.data.loading import build_train_valid_test_datasets
    from megatron_ext.data.tokenizers import build_tokenizer
    from megatron_ext.inference.loading import init_inference_parallel
    from megatron_ext.models import build_model
    from megatron_ext.parallel import set_random_seed

    tokenizer = build_tokenizer("NullTokenizer", vocab_size=args.vocab - 1)
    run = parse_config(_flags(args)).with_tokenizer(tokenizer)
    config = run.model
    pg = init_inference_parallel(1, 1)
    set_random_seed(args.seed, 0)  # as the entry point seeds before building the model
    ours = build_model(config, parallel=ParallelConfig(), precision=PrecisionConfig(), pg=pg)
    hf = hf_export(ours, config).train()
    del ours
    decay = [p for n, p in hf.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in hf.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(run.optim.adam_beta1, run.optim.adam_beta2), eps=run.optim.adam_eps,
    )  # fmt: skip
    train, _, _ = build_train_valid_test_datasets(
        DataConfig(mock_data=True), tokenizer, [args.iters * args.micro_batch, None, None],
        seq_length=args.seq, seed=args.seed,
    )  # fmt: skip
    return hf, optimizer, train


def run_theirs(args, clock) -> tuple[list[float], list[float]]:
    """(losses, seconds per iteration) of the plain transformers loop."""
    hf, optimizer, train = _build_peer(args)
    losses, seconds = [], []
    for step in range(args.iters):
        samples = [train[step * args.micro_batch + i] for i in range(args.micro_batch)]
        tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
        labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
        mask = torch.stack([torch.as_tensor(s["loss_mask"]) for s in samples]).float()
        start = clock()
        logits = hf(input_ids=tokens).logits
        per_token = torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.size(-1)), labels.view(-1), reduction="none"
        )
        loss = (per_token * mask.view(-1)).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optimizer.step()
        seconds.append(clock() - start)
        losses.append(float(loss.detach()))
    return losses, seconds


def _tokens_per_second(seconds: list[float], args) -> float:
    steady = seconds[args.warmup :]
    return args.micro_batch * args.seq / statistics.median(steady)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_defaults(p, layers=4, hidden=256, heads=4, seq=512, micro_batch=4, vocab=8192, iters=12)
    add_defaults(p, warmup=3, pairs=3, lr=3e-4, weight_decay=0.1, seed=1234)
    add_timing_flags(
        p,
        "what times an iteration: wall seconds, or its process's CPU seconds (steadier "
        "when other work shares the machine)",
        "torch threads of both loops",
        threads=torch.get_num_threads(),
    )
    args = p.parse_args()
    clock = apply_timing_flags(p, args)
    if args.warmup >= args.iters:
        p.error("--warmup must be smaller than --iters")
    print(
        f"torch {torch.__version__}, {args.threads} threads; TIED, {args.layers} layers x D "
        f"{args.hidden}, seq {args.seq}, micro-batch {args.micro_batch}, V {args.vocab}, "
        f"{args.iters} iterations (median of {args.iters - args.warmup} after {args.warmup}), "
        f"{args.pairs} pairs, clock {args.clock}",
        flush=True,
    )
    ratios, ours_tps, theirs_tps = [], [], []
    agree = True
    with tempfile.TemporaryDirectory() as workdir:
        for pair in range(args.pairs):
            our_losses, our_seconds = run_ours(args, workdir)
            their_losses, their_seconds = run_theirs(args, clock)
            ours_tps.append(_tokens_per_second(our_seconds, args))
            theirs_tps.append(_tokens_per_second(their_seconds, args))
            ratios.append(ours_tps[-1] / theirs_tps[-1])
            first = abs(our_losses[0] - their_losses[0]) / abs(their_losses[0])
            worst = max(abs(a - b) / abs(b) for a, b in zip(our_losses, their_losses))
            agree &= first < 1e-5 and worst < 1e-3
            print(
                f"  pair {pair + 1}: ours {ours_tps[-1]:7.0f} tokens/s, transformers "
                f"{theirs_tps[-1]:7.0f} tokens/s, ratio {ratios[-1]:.2f}; losses "
                f"{our_losses[0]:.6f} vs {their_losses[0]:.6f} at iteration 1, "
                f"{our_losses[-1]:.6f} vs {their_losses[-1]:.6f} at {args.iters} "
                f"(largest relative gap {worst:.1e})",
                flush=True,
            )
    rates = {
        "ours (pretrain_leviathan.py)": ours_tps,
        "transformers LlamaForCausalLM loop": theirs_tps,
    }
    print(comparison(rates, ratios, f" (target >= 1.05)   (losses agree: {agree})", 7, 0))


if __name__ == "__main__":
    main()
