"""tools/merge_datasets.py: a dataset prefix that has been trained on (so megatron created its
`<prefix>/cache/GPTDataset_indices` directory beside the .bin/.idx) is still that dataset, not
an empty folder of datasets; a directory of datasets still merges all of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.data.indexed import DatasetWriter

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _dataset(prefix: Path, documents: list[list[int]]) -> None:
    writer = DatasetWriter(str(prefix), 50)
    tokens = np.array([t for doc in documents for t in doc], dtype=np.int64)
    writer.add_documents(tokens, np.array([len(doc) for doc in documents], dtype=np.int32))
    writer.finalize()


def _merge(*argv: str) -> subprocess.CompletedProcess:
    tool = REPO / "tools" / "merge_datasets.py"
    return subprocess.run([sys.executable, str(tool), *argv], capture_output=True, text=True)


def test_trained_on_prefix_and_directory_inputs(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    _dataset(shards / "a_text_document", [[1, 2, 3], [4]])
    _dataset(shards / "b_text_document", [[5, 6]])
    # What training on shards/a_text_document leaves (megatron's default index cache).
    cache = shards / "a_text_document" / "cache" / "GPTDataset_indices"
    cache.mkdir(parents=True)
    (cache / "x-document_index.npy").write_bytes(b"")

    run = _merge("--input", str(shards / "a_text_document"), "--output-prefix", str(tmp_path / "a"))
    assert run.returncode == 0, run.stderr
    assert "merging 1 datasets" in run.stderr
    counts = np.load(tmp_path / "a_counts.npy")
    assert counts[1:5].tolist() == [1, 1, 1, 1] and counts.sum() == 4

    run = _merge("--input", str(shards), "--output-prefix", str(tmp_path / "all"))
    assert run.returncode == 0, run.stderr
    assert np.load(tmp_path / "all_counts.npy").sum() == 6


def test_datasets_of_different_tokenizers_are_not_merged(tmp_path):
    records = [
        {"fingerprint": fp, "type": "SentencePieceTokenizer", "model": name, "vocab_size": 50}
        for fp, name in (("aaaaaaaaaaaaaaaa", "a.model"), ("bbbbbbbbbbbbbbbb", "b.model"))
    ]
    for name, record in zip("ab", records):
        writer = DatasetWriter(str(tmp_path / name), 50, tokenizer_record=record)
        writer.add_documents(np.array([1, 2, 3]), np.array([3], dtype=np.int32))
        writer.finalize()
    run = _merge("--input", str(tmp_path / "a"), str(tmp_path / "b"), "--output-prefix",
                 str(tmp_path / "out"))  # fmt: skip
    errors = [line for line in run.stderr.splitlines() if line.startswith("error")]
    assert run.returncode == 2 and len(errors) == 1, run.stderr  # bad input: exit 2
    assert "Traceback" not in run.stderr
    assert errors[0].startswith("error: cannot merge datasets made with different tokenizers")
    assert "b.model (fingerprint bbbbbbbbbbbbbbbb)" in errors[0]
    assert not list(tmp_path.glob("out*"))
