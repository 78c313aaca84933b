"""benchmarks/bench_train_step.py reads LEV's own time per iteration from the timers lines that
the training loop writes (tests/training/test_loop.py checks their format)."""

from __future__ import annotations

from benchmarks.bench_train_step import lev_seconds


def test_lev_seconds_reads_the_timers_lines_only():
    log = "\n".join(
        [
            "[2026-12-05 14:20:47]  iteration        1/       2 | elapsed time per iteration "
            "(ms): 1278.6 | tokens per second: 3204 | lm loss: 8.5E+00 |",
            "[2026-12-05 14:20:47]     time per iteration (ms): forward-backward: 1265.7 | "
            "grads-all-reduce: 0.1 | grad-norm-and-clip: 5.5 | optimizer: 7.0 | "
            "lev-forward: 14.7 | lev-backward: 23.0",
            "[2026-12-05 14:20:48]  iteration        2/       2 | elapsed time per iteration "
            "(ms): 1100.0 | tokens per second: 3700 | lm loss: 8.4E+00 |",
            "[2026-12-05 14:20:48]     time per iteration (ms): forward-backward: 1090.0 | "
            "grads-all-reduce: 0.1 | grad-norm-and-clip: 5.5 | optimizer: 7.0",
        ]
    )
    seconds = lev_seconds(log)
    assert len(seconds) == 2  # one per timers line; the iteration lines are not counted
    assert abs(seconds[0] - 0.0377) < 1e-12
    assert seconds[1] == 0.0  # a run without LEV spans (TIED)
