"""Shared fixtures: one small sample corpus and tokenizer per test session."""

from __future__ import annotations

import base64
import os

import pytest

from megatron_ext.data.sample_corpus import SampleCorpusSpec, write_sample_corpus
from megatron_ext.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("corpus")
    spec = SampleCorpusSpec(size_mb=0.6, seed=7, num_train_shards=2, vocab_words=3000)
    write_sample_corpus(str(out), spec=spec)
    return str(out)


@pytest.fixture(scope="session")
def sp_model(corpus_dir, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tok")
    config = TokenizerTrainingConfig(
        input=[os.path.join(corpus_dir, "train")],
        model_prefix=str(out / "sp"),
        vocab_size=600,
        input_sentence_size=20000,
        num_threads=1,
    )
    return train_sentencepiece(config)


@pytest.fixture(scope="session")
def tiktoken_file(tmp_path_factory) -> str:
    """A tiny byte-level .tiktoken file: 256 single bytes plus a few merges."""
    out = tmp_path_factory.mktemp("tik") / "tiny.tiktoken"
    tokens = [bytes([i]) for i in range(256)] + [b"th", b"he", b"the", b" the", b"in", b"er"]
    with open(out, "w") as handle:
        for rank, token in enumerate(tokens):
            handle.write(f"{base64.b64encode(token).decode()} {rank}\n")
    return str(out)
