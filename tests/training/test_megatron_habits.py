"""Megatron-LM habits (issue 56 item 6), as pretrain_leviathan.py on one rank shows them:

- a GPT-3-style command line (no --swiglu, --normalization, --position-embedding-type) is
  trained as the LLaMA-style backbone, and one log line says what was asked and what is trained;
  a LLaMA-style command line gets no such line;
- "number of skipped iterations" and "number of nan iterations" count since the last log line,
  as Megatron-LM counts them (not since the run began);
- loss_curve.png is written beside the run's logs, never into --save.

(--seq-length above --max-position-embeddings is refused as Megatron-LM does:
tests/training/test_failed_launch.py.)
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.support.runs import ENTRY_MODULE, TINY_MOCK_RUN, run_command

pytestmark = pytest.mark.integration

BACKBONE_LINE = "this package trains its LLaMA-style backbone, rotary positions, RMSNorm and a"


def _run(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return run_command(ENTRY_MODULE, [*TINY_MOCK_RUN, *args], workdir, merge_stderr=True)


def test_gpt3_style_line_and_skipped_iterations_per_log_line(tmp_path):
    # lr 1e30: the first step blows the weights up; every later step is non-finite and skipped
    run = _run(
        tmp_path, "--train-iters", "6", "--log-interval", "2", "--lr", "1e30", "--min-lr", "0",
        "--skip-nonfinite-steps", "--max-nonfinite-steps", "10",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    lines = [line for line in run.stdout.splitlines() if BACKBONE_LINE in line]
    assert len(lines) == 1 and "GPT-3-style" in lines[0], run.stdout[-3000:]
    assert "learned absolute positions, LayerNorm and a GeLU MLP" in lines[0]
    skipped = re.findall(r"number of skipped iterations: +(\d+)", run.stdout)
    nan = re.findall(r"number of nan iterations: +(\d+)", run.stdout)
    # iterations 2, 3-4, 5-6 are skipped: 1, 2, 2 per line (1, 3, 5 counted from the start)
    assert skipped == ["1", "2", "2"] and nan == ["1", "2", "2"], run.stdout[-3000:]

    llama = _run(
        tmp_path, "--train-iters", "1", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope",
    )  # fmt: skip
    assert llama.returncode == 0, llama.stdout[-3000:]
    assert BACKBONE_LINE not in llama.stdout


def test_loss_curve_beside_the_logs_never_inside_save(tmp_path):
    """loss_curve.png goes beside the run's logs (--log-jsonl's directory without
    --tensorboard-dir), never into --save; with neither, one line says it was not written."""
    curve_on = [a for a in TINY_MOCK_RUN if a != "--no-loss-curve"]
    base = [*curve_on, "--train-iters", "2", "--save", "ckpt", "--save-interval", "2"]
    run = run_command(ENTRY_MODULE, [*base, "--log-jsonl", "logs/m.jsonl"], tmp_path,
                      merge_stderr=True)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    logged = run.stdout
    assert (tmp_path / "logs" / "loss_curve.png").is_file()
    assert f"loss curve: {tmp_path / 'logs' / 'loss_curve.png'}" in logged, logged[-2000:]
    assert not (tmp_path / "ckpt" / "loss_curve.png").exists()

    bare = tmp_path / "bare"
    bare.mkdir()
    run = run_command(ENTRY_MODULE, base, bare, merge_stderr=True)
    assert run.returncode == 0, run.stdout[-3000:]
    output = run.stdout
    assert "loss curve: not written (it goes beside --tensorboard-dir or --log-jsonl" in output
    assert sorted(p.name for p in (bare / "ckpt").iterdir()) == [
        "iter_0000002", "latest_checkpointed_iteration.txt"
    ]  # fmt: skip
