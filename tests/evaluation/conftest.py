"""Fixtures of the evaluation tests: a TIED run (one rank) and a LEV run saved at TP=2 (two
ranks), trained for 6 iterations on the generated corpus with validation every 3, plus a
held-out dataset preprocessed from the corpus's val split; and `tool`, which runs
tools/evaluate.py's main in this process."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_ext.testing.once import build_once, session_dir
from megatron_ext.testing.runs import REPO, TINY_LEV_MODEL, TINY_TRAIN, launch, prepare_sample_data


@dataclass
class EvalRuns:
    root: Path
    corpus: Path
    """prepare_sample_data's directory: raw/, tok.model, sample_text_document.*"""
    val_prefix: str
    """An indexed dataset of the first documents of the corpus's val split (never trained on)."""

    @property
    def val_jsonl(self) -> Path:
        return self.corpus / "raw" / "val.jsonl.zst"

    def ckpt(self, arm: str) -> str:
        return str(self.root / arm / "ckpt")

    def tensorboard(self, arm: str) -> str:
        return str(self.root / arm / "tb")

    def jsonl(self, arm: str) -> str:
        return str(self.root / arm / "metrics.jsonl")


@pytest.fixture(scope="session")
def eval_runs(tmp_path_factory) -> EvalRuns:
    """Built once per session, also when the modules using it run on two xdist workers
    (megatron_ext.testing.once); the tests only read it."""
    root = Path(build_once(session_dir(tmp_path_factory), "eval_runs", _build_eval_runs))
    return EvalRuns(root, root / "corpus", str(root / "val_text_document"))


def _build_eval_runs(root: Path) -> str:
    corpus = root / "corpus"
    data = prepare_sample_data(corpus, size_mb=0.2)
    tied = ["tied" if a == "lev" else a for a in TINY_LEV_MODEL]
    common = [*TINY_TRAIN, *data, "--eval-interval", "3", "--exit-interval", "6"]
    jobs = {
        "tied": (1, [*tied, *common]),
        "lev": (2, [*TINY_LEV_MODEL, *common, "--tensor-model-parallel-size", "2"]),
    }

    def train(arm: str):
        nproc, args = jobs[arm]
        extra = ["--save", str(root / arm / "ckpt"), "--tensorboard-dir", str(root / arm / "tb")]
        return launch(nproc, [*args, *extra], root / arm).check()

    def held_out() -> None:
        """The first documents of the val split as their own indexed dataset (about 4k tokens)."""
        from megatron_ext.data.readers import iter_lines

        lines = [line for _, line in iter_lines(str(corpus / "raw" / "val.jsonl.zst"))]
        small = root / "val_head.jsonl"
        small.write_bytes(b"".join(line.rstrip(b"\n") + b"\n" for line in lines[:12]))
        subprocess.run(
            [sys.executable, "tools/preprocess_data.py", "--input", str(small),
             "--tokenizer-type", "SentencePieceTokenizer",
             "--tokenizer-model", str(corpus / "tok.model"),
             "--output-prefix", str(root / "val"), "--append-eod"],
            check=True, cwd=REPO, capture_output=True,
        )  # fmt: skip

    with ThreadPoolExecutor(3) as pool:
        for future in [
            pool.submit(train, "tied"),
            pool.submit(train, "lev"),
            pool.submit(held_out),
        ]:
            future.result()
    return str(root)


@pytest.fixture(scope="session")
def tool():
    """`tool(*argv) -> (exit code, stdout, stderr)`: tools/evaluate.py in this process (a
    one-rank world set up and torn down by the call; the environment is restored)."""
    from megatron_ext.evaluation import evaluate as module

    def run(*argv: str) -> int:
        saved = dict(os.environ)
        try:
            code = module.main([str(a) for a in argv])
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return code

    return run
