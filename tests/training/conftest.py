"""Shared fixtures of the training tests: a generated corpus preprocessed once per session, and
a launcher that runs `pretrain_leviathan` on N gloo ranks forked from a preloaded server
(`tests.support.runs.train`; the tests of launching itself use torchrun jobs)."""

from __future__ import annotations

import pytest

from tests.support.runs import TINY_LEV_MODEL, TINY_TRAIN, train


@pytest.fixture(scope="session")
def corpus(sample_data) -> list[str]:
    """Data flags for a generated corpus (about 150k tokens, SentencePiece vocab 512; the
    session's `sample_data`, also used by the conversion tests)."""
    return sample_data


@pytest.fixture(scope="session")
def launcher():
    """`train(nproc, args, workdir, ...)` (see tests.support.runs)."""
    return train


@pytest.fixture(scope="session")
def base_args(corpus) -> list[str]:
    """Model + training + data flags shared by the end-to-end runs."""
    return [*TINY_LEV_MODEL, *TINY_TRAIN, *corpus]
