"""End-to-end test runs: a generated corpus taken through the quick-start data path, and a
launcher that runs `pretrain_leviathan.py` under torchrun on N gloo ranks.

Shared by the training, evaluation and conversion tests (each wraps them in pytest fixtures)::

    data = prepare_sample_data(tmp / "corpus")                  # data + tokenizer flags
    run = launch(2, [*TINY_LEV_MODEL, *TINY_TRAIN, *data, "--save", ckpt], tmp / "run").check()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_ext.testing.distributed import find_free_port

__all__ = ["REPO", "ENTRY", "TINY_LEV_MODEL", "TINY_TRAIN", "Run", "launch", "prepare_sample_data"]

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "pretrain_leviathan.py"

# A tiny LEV model (2 LEV heads so that TP=2 owns one each) on 32-token sequences.
TINY_LEV_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "32",
    "--embedding-type", "lev", "--lev-seed-dim", "16", "--lev-rank", "4",
    "--lev-num-heads", "2", "--lev-num-knots", "5",
]  # fmt: skip
# Every run requests the same 30 iterations (same schedule and dataset order) and stops
# earlier with --exit-interval where a test needs fewer.
TINY_TRAIN = [
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "30",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234",
    "--log-interval", "1", "--eval-interval", "10", "--eval-iters", "2",
    "--num-workers", "0", "--no-loss-curve",
]  # fmt: skip


@dataclass
class Run:
    """Outcome of one launch: exit code, combined output, per-iteration records."""

    returncode: int
    output: str
    records: list = field(default_factory=list)

    @property
    def losses(self) -> dict[int, float]:
        """Training loss by iteration (from --log-jsonl)."""
        return {r["iteration"]: r["loss"] for r in self.records}

    def check(self) -> "Run":
        """Assert the run exited 0 (showing the end of its output otherwise)."""
        assert self.returncode == 0, f"run failed (exit {self.returncode}):\n{self.output[-6000:]}"
        return self


def _tool(*argv: str) -> None:
    subprocess.run([sys.executable, *argv], check=True, cwd=REPO, capture_output=True)


def prepare_sample_data(root: Path, vocab_size: int = 512, size_mb: float = 0.4) -> list[str]:
    """Data flags for a generated corpus: make_sample_corpus -> train_tokenizer ->
    preprocess_data (the quick-start path); 0.4 MB is about 150k tokens."""
    root = Path(root)
    _tool("tools/make_sample_corpus.py", "--output", str(root / "raw"), "--size-mb", str(size_mb))
    _tool(
        "tools/train_tokenizer.py",
        "--input", str(root / "raw" / "train"),
        "--model-prefix", str(root / "tok"),
        "--vocab-size", str(vocab_size),
    )  # fmt: skip
    _tool(
        "tools/preprocess_data.py",
        "--input", str(root / "raw" / "train"),
        "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", str(root / "tok.model"),
        "--output-prefix", str(root / "sample"),
        "--append-eod",
    )  # fmt: skip
    return [
        "--data-path", str(root / "sample_text_document"), "--split", "90,7,3",
        "--data-cache-path", str(root / "cache"),
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(root / "tok.model"),
    ]  # fmt: skip


def launch(
    nproc: int,
    args: list[str],
    workdir: Path,
    *,
    timeout: float = 300,
    sigterm_after_iteration: Optional[int] = None,
) -> Run:
    """Run pretrain_leviathan.py on `nproc` ranks (torchrun; plain python for one rank).

    With `sigterm_after_iteration`, SIGTERM is sent to every rank once that iteration has been
    logged (as Slurm does on preemption).
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    jsonl = workdir / "metrics.jsonl"
    if jsonl.exists():
        jsonl.unlink()
    port = find_free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, str(ENTRY)]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(key, None)
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(port), str(ENTRY),
        ]  # fmt: skip
    cmd += [*args, "--log-jsonl", str(jsonl)]
    log_path = workdir / "output.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        signalled = False
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run timed out after {timeout}s: {' '.join(cmd)}")
                if sigterm_after_iteration is not None and not signalled:
                    done = _iterations_done(jsonl)
                    if done >= sigterm_after_iteration:
                        _sigterm_workers(proc.pid, nproc)
                        signalled = True
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    records = []
    if jsonl.exists():
        records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return Run(proc.returncode, log_path.read_text(), records)


def _iterations_done(jsonl: Path) -> int:
    if not jsonl.exists():
        return 0
    return sum(1 for line in jsonl.read_text().splitlines() if line.strip())


def _sigterm_workers(pid: int, nproc: int) -> None:
    """SIGTERM the training processes (the torchrun agent's children, or the single rank)."""
    if nproc == 1:
        os.kill(pid, signal.SIGTERM)
        return
    children = subprocess.run(
        ["pgrep", "-P", str(pid)], capture_output=True, text=True
    ).stdout.split()
    for child in children:
        os.kill(int(child), signal.SIGTERM)
