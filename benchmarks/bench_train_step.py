"""Training-step speed of `pretrain_leviathan.py` per arm and per layout, as ratios against a
baseline measured in the same run on the same machine.

Each configuration runs the real entry point for --iters iterations; printed: the median time
per iteration after --warmup, tokens/s, the ratio to the first configuration, LEV / TIED and
UNTIED / TIED, and each LEV run's own share of the iteration (--timing-log-level 2). --rounds
repeats the configurations interleaved, --slices K lets a round's runs take turns K iterations
at a time (the others paused by SIGSTOP), --baseline-tree DIR runs each configuration also from
another checkout. Results and commands: benchmarks/RESULTS.md section 4.

    python benchmarks/bench_train_step.py --only tied "lev, 1" --slices 4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

# The repository root, so that `benchmarks.*` and `tests.support.jobs` import when this file
# runs as a script.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import RECORD_FIELD, add_defaults, add_timing_flags  # noqa: E402
from megatron_ext.config.data import DataConfig  # noqa: E402
from megatron_ext.config.flags import add_flags, flag_values  # noqa: E402
from megatron_ext.config.run import RunConfig  # noqa: E402
from megatron_ext.data.loading import build_train_valid_test_datasets  # noqa: E402
from megatron_ext.data.tokenizers import build_tokenizer  # noqa: E402
from megatron_ext.launch import find_free_port  # noqa: E402
from tests.support.jobs import Job, count_records, launch  # noqa: E402

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
    ("lev, PP=2 x 2 chunks", 2, ["--embedding-type", "lev", "--pipeline-model-parallel-size", "2",
                                 "--num-virtual-stages-per-pipeline-rank", "2"]),
]  # fmt: skip
BASELINE = " @baseline"  # the label suffix of a configuration run from --baseline-tree


def _started(
    ranks: int, flags: list[str], args, workdir: str, tree: Optional[str]
) -> tuple[Job, str, str]:
    """`_start` once the run has logged its first iteration; retried on a new port when another
    program took the free one before the run bound it."""
    for attempt in range(3):
        job, jsonl, log = _start(ranks, flags, args, workdir, tree)
        try:
            _await_records(job, jsonl, 1, flags)
            return job, jsonl, log
        except RuntimeError as err:
            job.__exit__(None, None, None)
            if "EADDRINUSE" not in str(err) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run(
    ranks: int, flags: list[str], args: argparse.Namespace, workdir: str, tree: Optional[str]
) -> tuple[list[float], list[float]]:
    """(time per iteration, LEV's own seconds per iteration) of one configuration's run."""
    job, jsonl, log = _started(ranks, flags, args, workdir, tree)
    with job:
        returncode = job.wait()
    return _results(job, returncode, jsonl, log, flags, args)


def _start(
    ranks: int, flags: list[str], args, workdir: str, tree: Optional[str] = None
) -> tuple[Job, str, str]:
    """Launch one configuration's run: (the job, its --log-jsonl file, its output log); with
    `tree`, the pretrain_leviathan.py of that checkout, importing its megatron_ext."""
    jsonl = os.path.join(workdir, f"m{find_free_port()}.jsonl")
    common = [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.iters),
        "--lr", "1e-4", *shlex.split(args.data_flags), "--num-workers", "0", "--eval-iters", "0",
        "--log-interval", "1", "--timing-log-level", "2", "--no-loss-curve", "--log-jsonl", jsonl,
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": str(args.threads) if args.threads else None}
    entry: str | Path = "pretrain_leviathan"
    if tree is not None:  # its own package first on the path, not this checkout's
        entry, env["PYTHONPATH"] = Path(tree, "pretrain_leviathan.py"), tree
    log = os.path.join(workdir, f"m{find_free_port()}.log")
    argv = [*common, *flags, *shlex.split(args.extra)]
    job = launch(entry, ranks, argv, env=env, log=Path(log), timeout=None)
    return job, jsonl, log


def _results(
    job: Job, returncode: int, jsonl: str, log: str, flags: list[str], args
) -> tuple[list[float], list[float]]:
    """(time per iteration by --clock, LEV's own wall time per iteration in seconds: its
    forwards and its global-batch backward, from --timing-log-level 2's lines; 0 without LEV)."""
    if returncode != 0:
        raise RuntimeError(f"{' '.join(flags)} failed:\n{job.output()[-6000:]}")
    with open(jsonl) as handle:
        field = RECORD_FIELD[args.clock]
        times = [json.loads(line)[field] for line in handle if line.strip()]
    lev = lev_seconds(Path(log).read_text())
    if len(lev) != len(times):
        raise RuntimeError(
            f"{' '.join(flags)}: {len(times)} iterations logged to --log-jsonl but {len(lev)} "
            "timers lines in the output (one per iteration expected)"
        )
    return times, lev


def _await_records(job: Job, jsonl: str, count: int, flags: list[str]) -> None:
    """Wait (polling every 20 ms) until the run has logged `count` iterations."""
    while count_records(Path(jsonl)) < count:
        if job.returncode is not None:
            raise RuntimeError(
                f"{' '.join(flags)} exited after {count_records(Path(jsonl))} of {count} "
                f"iterations:\n{job.output()[-6000:]}"
            )
        time.sleep(0.02)


def _run_in_turns(
    configs: list[tuple[str, int, list[str], Optional[str]]], args: argparse.Namespace, workdir: str
) -> dict[str, tuple[list[float], list[float], list[Optional[int]]]]:
    """Run `configs` at once, taking turns --slices iterations at a time: {label: (time per
    iteration, LEV's own seconds per iteration, the turn each iteration ran in: None before
    the first turn and for each one a pause interrupted (the one after those logged when
    `Job.pause` returns), which are not measured)}."""
    flags_of = {label: flags for label, _, flags, _ in configs}
    jobs: dict[str, tuple[Job, str, str]] = {}
    turns: dict[str, list[Optional[int]]] = {}  # one entry per iteration logged or interrupted

    def log_until_now(label: str, turn: Optional[int]) -> None:
        logged = count_records(Path(jobs[label][1]))
        turns[label].extend([turn] * (logged - len(turns[label])))

    def pause(label: str, turn: Optional[int]) -> None:
        jobs[label][0].pause()
        log_until_now(label, turn)  # iterations finished before the stop ran in this turn
        if len(turns[label]) < args.iters:
            turns[label].append(None)  # the iteration the pause interrupted

    try:
        for label, ranks, flags, tree in configs:  # each stopped once it has logged one
            jobs[label], turns[label] = _started(ranks, flags, args, workdir, tree), []
            pause(label, None)
        labels, running, turn = list(jobs), None, 0
        while any(len(turns[label]) < args.iters for label in labels):
            # Forwards, then backwards (A B, B A, ...): no configuration always runs first.
            for label in labels if turn % 2 == 0 else labels[::-1]:
                if len(turns[label]) >= args.iters:
                    continue
                job, jsonl, _ = jobs[label]
                if running == label:  # its second turn in a row: nothing interrupted
                    until = len(turns[label]) + args.slices
                else:
                    if running is not None:
                        pause(running, turn)
                    job.resume()
                    running = label
                    until = len(turns[label]) + args.slices - 1  # the interrupted one counts
                _await_records(job, jsonl, min(args.iters, until), flags_of[label])
                log_until_now(label, turn)
            turn += 1
        results = {}
        for label, (job, jsonl, log) in jobs.items():
            job.resume()
            returncode = job.wait()
            times, lev = _results(job, returncode, jsonl, log, flags_of[label], args)
            results[label] = (times, lev, turns[label][: len(times)])
        return results
    finally:
        for job, _, _ in jobs.values():
            job.__exit__(None, None, None)  # kills what still runs, closes its log


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
    parser = argparse.ArgumentParser()
    add_flags(parser, DataConfig)
    flags = flag_values(DataConfig, parser.parse_args(shlex.split(args.data_flags)))
    config = DataConfig(**flags)
    tokenizer = build_tokenizer(
        config.tokenizer_type, config.tokenizer_model, vocab_size=config.vocab_size
    )
    samples = args.iters * args.global_batch_size
    train, _, _ = build_train_valid_test_datasets(
        config, tokenizer, [samples, 0, 0], seq_length=args.seq_length, seed=RunConfig.seed
    )  # the runs' default --seed
    return [
        len(torch.unique(torch.stack([train[i]["tokens"] for i in range(start, start + per)])))
        for start in range(0, samples - per + 1, per)
    ]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The benchmark's flags, checked, with the mock data's flags filled in when none given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_defaults(parser, num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256)
    add_defaults(parser, micro_batch_size=4, global_batch_size=8, vocab_size=8000, iters=12)
    add_defaults(parser, warmup=4, max_ranks=min(2, os.cpu_count() or 1))
    parser.add_argument("--extra", default="", help="more pretrain_leviathan.py flags")
    parser.add_argument("--only", nargs="+", default=None, help="label prefixes to run")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions")
    parser.add_argument(
        "--slices",
        type=int,
        default=0,
        help="run a round's configurations at once, taking turns this many iterations at a "
        "time (the others paused); 0: one run after the other",
    )
    parser.add_argument("--data-flags", help="data/tokenizer flags (default: mock data)")
    parser.add_argument(
        "--baseline-tree",
        default=None,
        help="another checkout (e.g. a git worktree of the commit before a change): every "
        "configuration also runs from its pretrain_leviathan.py, in the same rounds or turns, "
        "and the ratios this tree / baseline are printed",
    )
    add_timing_flags(
        parser,
        "wall time, or the rank's CPU time (steadier on a shared machine; 1 thread/rank)",
        "OMP_NUM_THREADS of every rank (0: inherit); with more threads than free cores, "
        "cpu_seconds also counts the threads' spin-waiting",
        threads=1,
    )
    args = parser.parse_args(argv)
    if args.slices == 1 or args.slices < 0:
        parser.error(
            f"--slices {args.slices}: give 0 (runs one after the other) or at least 2 (the "
            "first iteration of each turn is interrupted by the pause and not measured)"
        )
    if args.baseline_tree is not None:
        if not Path(args.baseline_tree, "pretrain_leviathan.py").is_file():
            parser.error(f"--baseline-tree {args.baseline_tree}: no pretrain_leviathan.py there")
        args.baseline_tree = str(Path(args.baseline_tree).resolve())
    if args.data_flags is None:
        args.data_flags = (
            f"--mock-data --tokenizer-type NullTokenizer --vocab-size {args.vocab_size}"
        )
    return args


def measure(configs: list, args: argparse.Namespace):
    """Run `configs` --rounds times: {label: measured iteration times}, {label: LEV's own
    seconds in each}, {label: {(round, turn): times}} (the groups that show the spread)."""
    times: dict[str, list[float]] = {}
    lev_own: dict[str, list[float]] = {}
    groups: dict[str, dict[tuple[int, ...], list[float]]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        for round_ in range(args.rounds):
            if args.slices:
                measured = _run_in_turns(configs, args, workdir)
            else:
                measured = {}
                for label, ranks, flags, tree in configs:
                    run_times, run_lev = _run(ranks, flags, args, workdir, tree)
                    measured[label] = (run_times, run_lev, [0] * len(run_times))
            for label, (run_times, run_lev, turns) in measured.items():
                for i in range(args.warmup, len(run_times)):
                    if turns[i] is None:  # a pause interrupted it
                        continue
                    times.setdefault(label, []).append(run_times[i])
                    lev_own.setdefault(label, []).append(run_lev[i])
                    key = (round_, turns[i])
                    groups.setdefault(label, {}).setdefault(key, []).append(run_times[i])
    return times, lev_own, groups


def main() -> None:
    args = parse_args()
    configs = []  # each chosen configuration, then its twin from --baseline-tree
    for label, ranks, flags in CONFIGS:
        if args.only and not label.startswith(tuple(args.only)):
            continue
        configs.append((label, ranks, flags, None))
        if args.baseline_tree:
            configs.append((label + BASELINE, ranks, flags, args.baseline_tree))
    tokens = args.global_batch_size * args.seq_length
    print(
        f"model {args.num_layers} x {args.hidden_size}, seq {args.seq_length}, global batch "
        f"{args.global_batch_size} ({tokens} tokens); median of iterations "
        f"{args.warmup + 1}-{args.iters} x {args.rounds} round(s), clock: {args.clock}"
        + (f", in turns of {args.slices} iterations" if args.slices else "")
    )
    for what, per in (("micro", args.micro_batch_size), ("global", args.global_batch_size)):
        counts = distinct_ids(args, per)
        print(
            f"distinct ids per {what}-batch of {per} x {args.seq_length} tokens: median "
            f"{statistics.median(counts):.0f}, {min(counts)}-{max(counts)} ({len(counts)} "
            f"{what}-batches)"
        )
    report(configs, args, *measure([c for c in configs if c[1] <= args.max_ranks], args))


def report(configs: list, args: argparse.Namespace, times: dict, lev_own: dict, groups: dict):
    """The table of `measure`'s figures, the ratios to TIED (and to the baseline tree) and
    LEV's own share of its runs' iterations."""
    tokens = args.global_batch_size * args.seq_length
    width = 28 + (len(BASELINE) if args.baseline_tree else 0)
    print(f"{'configuration':{width}s} {'s/iter':>9s} {'tokens/s':>10s} {'time vs baseline':>17s}")
    baseline = None
    for label, ranks, _, _ in configs:
        if label not in times:
            print(f"{label:{width}s} skipped (needs {ranks} ranks > --max-ranks)")
            continue
        seconds = statistics.median(times[label])
        baseline = baseline or seconds
        ratio = seconds / baseline
        print(f"{label:{width}s} {seconds:9.3f} {tokens / seconds:10.0f} {ratio:16.2f}x")
    unit = "turn" if args.slices else "round"

    def ratio_line(what: str, numerator: str, denominator: str, target: str = "") -> None:
        """`what`: the median time of `numerator` over that of `denominator` (a tokens/s
        ratio of denominator over numerator), overall and per round or turn."""
        if numerator not in times or denominator not in times:
            return
        ratio = statistics.median(times[numerator]) / statistics.median(times[denominator])
        top, bottom = groups[numerator], groups[denominator]
        spread = [
            statistics.median(top[key]) / statistics.median(bottom[key])
            for key in sorted(top.keys() & bottom.keys())
        ]
        print(
            f"{what}: {ratio:.3f}{target}; per {unit}: {', '.join(f'{r:.3f}' for r in spread)} "
            f"(min {min(spread):.3f}, median {statistics.median(spread):.3f})"
        )

    for suffix in ("", BASELINE) if args.baseline_tree else ("",):
        for arm, target in (("lev", "   (target >= 0.97)"), ("untied", "")):
            ratio_line(
                f"{arm.upper()} / TIED tokens/s (1 rank){suffix}",
                f"tied, 1 rank{suffix}",
                f"{arm}, 1 rank{suffix}",
                target,
            )
    for label, _, _, tree in configs:
        if args.baseline_tree and tree is None:
            what = f"{label}: time per iteration, this tree / baseline"
            ratio_line(what, label, label + BASELINE)
    for label, own in lev_own.items():
        if label.startswith("lev") and own and args.clock == "wall":
            # Measured inside the same iterations, so free of the noise between runs.
            share = statistics.median(o / t for o, t in zip(own, times[label]))
            print(
                f"{label}: LEV's own wall time (its forwards and global-batch backward, "
                f"--timing-log-level 2) median {1000 * statistics.median(own):.1f} ms per "
                f"iteration, {100 * share:.1f}% of it (1 - share = {1 - share:.3f})"
            )


if __name__ == "__main__":
    main()
