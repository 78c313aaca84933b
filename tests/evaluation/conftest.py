"""Fixtures of the evaluation tests: the TIED and LEV runs of the session's `trained`
checkpoints (tests/conftest.py: both saved at TP=2, trained for 6 iterations on the session's
generated corpus with validation every 3), plus a held-out dataset preprocessed from the
corpus's val split; and `tool`, which runs tools/evaluate.py's main in this process."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_ext.data.preprocess import PreprocessConfig, preprocess
from megatron_ext.data.readers import iter_lines
from tests.support.once import build_once, session_dir


@dataclass
class EvalRuns:
    corpus: Path
    """prepare_sample_data's directory: raw/, tok.model, sample_text_document.*"""
    val_prefix: str
    """An indexed dataset of the first documents of the corpus's val split (never trained on)."""
    trained: dict
    """The session's `trained` checkpoints (tests/conftest.py)."""

    @property
    def val_jsonl(self) -> Path:
        return self.corpus / "raw" / "val.jsonl.zst"

    def ckpt(self, arm: str) -> str:
        return self.trained["ckpt"][arm]

    def tensorboard(self, arm: str) -> str:
        return self.trained["tensorboard"][arm]

    def jsonl(self, arm: str) -> str:
        return self.trained["jsonl"][arm]


@pytest.fixture(scope="session")
def eval_runs(tmp_path_factory, trained) -> EvalRuns:
    """The TIED and LEV runs of the session's `trained` checkpoints and a held-out dataset, built
    once per session, also when the modules using them run on two xdist workers
    (tests.support.once); the tests only read them."""
    corpus = Path(trained["corpus"])

    def held_out(root: Path) -> str:
        return _held_out(root, corpus)

    val_prefix = build_once(session_dir(tmp_path_factory), "eval_held_out", held_out)
    return EvalRuns(corpus, val_prefix, trained)


def _held_out(root: Path, corpus: Path) -> str:
    """The first documents of the val split as their own indexed dataset (about 4k tokens)."""
    lines = [line for _, line in iter_lines(str(corpus / "raw" / "val.jsonl.zst"))]
    small = root / "val_head.jsonl"
    small.write_bytes(b"".join(line.rstrip(b"\n") + b"\n" for line in lines[:12]))
    preprocess(
        PreprocessConfig(
            input=[str(small)],
            output_prefix=str(root / "val"),
            tokenizer_type="SentencePieceTokenizer",
            tokenizer_model=str(corpus / "tok.model"),
            append_eod=True,
        )
    )
    return str(root / "val_text_document")


TORCHRUN_IDENTITY = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_identity() -> dict[str, str]:
    """The torchrun variables of os.environ (libraries imported on first use set others)."""
    return {k: os.environ[k] for k in TORCHRUN_IDENTITY if k in os.environ}


@contextlib.contextmanager
def _environment_unchanged():
    """Assert that the block leaves the torchrun variables of os.environ as it found them: a
    tool run in this process sets up (and tears down) a one-rank world without writing RANK,
    WORLD_SIZE or MASTER_PORT there, which every process this worker starts later would
    inherit (and then join a world that is gone)."""
    saved = torchrun_identity()
    yield
    assert torchrun_identity() == saved


@pytest.fixture(scope="session")
def environment_unchanged():
    """The context manager `_environment_unchanged`, for tests that run a tool's main here."""
    return _environment_unchanged


@pytest.fixture(scope="session")
def tool():
    """`tool(*argv) -> (exit code, stdout, stderr)`: tools/evaluate.py in this process (a
    one-rank world set up and torn down by the call; asserted to leave os.environ alone)."""
    from megatron_ext.evaluation import evaluate as module

    def run(*argv: str) -> int:
        with _environment_unchanged():
            return module.main([str(a) for a in argv])

    return run
