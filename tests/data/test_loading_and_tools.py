"""Loading with Megatron-Core's builder, vocab checks, determinism of generators, CLI."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_ext.config.data import DataConfig
from megatron_ext.config.flags import add_flags, flag_values
from megatron_ext.data import preprocess as pp
from megatron_ext.data.loading import (
    VocabSizeMismatchError,
    _split_in_documents,
    build_train_valid_test_datasets,
    check_vocab_sizes,
)
from megatron_ext.data.readers import DataError
from megatron_ext.data.sample_corpus import SampleCorpusSpec, write_sample_corpus
from megatron_ext.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece
from megatron_ext.data.tokenizers import build_tokenizer

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def datasets(corpus_dir, sp_model, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ds")) + "/"
    pp.preprocess(
        pp.PreprocessConfig(
            input=[corpus_dir],
            output_prefix=out,
            shard_output=True,
            append_eod=True,
            tokenizer_type="SentencePieceTokenizer",
            tokenizer_model=sp_model,
            workers=2,
        )
    )
    return {name: f"{out}{name}_text_document" for name in ("train_00", "train_01", "val")}


def test_flags_and_blend(datasets, sp_model, tmp_path):
    parser = argparse.ArgumentParser()
    add_flags(parser, DataConfig)  # Megatron-LM's data flags, from DataConfig's fields
    args = parser.parse_args(
        [
            "--data-path",
            "0.7",
            datasets["train_00"],
            "0.3",
            datasets["train_01"],
            "--split",
            "90,10,0",
            "--data-cache-path",
            str(tmp_path / "cache"),
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            sp_model,
            "--eod-mask-loss",
        ]
    )
    config = DataConfig(**flag_values(DataConfig, args))
    assert config.eod_mask_loss
    tok = build_tokenizer(config.tokenizer_type, config.tokenizer_model)
    train, valid, test = build_train_valid_test_datasets(
        config, tok, [40, 8, 0], seq_length=64, seed=5
    )
    assert test is None and len(train) == 40 and len(valid) >= 8
    sample = train[3]
    assert sample["tokens"].shape == (64,) and sample["labels"].shape == (64,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert torch.all(sample["loss_mask"][sample["tokens"] == tok.eod] == 0)
    assert os.listdir(tmp_path / "cache")  # index cache written where asked
    assert not torch.distributed.is_initialized()  # the private build group is gone


def test_single_and_per_split_paths(datasets, sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    build = functools.partial(build_train_valid_test_datasets, seq_length=32, seed=1234)
    config = DataConfig(data_path=[datasets["train_00"]], split="80,10,10")
    train, valid, test = build(config, tok, [10, 2, 1])
    assert len(train) >= 10 and len(valid) >= 2 and len(test) >= 1
    config = DataConfig(train_data_path=[datasets["train_00"]], valid_data_path=[datasets["val"]])
    train, valid, test = build(config, tok, [10, 2, None])
    assert test is None and set(train[0]) >= {"tokens", "labels", "loss_mask", "position_ids"}
    train, _, _ = build(DataConfig(mock_data=True), tok, [4, 1, 1])
    assert int(train[0]["tokens"].max()) < tok.vocab_size


def test_an_empty_split_says_which_split_works(datasets, sp_model):
    """Megatron-LM's --split 969,30,1 on a small corpus leaves the test split without a
    document: one line names the split and the documents, and proposes a --split (in documents)
    that the same command then trains with."""
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    build = functools.partial(build_train_valid_test_datasets, seq_length=16, seed=1234)
    config = DataConfig(data_path=[datasets["val"]], split="969,30,1")
    with pytest.raises(DataError) as raised:
        build(config, tok, [4, 2, 2])
    message = str(raised.value)
    count = int(re.search(r"none of its (\d+) documents", message).group(1))
    assert "\n" not in message and message.startswith(f"the test split of {datasets['val']}")
    assert "--split 969,30,1" in message and "tools/merge_datasets.py" in message
    hint = re.search(r"pass --split (\d+),(\d+),(\d+) \(documents per split\)", message)
    train, valid, test = (int(n) for n in hint.groups())
    assert train + valid + test == count and min(valid, test) >= 1 and count < 1000
    fixed = dataclasses.replace(config, split=f"{train},{valid},{test}")
    built = build(fixed, tok, [4, 2, 2])
    assert all(len(ds) >= n for ds, n in zip(built, [4, 2, 2]))
    # A corpus too small for three splits says so, without a --split that cannot work.
    assert _split_in_documents([0.969, 0.03, 0.001], 2, [4, 2, 2]) is None
    assert _split_in_documents([0.969, 0.03, 0.001], 60, [4, 2, 0]) == "59,1,0"
    # A split the user set to 0 stays 0 in the proposal (no test split added to 99,1,0).
    no_test = dataclasses.replace(config, split="99,1,0")
    with pytest.raises(DataError) as raised:
        build(no_test, tok, [4, 2, 2])
    message = str(raised.value)
    assert message.startswith(f"the valid split of {datasets['val']}"), message
    hint = re.search(r"pass --split (\d+),(\d+),(\d+) \(documents per split\)", message)
    assert hint.group(0) == f"pass --split {count - 1},1,0 (documents per split)", message
    fixed = dataclasses.replace(config, split=f"{count - 1},1,0")
    train, valid, test = build(fixed, tok, [4, 2, 2])
    assert len(train) >= 4 and len(valid) >= 2 and test is None


def test_clear_errors(datasets, sp_model, tiktoken_file):
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    build = functools.partial(build_train_valid_test_datasets, seq_length=16, seed=1234)
    with pytest.raises(DataError, match="no training data"):
        build(DataConfig(), tok, [1, 1, 1])
    with pytest.raises(DataError, match="dataset not found"):
        build(DataConfig(data_path=["/nope/x"]), tok, [1, 1, 1])
    with pytest.raises(DataError, match="split of .* is empty"):
        build(DataConfig(data_path=[datasets["val"]], split="999,1,0"), tok, [1, 1, 0])
    other = build_tokenizer("TikTokenizer", tiktoken_file)
    with pytest.raises(VocabSizeMismatchError, match="preprocessed with a vocab of 600"):
        build(DataConfig(data_path=[datasets["val"]]), other, [1, 0, 0])
    with pytest.raises(VocabSizeMismatchError, match="model vocab size 500"):
        check_vocab_sizes(600, 600, 500)
    check_vocab_sizes(600, 600, 640)


def test_generators_are_deterministic(tmp_path):
    spec = SampleCorpusSpec(size_mb=0.1, seed=3, vocab_words=500)
    a = write_sample_corpus(str(tmp_path / "a"), spec=spec)
    b = write_sample_corpus(str(tmp_path / "b"), spec=spec)
    for key in a:
        assert open(a[key], "rb").read() == open(b[key], "rb").read()
    models = []
    for name in ("t1", "t2"):
        config = TokenizerTrainingConfig(
            input=[a["train/00"]],
            model_prefix=str(tmp_path / name / "tok"),
            vocab_size=400,
            model_type="unigram",
            input_sentence_size=500,
            num_threads=1,
        )
        train_sentencepiece(config)
        # pieces and scores; the .model bytes also record the output path, which differs
        models.append(open(str(tmp_path / name / "tok.vocab"), "rb").read())
    assert models[0] == models[1]
    assert (
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "t1" / "tok.model")).vocab_size
        == 400
    )


def test_zipf_long_tail(corpus_dir):
    import collections
    import json

    from megatron_ext.data.readers import iter_lines

    words = collections.Counter()
    for _, line in iter_lines(os.path.join(corpus_dir, "train", "00.jsonl.zst")):
        words.update(json.loads(line)["text"].split())
    freq = np.array(sorted(words.values(), reverse=True))
    assert freq[0] > 100 * np.median(freq)  # a few very frequent words
    assert (freq <= 2).mean() > 0.3  # and a long tail of rare ones


def _run(tool, *args):
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", tool), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_end_to_end(tmp_path):
    corpus, tok, out = tmp_path / "c", tmp_path / "tok", tmp_path / "out"
    r = _run("make_sample_corpus.py", "--output", str(corpus), "--size-mb", "0.3", "--seed", "1")
    assert r.returncode == 0, r.stderr
    r = _run(
        "train_tokenizer.py",
        "--input",
        str(corpus / "train"),
        "--model-prefix",
        str(tok),
        "--vocab-size",
        "500",
        "--num-threads",
        "1",
    )
    assert r.returncode == 0, r.stderr
    args = [
        "--input",
        str(corpus / "val.jsonl.zst"),
        "--output-prefix",
        str(out),
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        f"{tok}.model",
        "--append-eod",
        "--workers",
        "2",
        "--log-interval",
        "10",
    ]
    r = _run("preprocess_data.py", *args)
    assert r.returncode == 0, r.stderr
    assert "docs/s" in r.stderr and "MB/s" in r.stderr and "tokens/s" in r.stderr
    assert os.path.exists(f"{out}_text_document.idx")
    r = _run("preprocess_data.py", *args)  # existing output: one-line error, exit 2
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: output exists:")
    r = _run("preprocess_data.py", *args[:-4], "--input", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "error: input not found" in r.stderr
    r = _run(
        "merge_datasets.py",
        "--input",
        f"{out}_text_document",
        "--output-prefix",
        str(tmp_path / "merged"),
    )
    assert r.returncode == 0, r.stderr
    assert os.path.exists(tmp_path / "merged_counts.npy")
