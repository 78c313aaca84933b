"""What the benchmarks share: the --clock and --threads flags, timing (a median over repeats,
interleaved ours/theirs pairs) and the figures their lines print (a median rate with its range,
the min and median of a ratio). Imported as `benchmarks.harness` (the repository root first on
sys.path when a benchmark runs as a script)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

CLOCKS = {"wall": time.perf_counter, "cpu_seconds": time.process_time}
"""--clock: wall time, or this process's CPU seconds (all threads; steadier on a loaded host)."""


def add_timing_flags(
    parser: argparse.ArgumentParser, clock_help: str, threads_help: str = "torch threads"
) -> None:
    """--clock (CLOCKS, default wall) and --threads (default: torch's own choice)."""
    parser.add_argument("--threads", type=int, default=None, help=threads_help)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help=clock_help)


def apply_timing_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Callable:
    """Set torch's threads from --threads (refusing one < 1); returns the --clock function."""
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        # deferred: the harness serves benchmarks that never import torch too
        import torch

        torch.set_num_threads(args.threads)
    return CLOCKS[args.clock]


def timed(fn: Callable[[], Any], clock: Callable[[], float] = time.perf_counter):
    """(fn(), the seconds it took by `clock`)."""
    start = clock()
    out = fn()
    return out, clock() - start


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int, cuda: bool = False) -> float:
    """The median wall seconds of `repeats` calls after `warmup` (with `cuda`, synchronised)."""
    # deferred: the harness serves benchmarks that never import torch too
    import torch

    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleave(
    pairs: int, ours: Callable[[], Any], theirs: Callable[[], Any], clock: Callable[[], float]
) -> list[tuple[Any, float, Any, float]]:
    """`pairs` interleaved runs of ours then theirs: (ours' result, seconds, theirs', seconds)."""
    return [(*timed(ours, clock), *timed(theirs, clock)) for _ in range(pairs)]


def median_rate(values: list[float], width: int, digits: int) -> str:
    """The median rate `width` characters wide, "tokens/s (median; <min>-<max>)" after it."""
    low, high, mid = min(values), max(values), statistics.median(values)
    return f"{mid:{width}.{digits}f} tokens/s (median; {low:.{digits}f}-{high:.{digits}f})"


def ratio_line(ratios: list[float], suffix: str = "") -> str:
    """The ours/theirs line a peer comparison prints: the min and median of its pairs."""
    low, mid = min(ratios), statistics.median(ratios)
    return f"    ratio ours/theirs min {low:.2f} median {mid:.2f}{suffix}"


def add_study_flags(p: argparse.ArgumentParser) -> None:
    """The LEV quality study's model and training flags, with its defaults (issue 14's
    settings), as `bench_lev_quality.py` and its plain baseline `plain_gpt.py` both take them."""
    p.add_argument("--num-layers", type=int, default=3)
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--num-attention-heads", type=int, default=6)
    p.add_argument("--ffn-hidden-size", type=int, default=512)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--train-iters", type=int, default=1500)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr", type=float, default=2e-4)
    p.add_argument("--lr-warmup-iters", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--adam-beta2", type=float, default=0.999)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-samples", type=int, default=128, help="validation samples per eval")
