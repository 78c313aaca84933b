"""export-hf's tokenizer files: a tiktoken encoding (the paper's o200k, and a small rank file of
our own) becomes a Hugging Face tokenizer that encodes every text with the same ids, keeps the
special tokens at their ids without matching them in text, and carries the source's
fingerprint."""

from __future__ import annotations

import base64
import gzip
import importlib.util
from pathlib import Path

import pytest

from megatron_ext.data.tokenizers import build_tokenizer

pytest.importorskip("transformers")

TEXTS = [
    "The history of the river, a café and 東京 in 2026: 1234567 items!",
    "  leading spaces,\ttabs\n\nand blank lines\r\n",
    "don't WE'LL see émoji 🎉 <|endoftext|> as ordinary text",
]


def _hf(out: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out))


def _check(source, out: Path, texts) -> None:
    from megatron_ext.conversion.hf import export_tokenizer  # needs transformers

    export_tokenizer(source, str(out))
    exported = _hf(out)
    for text in texts:
        ids = source.tokenize(text)
        assert exported(text, add_special_tokens=False)["input_ids"] == ids
        assert exported.decode(ids) == text
    assert exported.eos_token_id == source.eod
    assert build_tokenizer("HuggingFaceTokenizer", str(out)).fingerprint == source.fingerprint


def test_a_small_tiktoken_rank_file(tmp_path):
    tokens = [bytes([i]) for i in range(256)] + [b"th", b"he", b"the", b" the", b"in", b"er"]
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    source = build_tokenizer("TikTokenizer", str(path))
    out = tmp_path / "hf"
    out.mkdir()
    _check(source, out, TEXTS + ["the theatre in there"])
    assert _hf(out).pad_token_id == source.pad  # <|pad|> after the highest rank


@pytest.mark.skipif(
    importlib.util.find_spec("bpe_openai") is None, reason="needs the bpe-openai package"
)
def test_the_o200k_encoding(tmp_path):
    spec = importlib.util.find_spec("bpe_openai")
    packed = Path(spec.submodule_search_locations[0]) / "data" / "o200k_base.tiktoken.gz"
    path = tmp_path / "o200k_base.tiktoken"
    path.write_bytes(gzip.decompress(packed.read_bytes()))
    source = build_tokenizer("TikTokenizer", str(path))
    out = tmp_path / "hf"
    out.mkdir()
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    _check(source, out, TEXTS + [readme])
    assert source.eod == 199999  # o200k's published <|endoftext|>, not the next free id
