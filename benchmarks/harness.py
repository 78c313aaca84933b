"""What the benchmarks share: flags (typed by their defaults, --clock and --threads, the LEV
quality study's), timing (repeats, interleaved rounds of a baseline and its candidates) and the
figures their lines print (a median rate with its range, the min and median of a ratio).
Imported as `benchmarks.harness`: a benchmark run as a script puts the repository root first on
sys.path."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

CLOCKS = {"wall": time.perf_counter, "cpu_seconds": time.process_time}
"""--clock: wall time, or this process's CPU seconds (all threads; steadier on a loaded host)."""
RECORD_FIELD = {"wall": "seconds", "cpu_seconds": "cpu_seconds"}
"""The field of a `pretrain_leviathan.py --log-jsonl` record that each --clock reads."""


def add_defaults(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """A flag for each keyword (`--name-with-dashes`), typed and defaulting like its value."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)


def add_timing_flags(
    parser: argparse.ArgumentParser,
    clock_help: str,
    threads_help: str = "torch threads",
    threads: int | None = None,
) -> None:
    """--clock (CLOCKS, default wall) and --threads (default `threads`: None, torch's choice)."""
    parser.add_argument("--threads", type=int, default=threads, help=threads_help)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help=clock_help)


def apply_timing_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Callable:
    """Set torch's threads from --threads (refusing one < 1); returns the --clock function,
    also set as `args.clock_fn`."""
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        # deferred: the harness serves benchmarks that never import torch too
        import torch

        torch.set_num_threads(args.threads)
    args.clock_fn = CLOCKS[args.clock]
    return args.clock_fn


def timed(fn: Callable[[], Any], clock: Callable[[], float] = time.perf_counter):
    """(fn(), the seconds it took by `clock`)."""
    start = clock()
    out = fn()
    return out, clock() - start


def repeat_seconds(
    fn: Callable[[], Any],
    repeats: int,
    warmup: int,
    clock: Callable[[], float] = time.perf_counter,
    cuda: bool = False,
    reduce: Callable[[list[float]], float] = statistics.median,
) -> float:
    """`reduce` (the median, or min: the best) of the seconds of `repeats` calls after `warmup`
    (with `cuda`, synchronised)."""
    # deferred: the harness serves benchmarks that never import torch too
    import torch

    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = clock()
        fn()
        sync()
        times.append(clock() - start)
    return reduce(times)


def rounds(
    variants: dict[str, Callable[[int], Any]], count: int, rotate: bool = False
) -> dict[str, list]:
    """`count` rounds that call each variant once with the round's index, in order (with
    `rotate`, each round starting one later: a drift of the machine favours none): {name: its
    results}."""
    names, out = list(variants), {name: [] for name in variants}
    for i in range(count):
        shift = i % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            out[name].append(variants[name](i))
    return out


def interleave(
    pairs: int, ours: Callable[[], Any], theirs: Callable[[], Any], clock: Callable[[], float]
) -> list[tuple[Any, float, Any, float]]:
    """`pairs` interleaved runs of ours then theirs: (ours' result, seconds, theirs', seconds)."""
    return [(*timed(ours, clock), *timed(theirs, clock)) for _ in range(pairs)]


def comparison(
    rates: dict[str, list[float]], ratios: list[float], suffix: str, width: int, digits: int
) -> str:
    """A peer comparison's lines: per side (`rates`' keys, ours first) its median rate `width`
    characters wide with its range, then the min and median of the ours/theirs `ratios`."""
    column, rows = max(map(len, rates)) + 1, []
    for label, v in rates.items():
        low, high, mid = min(v), max(v), statistics.median(v)
        rows.append(
            f"    {label:{column}s}{mid:{width}.{digits}f} tokens/s "
            f"(median; {low:.{digits}f}-{high:.{digits}f})"
        )
    low, mid = min(ratios), statistics.median(ratios)
    return "\n".join([*rows, f"    ratio ours/theirs min {low:.2f} median {mid:.2f}{suffix}"])


STUDY_FLAGS = dict(
    num_layers=3, hidden_size=192, num_attention_heads=6, ffn_hidden_size=512, seq_length=128,
    global_batch_size=16, train_iters=1500, lr=2e-3, min_lr=2e-4, lr_warmup_iters=100,
    weight_decay=0.1, clip_grad=1.0, adam_beta2=0.999, eval_interval=100,
)  # fmt: skip
"""The LEV quality study's settings (issue 14's), the same flags in both implementations."""
LEV_FLAGS = dict(
    lev_num_digits=3, lev_seed_dim=64, lev_num_knots=16, lev_rank=32, lev_num_heads=4,
    lev_temperature=2.0,
)  # fmt: skip
"""The study's LEV settings, the same flags in both implementations."""


def add_study_flags(p: argparse.ArgumentParser) -> None:
    """STUDY_FLAGS, LEV_FLAGS, --eval-samples and --log-interval, with their defaults, as
    `bench_lev_quality.py` and `plain_gpt.py` both take them."""
    add_defaults(p, **STUDY_FLAGS, **LEV_FLAGS)
    p.add_argument("--eval-samples", type=int, default=128, help="validation samples per eval")
    p.add_argument("--log-interval", type=int, default=50)
