"""Tokenizer wrappers: shared interface, special ids, batch == single encoding, errors."""

from __future__ import annotations

import pytest

from megatron_ext.config.data import padded_vocab_size
from megatron_ext.data.tokenizers import TokenizerError, build_tokenizer

TEXTS = ["Hello world, the theory.", "naïve café 東京 🙂", "", "  two  spaces\nnewline"]


def test_sentencepiece_interface(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    assert tok.vocab_size == 600
    assert (tok.pad, tok.eod) == (0, 3)
    batch = tok.encode_batch(TEXTS)
    assert batch == [tok.tokenize(t) for t in TEXTS]
    # identity normalisation + byte fallback: decoding gives back the exact text
    for text, ids in zip(TEXTS, batch):
        assert tok.detokenize(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
    assert "tokenizer_path" in tok.unique_identifiers


def test_tiktoken_interface(tiktoken_file):
    tok = build_tokenizer("TikTokenizer", tiktoken_file)
    assert tok.vocab_size == 262 + 2
    assert (tok.eod, tok.pad) == (262, 263)
    ids = tok.tokenize("in the theory <|endoftext|>")
    assert tok.eod not in ids  # special-token text is ordinary text
    assert tok.detokenize(ids) == "in the theory <|endoftext|>"
    assert tok.encode_batch(TEXTS) == [tok.tokenize(t) for t in TEXTS]


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (tok.vocab_size, tok.eod, tok.pad) == (101, 100, None)
    assert tok.tokenize("1 2  99") == [1, 2, 99]
    assert tok.detokenize([1, 2]) == "1 2"
    with pytest.raises(TokenizerError):
        tok.tokenize("1 100")


def test_huggingface_missing_or_bad_dir(tmp_path):
    with pytest.raises(TokenizerError, match="local directory"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "nope"))
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(TokenizerError, match="transformers"):
            build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


@pytest.mark.parametrize(
    "args, match",
    [
        (("Nope", "x"), "unknown --tokenizer-type"),
        (("SentencePieceTokenizer", None), "needs --tokenizer-model"),
        (("SentencePieceTokenizer", "/nonexistent.model"), "not found"),
        (("TikTokenizer", "/nonexistent.tiktoken"), "not found"),
    ],
)
def test_unusable_tokenizer(args, match):
    with pytest.raises(TokenizerError, match=match):
        build_tokenizer(*args)


def test_corrupt_model_files(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="cannot load"):
        build_tokenizer("SentencePieceTokenizer", str(bad))
    bad_tik = tmp_path / "bad.tiktoken"
    bad_tik.write_text("!!! x\n")
    with pytest.raises(TokenizerError, match="not a .tiktoken"):
        build_tokenizer("TikTokenizer", str(bad_tik))


def test_padded_vocab_size():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(1024, 128, 2) == 1024
