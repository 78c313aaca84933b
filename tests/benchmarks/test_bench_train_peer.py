"""bench_train_peer.py's two loops train the same model on the same samples: ours
(`pretrain_leviathan.py`) and a plain loop over transformers' `LlamaForCausalLM` started from
our initial weights must give the same losses, so the speed ratio compares equal work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_pretrain_and_a_plain_transformers_loop_train_identically():
    pytest.importorskip("transformers")
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_train_peer.py", "--layers", "2", "--hidden", "64",
         "--heads", "4", "--seq", "32", "--micro-batch", "2", "--vocab", "512",
         "--iters", "4", "--warmup", "1", "--pairs", "1", "--clock", "cpu_seconds"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    pair = re.search(
        r"losses (\d+\.\d+) vs (\d+\.\d+) at iteration 1, (\d+\.\d+) vs (\d+\.\d+) at 4",
        done.stdout,
    )
    assert pair, done.stdout
    first_ours, first_theirs, last_ours, last_theirs = map(float, pair.groups())
    assert first_ours == pytest.approx(first_theirs, rel=1e-5)
    assert last_ours == pytest.approx(last_theirs, rel=1e-3)
    assert last_ours != first_ours  # the optimizer stepped in both loops
    assert "(losses agree: True)" in done.stdout
    assert "clock cpu_seconds" in done.stdout  # timed from our jsonl's cpu_seconds field
    rates = re.search(r"pair 1: ours +(\d+) tokens/s, transformers +(\d+) tokens/s", done.stdout)
    assert rates and min(map(int, rates.groups())) > 0, done.stdout
