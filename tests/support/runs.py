"""End-to-end test runs: a generated corpus taken through the quick-start data path, and a
launcher that runs `pretrain_leviathan` under torchrun on N gloo ranks.

Shared by the training, evaluation and conversion tests (each wraps them in pytest fixtures)::

    data = prepare_sample_data(tmp / "corpus")                  # data + tokenizer flags
    run = launch(2, [*TINY_LEV_MODEL, *TINY_TRAIN, *data, "--save", ckpt], tmp / "run").check()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_ext.data.preprocess import PreprocessConfig, preprocess
from megatron_ext.data.sample_corpus import SampleCorpusSpec, write_sample_corpus
from megatron_ext.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece
from tests.support.distributed import run_entry
from tests.support.jobs import launch as start

__all__ = [
    "REPO",
    "ENTRY",
    "ENTRY_MODULE",
    "TINY_LEV_MODEL",
    "TINY_TRAIN",
    "TINY_MOCK_RUN",
    "TRAINED_ARMS",
    "Run",
    "launch",
    "prepare_sample_data",
    "run_command",
    "run_tool",
    "train",
    "trained_run_flags",
]

# The training entry, importable from a checkout and from an installed package (it is installed
# as a top-level module beside megatron_ext; see pyproject.toml).
ENTRY_MODULE = "pretrain_leviathan"
# The checkout these tests belong to, and the entry's file in it.
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
# earlier with --exit-interval where a test needs fewer. No dropout (Megatron-LM's default is
# 0.1): runs at different layouts compare their losses.
TINY_TRAIN = [
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "30",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234",
    "--log-interval", "1", "--eval-interval", "10", "--eval-iters", "2",
    "--num-workers", "0", "--no-loss-curve", "--hidden-dropout", "0.0",
    "--attention-dropout", "0.0",
]  # fmt: skip
# TINY_TRAIN at Megatron-LM's default dropout (0.1), for the resume and restart tests: dropout's
# streams are part of what a resume restores.
TINY_TRAIN_DEFAULT_DROPOUT = TINY_TRAIN[: TINY_TRAIN.index("--hidden-dropout")]
# The shortened quick start that README.md shows (4 iterations per arm on a 1 MB sample corpus):
# tools/quickstart.py's flags of the session's `quickstart_run` (tests/conftest.py).
QUICKSTART_FLAGS = ("--iters", "4", "--eval-interval", "2", "--corpus-mb", "1")
# arm -> (ranks, layout flags, training flags) of the session's `trained` checkpoints
# (tests/conftest.py). LEV and TIED train 6 iterations at TP=2 with validation every 3 (the
# evaluation tests compare the loop's validation loss at iteration 6 with the tools'), LEV saving
# at 3 and 6 (tests/checkpoint/test_digests.py damages 6 and falls back on 3); the other arms
# train 2 iterations, ALBERT at PP=2, the rest on one rank.
_SHORT = ["--exit-interval", "2", "--save-interval", "2", "--eval-iters", "0"]
_VALIDATED = ["--exit-interval", "6", "--eval-interval", "3"]
TRAINED_ARMS = {
    "lev": (2, ["--tensor-model-parallel-size", "2"], [*_VALIDATED, "--save-interval", "3"]),
    "tied": (2, ["--tensor-model-parallel-size", "2"], _VALIDATED),
    "albert": (2, ["--pipeline-model-parallel-size", "2"], _SHORT),
    "untied": (1, [], _SHORT),
    "flat-mlp": (1, [], _SHORT),
    "factored-mlp": (1, [], _SHORT),
}


def trained_run_flags(arm: str, data: list[str]) -> tuple[int, list[str]]:
    """(ranks, flags but --save and the logs) of the session's `trained` run of `arm` on `data`:
    TINY_LEV_MODEL as that arm, with grouped-query attention (it exercises every converter's QKV
    group mapping), and TINY_TRAIN."""
    nproc, layout, train = TRAINED_ARMS[arm]
    model = list(TINY_LEV_MODEL)
    model[model.index("--embedding-type") + 1] = arm
    model += ["--group-query-attention", "--num-query-groups", "2"]
    return nproc, [*model, *TINY_TRAIN, *data, *layout, *train]


# The smallest whole run, one rank, no data files (mock data): for checks that need a run and
# not its numbers (resume errors, --save locks, checkpoint files); add --train-iters.
TINY_MOCK_RUN = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--ffn-hidden-size", "64", "--seq-length", "16", "--embedding-type", "untied",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--eval-iters", "0", "--no-loss-curve", "--log-interval", "1",
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
]  # fmt: skip


@dataclass
class Run:
    """Outcome of one launch: exit code, combined output, per-iteration records (and, when it
    was signalled, the number of DataLoader workers of each rank at the signal)."""

    returncode: int
    output: str
    records: list = field(default_factory=list)
    workers: list = field(default_factory=list)

    @property
    def losses(self) -> dict[int, float]:
        """Training loss by iteration (from --log-jsonl)."""
        return {r["iteration"]: r["loss"] for r in self.records}

    def check(self) -> "Run":
        """Assert the run exited 0 (showing the end of its output otherwise)."""
        assert self.returncode == 0, f"run failed (exit {self.returncode}):\n{self.output[-6000:]}"
        return self


def prepare_sample_data(root: Path, vocab_size: int = 512, size_mb: float = 0.4) -> list[str]:
    """Data flags for a generated corpus, the quick-start path (make_sample_corpus ->
    train_tokenizer -> preprocess_data, called in this process through the package functions
    those tools wrap); 0.4 MB is about 150k tokens."""
    root = Path(root)
    write_sample_corpus(root / "raw", spec=SampleCorpusSpec(size_mb=size_mb))
    train = str(root / "raw" / "train")
    train_sentencepiece(
        TokenizerTrainingConfig(
            input=[train],
            model_prefix=str(root / "tok"),
            vocab_size=vocab_size,
            num_threads=os.cpu_count() or 1,  # the tool's default
        )
    )
    preprocess(
        PreprocessConfig(
            input=[train],
            output_prefix=str(root / "sample"),
            tokenizer_type="SentencePieceTokenizer",
            tokenizer_model=str(root / "tok.model"),
            append_eod=True,
        )
    )
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
    entry: str | Path = ENTRY_MODULE,
    env: Optional[dict] = None,
) -> Run:
    """Run `entry` (pretrain_leviathan) on `nproc` ranks (torchrun; plain python for one rank)
    in `workdir`, with --log-jsonl there and `env` added, and wait for it (megatron_ext.launch).

    With `sigterm_after_iteration`, SIGTERM is sent to every rank once that iteration has been
    logged (as Slurm does on preemption).
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    jsonl = workdir / "metrics.jsonl"
    if jsonl.exists():
        jsonl.unlink()
    args = [*args, "--log-jsonl", str(jsonl)]
    workers = []
    with start(entry, nproc, args, env=env, cwd=workdir, timeout=timeout) as job:
        if sigterm_after_iteration is not None:
            job.wait_for_lines(jsonl, sigterm_after_iteration, require=False)
            workers = [len(pids) for pids in job.workers().values()]
            job.send_signal(signal.SIGTERM, "ranks")
        returncode = job.wait()
    return Run(returncode, job.output(), _records(jsonl), workers)


def train(
    nproc: int,
    args: list[str],
    workdir: Path,
    *,
    timeout: float = 300,
    env: Optional[dict] = None,
) -> Run:
    """`launch` for the tests of what a run computes: `pretrain_leviathan` on `nproc` ranks
    forked from a server that imported it once (tests.support.distributed.run_entry), each with
    torchrun's rank environment, rather than under torchrun (about 2.5 s of CPU less per rank)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    jsonl, log = workdir / "metrics.jsonl", workdir / "output.log"
    for stale in (jsonl, log):
        stale.unlink(missing_ok=True)
    args = [*args, "--log-jsonl", str(jsonl)]
    code = run_entry(ENTRY_MODULE, nproc, args, cwd=workdir, log_path=log, env=env, timeout=timeout)
    return Run(code, _text(log), _records(jsonl))


def run_command(
    entry: str,
    args: list[str],
    cwd: Path,
    *,
    nproc: int = 1,
    merge_stderr: bool = False,
    env: Optional[dict] = None,
    timeout: float = 300,
    torchrun: Optional[bool] = None,
) -> subprocess.CompletedProcess:
    """`python -m ENTRY args` (`python ENTRY args` for a .py path) on `nproc` processes in
    `cwd`, forked from the preloaded server (as `train`; `torchrun` as `run_entry`'s): its exit
    status, stdout and stderr (with `merge_stderr`, stderr interleaved into stdout and "")."""
    with tempfile.TemporaryDirectory() as logs:
        out, err = Path(logs) / "out", None if merge_stderr else Path(logs) / "err"
        code = run_entry(entry, nproc, args, cwd=Path(cwd), log_path=out, stderr_path=err,
                         env=env, timeout=timeout, torchrun=torchrun)  # fmt: skip
        return subprocess.CompletedProcess([entry, *args], code, _text(out), _text(err))


def run_tool(script: str, args: list[str], cwd: Path, timeout: float = 300):
    """`python tools/SCRIPT args` in `cwd` (`run_command`)."""
    return run_command(str(REPO / "tools" / script), args, cwd, timeout=timeout)


def _text(path: Optional[Path]) -> str:
    return path.read_text(errors="replace") if path and path.exists() else ""


def _records(jsonl: Path) -> list[dict]:
    if not jsonl.exists():
        return []
    return [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
