"""GPT2BPETokenizer (--vocab-file / --merge-file): ids equal an independent implementation
(transformers' GPT2Tokenizer, Hugging Face's Rust BPE) on the same files; preprocessing writes
them."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_ext.data.readers import iter_lines
from megatron_ext.data.tokenizers import TokenizerError, build_tokenizer
from tests.support.gpt2_bpe import write_gpt2_bpe_files

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces   ",
    "Numbers 12345 and 3.14159 and contractions: don't, we'll, it's.",
    "Ünïcödé — naïve café 東京 🙂 mixed\nnewlines\r\n\ttabs",
    "",
    "<|endoftext|> is plain text inside a document",
]


def _source(corpus_dir: str) -> str:
    return sorted(glob.glob(os.path.join(corpus_dir, "train", "*.jsonl*")))[0]


def _texts(corpus_dir: str, limit: int = 400) -> list[str]:
    texts = []
    for _, line in iter_lines(_source(corpus_dir)):
        texts.append(json.loads(line)["text"])
        if len(texts) == limit:
            break
    return texts


@pytest.fixture(scope="module")
def bpe_files(corpus_dir, tmp_path_factory):
    return write_gpt2_bpe_files(str(tmp_path_factory.mktemp("gpt2")), _texts(corpus_dir) + SAMPLES)


def test_ids_match_transformers_gpt2_tokenizer(bpe_files, corpus_dir):
    transformers = pytest.importorskip("transformers")
    vocab, merges = bpe_files
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    with open(vocab) as handle, open(merges) as rules:
        reference = transformers.GPT2Tokenizer(
            vocab=json.load(handle),
            merges=[tuple(line.rstrip("\n").split(" ")) for line in rules if line[:1] != "#"],
        )
    texts = SAMPLES + _texts(corpus_dir, 50)
    # As Megatron-LM's GPT2BPETokenizer: "<|endoftext|>" inside a document is plain text.
    expected = [reference.encode(t, split_special_tokens=True) for t in texts]
    assert ours.encode_batch(texts) == expected
    assert [ours.tokenize(t) for t in texts] == expected
    assert ours.eod not in expected[SAMPLES.index(SAMPLES[-1])]
    with open(vocab) as handle:
        assert ours.eod == json.load(handle)["<|endoftext|>"]
    assert ours.vocab_size == len(reference)
    for text in texts[:10]:
        assert ours.detokenize(ours.tokenize(text)) == text


def test_bad_files_are_one_line_errors(bpe_files, tmp_path):
    vocab, merges = bpe_files
    with pytest.raises(TokenizerError, match="needs --vocab-file and --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab)
    with pytest.raises(TokenizerError, match="--merge-file: file not found"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=str(tmp_path / "x"))
    other = tmp_path / "merges.txt"
    other.write_text("#version: 0.2\nz q\nzq zq\n")
    with pytest.raises(TokenizerError, match="do not belong together"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=str(other))


def test_preprocess_data_with_gpt2_bpe(bpe_files, corpus_dir, tmp_path):
    from megatron_ext.data.indexed import load_dataset

    vocab, merges = bpe_files
    source = _source(corpus_dir)
    subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", source,
         "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
         "--output-prefix", str(tmp_path / "bpe"), "--append-eod"],
        check=True, cwd=REPO, capture_output=True,
    )  # fmt: skip
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    first = _texts(corpus_dir, 1)[0]
    dataset = load_dataset(str(tmp_path / "bpe_text_document"))
    assert np.asarray(dataset[0]).tolist() == tok.tokenize(first) + [tok.eod]
