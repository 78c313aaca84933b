#!/usr/bin/env python
"""Training-step speed of `pretrain_leviathan.py` per arm and per layout, as ratios against a
baseline measured in the same run on the same machine.

Each configuration runs the real entry point (mock data, NullTokenizer) for --iters iterations
and reports the median time per iteration after --warmup iterations, the tokens/s, and the
ratio to the first configuration (the UNTIED arm on one rank). Layouts that need more ranks
than --max-ranks are skipped. On CPU the defaults take a few minutes; on GPUs pass
`--transformer-impl transformer_engine --bf16` in --extra and larger sizes.

    python benchmarks/bench_train_step.py
    python benchmarks/bench_train_step.py --num-layers 3 --hidden-size 192 \
        --num-attention-heads 6 --seq-length 128 --micro-batch-size 16 --global-batch-size 16 \
        --only tied lev --rounds 3 --data-flags "--data-path data/kjv8k_text_document \
        --split 95,5,0 --tokenizer-type SentencePieceTokenizer --tokenizer-model data/kjv8k.model"

--only keeps the configurations whose label starts with one of the given words; --rounds
repeats the whole list (interleaved, so that load changes on a shared machine hit every
configuration alike) and takes the median over all rounds; --data-flags replaces the mock data
with the runs' data and tokenizer flags (the same for every arm). The mock data (Megatron-Core's
MockGPTDataset) is documents that count 1, 2, 3, ... up to a random length below 4096, so most
ids of a micro-batch are distinct, and LEV, which runs once per distinct id of the global batch
(`--lev-dedup-global-batch`; of each micro-batch without it), does nearly one evaluation per
token: at 4 x 512 tokens a median of 1617 distinct ids per micro-batch, against 562 for English
text (the KJV corpus of docs/lev-training.md, 8k SentencePiece vocabulary). The benchmark prints
the distinct ids per micro-batch and per global batch of the data its runs train on. A real-text
run
of the width-256 shape (data made by the project's tools, docs/lev-training.md section 2):

    python benchmarks/bench_train_step.py --only tied "lev, 1" --hidden-size 256 \
        --seq-length 512 --micro-batch-size 4 --global-batch-size 8 --threads 2 --rounds 3 \
        --data-flags "--data-path data/kjv8k_text_document --split 95,5,0 \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/kjv8k.model"

--threads sets OMP_NUM_THREADS of every run (default 1: with more threads than free cores,
--clock cpu_seconds would also count their spin-waiting). With the tied single-rank configuration
measured, the LEV / TIED and UNTIED / TIED tokens/s ratios are printed, with their value in each
round (the spread between rounds is the noise of the measurement).

    python benchmarks/bench_train_step.py --hidden-size 1024 --num-layers 8 --seq-length 512 \\
        --max-ranks 8 --extra "--bf16"

Every run logs --timing-log-level 2's timers, and for each LEV configuration the benchmark also
prints LEV's own wall time per iteration (its forwards and its global-batch backward) and its
share of the iteration. That share is measured inside the same iterations, so the noise between
processes (on a 2-core VM, rounds of the same run differ by up to 10-15%) does not touch it:
1 - share is the LEV / TIED ratio to expect when the rest of LEV's iteration costs what TIED's
does (TIED's embedding lookup is not subtracted).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import tempfile
from pathlib import Path

import torch

from megatron_ext.data.loading import (
    DataConfig,
    add_data_arguments,
    build_train_valid_test_datasets,
)
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.testing.distributed import find_free_port
from megatron_ext.testing.launch import launch

# (label, ranks, flags) in the order reported; the first is the baseline.
CONFIGS = [
    ("untied, 1 rank", 1, ["--embedding-type", "untied"]),
    ("tied, 1 rank", 1, ["--embedding-type", "tied"]),
    ("lev, 1 rank", 1, ["--embedding-type", "lev"]),
    ("lev, DP=2", 2, ["--embedding-type", "lev"]),
    ("lev, DP=2 + ZeRO-1", 2, ["--embedding-type", "lev", "--use-distributed-optimizer"]),
    ("lev, TP=2 + SP", 2, ["--embedding-type", "lev", "--tensor-model-parallel-size", "2",
                          "--sequence-parallel"]),
    ("lev, PP=2", 2, ["--embedding-type", "lev", "--pipeline-model-parallel-size", "2"]),
]  # fmt: skip


def _run(
    ranks: int, flags: list[str], args: argparse.Namespace, workdir: str
) -> tuple[list[float], list[float]]:
    # A free port can be taken by another program before the run binds it: retry on a new one.
    for attempt in range(3):
        try:
            return _run_once(ranks, flags, args, workdir)
        except RuntimeError as err:
            if "EADDRINUSE" not in str(err) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_once(ranks: int, flags: list[str], args, workdir: str) -> tuple[list[float], list[float]]:
    """(time per iteration by --clock, LEV's own wall time per iteration in seconds: its
    forwards and its global-batch backward, from --timing-log-level 2's lines; 0 without LEV)."""
    jsonl = os.path.join(workdir, f"m{find_free_port()}.jsonl")
    common = [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.iters),
        "--lr", "1e-4", *shlex.split(args.data_flags), "--num-workers", "0", "--eval-iters", "0",
        "--log-interval", "1", "--timing-log-level", "2", "--no-loss-curve", "--log-jsonl", jsonl,
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": str(args.threads) if args.threads else None}
    log = os.path.join(workdir, f"m{find_free_port()}.log")
    argv = [*common, *flags, *shlex.split(args.extra)]
    with launch("pretrain_leviathan", ranks, argv, env=env, log=Path(log), timeout=None) as job:
        returncode = job.wait()
    if returncode != 0:
        raise RuntimeError(f"{' '.join(flags)} failed:\n{job.output()[-6000:]}")
    with open(jsonl) as handle:
        times = [json.loads(line)[args.clock] for line in handle if line.strip()]
    return times, lev_seconds(Path(log).read_text())


def lev_seconds(log: str) -> list[float]:
    """LEV's own seconds in each iteration of a run's output (--log-interval 1,
    --timing-log-level 2): its "lev-forward" and "lev-backward" spans (0 for a run without
    LEV), one value per timers line."""
    seconds = []
    for line in log.splitlines():
        if re.search(r"(?<!elapsed )time per iteration \(ms\): ", line):  # the timers' line
            spans = re.findall(r"(?:lev-forward|lev-backward): ([0-9.]+)", line)
            seconds.append(sum(float(v) for v in spans) / 1000)
    return seconds


def distinct_ids(args: argparse.Namespace, per: int) -> list[int]:
    """Distinct token ids in each group of `per` consecutive samples that one rank trains on
    (a micro-batch, or the global batch: LEV computes its embedding once per distinct id of the
    global batch, `--lev-dedup-global-batch`), from the runs' own data flags."""
    data_args = add_data_arguments(argparse.ArgumentParser()).parse_args(
        shlex.split(args.data_flags)
    )
    data_args.seq_length = args.seq_length
    config = DataConfig.from_args(data_args)
    tokenizer = build_tokenizer(
        config.tokenizer_type, config.tokenizer_model, vocab_size=config.vocab_size
    )
    samples = args.iters * args.global_batch_size
    train, _, _ = build_train_valid_test_datasets(config, tokenizer, [samples, 0, 0])
    return [
        len(torch.unique(torch.stack([train[i]["tokens"] for i in range(start, start + per)])))
        for start in range(0, samples - per + 1, per)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--max-ranks", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--extra", default="", help="more pretrain_leviathan.py flags")
    parser.add_argument("--only", nargs="+", default=None, help="label prefixes to run")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions")
    parser.add_argument(
        "--clock",
        choices=("seconds", "cpu_seconds"),
        default="seconds",
        help="wall time, or the rank's CPU time (steadier on a shared machine; 1 thread/rank)",
    )
    parser.add_argument(
        "--data-flags", default=None, help="data/tokenizer flags (default: mock data)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of every rank (0: inherit); with more threads than free cores, "
        "cpu_seconds also counts the threads' spin-waiting",
    )
    args = parser.parse_args()
    if args.data_flags is None:
        args.data_flags = (
            f"--mock-data --tokenizer-type NullTokenizer --vocab-size {args.vocab_size}"
        )
    configs = [c for c in CONFIGS if not args.only or c[0].startswith(tuple(args.only))]

    tokens = args.global_batch_size * args.seq_length
    print(
        f"model {args.num_layers} x {args.hidden_size}, seq {args.seq_length}, global batch "
        f"{args.global_batch_size} ({tokens} tokens); median of iterations "
        f"{args.warmup + 1}-{args.iters} x {args.rounds} round(s), clock: {args.clock}"
    )
    for what, per in (("micro", args.micro_batch_size), ("global", args.global_batch_size)):
        counts = distinct_ids(args, per)
        print(
            f"distinct ids per {what}-batch of {per} x {args.seq_length} tokens: median "
            f"{statistics.median(counts):.0f}, {min(counts)}-{max(counts)} ({len(counts)} "
            f"{what}-batches)"
        )
    print(f"{'configuration':28s} {'s/iter':>9s} {'tokens/s':>10s} {'time vs baseline':>17s}")
    times: dict[str, list[float]] = {}
    lev_own: dict[str, list[float]] = {}  # LEV's own seconds in each measured iteration
    per_round: dict[str, list[float]] = {}  # the median of each round, to show the spread
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(args.rounds):
            for label, ranks, flags in configs:
                if ranks <= args.max_ranks:
                    measured, lev = _run(ranks, flags, args, workdir)
                    measured = measured[args.warmup :]
                    times.setdefault(label, []).extend(measured)
                    lev_own.setdefault(label, []).extend(lev[args.warmup :])
                    per_round.setdefault(label, []).append(statistics.median(measured))
    baseline = None
    for label, ranks, _ in configs:
        if label not in times:
            print(f"{label:28s} skipped (needs {ranks} ranks > --max-ranks)")
            continue
        seconds = statistics.median(times[label])
        baseline = baseline or seconds
        print(f"{label:28s} {seconds:9.3f} {tokens / seconds:10.0f} {seconds / baseline:16.2f}x")
    for arm, target in (("lev", "   (target >= 0.97)"), ("untied", "")):
        if "tied, 1 rank" in times and f"{arm}, 1 rank" in times:
            ratio = statistics.median(times["tied, 1 rank"]) / statistics.median(
                times[f"{arm}, 1 rank"]
            )
            rounds = ", ".join(
                f"{t / a:.3f}"
                for t, a in zip(per_round["tied, 1 rank"], per_round[f"{arm}, 1 rank"])
            )
            print(
                f"{arm.upper()} / TIED tokens/s (1 rank): {ratio:.3f}{target}; per round: {rounds}"
            )
    for label, own in lev_own.items():
        if label.startswith("lev") and own and args.clock == "seconds":
            # Measured inside the same iterations, so free of the noise between runs.
            share = statistics.median(o / t for o, t in zip(own, times[label]))
            print(
                f"{label}: LEV's own wall time (its forwards and global-batch backward, "
                f"--timing-log-level 2) median {1000 * statistics.median(own):.1f} ms per "
                f"iteration, {100 * share:.1f}% of it (1 - share = {1 - share:.3f})"
            )


if __name__ == "__main__":
    main()
