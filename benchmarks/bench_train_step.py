#!/usr/bin/env python
"""Training-step speed of `pretrain_leviathan.py` per arm and per layout, as ratios against a
baseline measured in the same run on the same machine.

Each configuration runs the real entry point (mock data, NullTokenizer) for --iters iterations
and reports the median time per iteration after --warmup iterations, the tokens/s, and the
ratio to the first configuration (the UNTIED arm on one rank). Layouts that need more ranks
than --max-ranks are skipped. On CPU the defaults take a few minutes; on GPUs pass
`--transformer-impl transformer_engine --bf16` in --extra and larger sizes.

    python benchmarks/bench_train_step.py
    python benchmarks/bench_train_step.py --hidden-size 1024 --num-layers 8 --seq-length 512 \\
        --max-ranks 8 --extra "--bf16"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_ext.testing.distributed import find_free_port

REPO = Path(__file__).resolve().parents[1]

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


def _run(ranks: int, flags: list[str], args: argparse.Namespace, workdir: str) -> list[float]:
    jsonl = os.path.join(workdir, f"m{find_free_port()}.jsonl")
    common = [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.iters),
        "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(args.vocab_size), "--num-workers", "0", "--eval-iters", "0",
        "--log-interval", str(args.iters), "--no-loss-curve", "--log-jsonl", jsonl,
    ]  # fmt: skip
    port = str(find_free_port())
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if ranks == 1:
        cmd = [sys.executable, str(REPO / "pretrain_leviathan.py")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-port", port, str(REPO / "pretrain_leviathan.py")]  # fmt: skip
    proc = subprocess.run(
        [*cmd, *common, *flags, *shlex.split(args.extra)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(flags)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    with open(jsonl) as handle:
        return [json.loads(line)["seconds"] for line in handle if line.strip()]


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
    args = parser.parse_args()

    tokens = args.global_batch_size * args.seq_length
    print(
        f"model {args.num_layers} x {args.hidden_size}, seq {args.seq_length}, global batch "
        f"{args.global_batch_size} ({tokens} tokens), vocab {args.vocab_size}; median of "
        f"iterations {args.warmup + 1}-{args.iters}"
    )
    print(f"{'configuration':28s} {'s/iter':>9s} {'tokens/s':>10s} {'time vs baseline':>17s}")
    baseline = None
    with tempfile.TemporaryDirectory() as workdir:
        for label, ranks, flags in CONFIGS:
            if ranks > args.max_ranks:
                print(f"{label:28s} skipped (needs {ranks} ranks > --max-ranks)")
                continue
            seconds = statistics.median(_run(ranks, flags, args, workdir)[args.warmup :])
            baseline = baseline or seconds
            print(
                f"{label:28s} {seconds:9.3f} {tokens / seconds:10.0f} {seconds / baseline:16.2f}x"
            )


if __name__ == "__main__":
    main()
