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


def train_sp_model(inputs: list[str], out_dir, vocab_size: int = 600) -> str:
    """A SentencePiece model of `vocab_size` pieces trained on `inputs`; its .model path."""
    config = TokenizerTrainingConfig(
        input=inputs,
        model_prefix=str(out_dir / "sp"),
        vocab_size=vocab_size,
        input_sentence_size=20000,
        num_threads=1,
    )
    return train_sentencepiece(config)


@pytest.fixture(scope="session")
def sp_model(corpus_dir, tmp_path_factory) -> str:
    return train_sp_model([os.path.join(corpus_dir, "train")], tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def other_sp_model(corpus_dir, tmp_path_factory) -> str:
    """A second model of `sp_model`'s vocabulary size trained on other text (the validation
    split): the same size, other ids."""
    inputs = [os.path.join(corpus_dir, "val.jsonl.zst")]
    return train_sp_model(inputs, tmp_path_factory.mktemp("tok_other"))


@pytest.fixture(scope="session")
def tiktoken_file(tmp_path_factory) -> str:
    """A tiny byte-level .tiktoken file: 256 single bytes plus a few merges."""
    out = tmp_path_factory.mktemp("tik") / "tiny.tiktoken"
    tokens = [bytes([i]) for i in range(256)] + [b"th", b"he", b"the", b" the", b"in", b"er"]
    with open(out, "w") as handle:
        for rank, token in enumerate(tokens):
            handle.write(f"{base64.b64encode(token).decode()} {rank}\n")
    return str(out)
