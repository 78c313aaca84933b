"""Damaged indexed datasets are named (megatron_ext/data/indexed.py `check_dataset`).

In this process, each kind of damage is one DataError naming the file and what is wrong: a
`.bin` shorter or longer than its `.idx` describes, an `.idx` with a bad magic, version or
dtype code, truncated or grown, a sequence pointer that does not match, a negative length, a
document index out of range.

With real processes, before any work starts, one `error:` line and exit 2, no traceback: training
(`pretrain_leviathan.py` on a truncated `.bin`), merging (`tools/merge_datasets.py` on a grown
`.bin`), evaluation (`tools/evaluate.py perplexity` on an `.idx` of bad magic) and the frequency
counts (`tools/evaluate.py frequency --counts-prefix` on a document index out of range).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.data.indexed import DatasetWriter, check_dataset
from megatron_ext.data.readers import DataError

REPO = Path(__file__).resolve().parents[2]
VOCAB = 128
HEADER = 34  # magic (9), version (8), dtype code (1), sequence count (8), document count (8)


def make_dataset(prefix: Path, num_docs: int = 60, doc_len: int = 40) -> Path:
    """uint16 ids, `num_docs` documents of `doc_len` tokens; returns the prefix."""
    rng = np.random.default_rng(0)
    writer = DatasetWriter(str(prefix), VOCAB)
    tokens = rng.integers(1, VOCAB, size=num_docs * doc_len)
    writer.add_documents(tokens, np.full(num_docs, doc_len, dtype=np.int32))
    writer.finalize()
    return prefix


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def _damaged(tmp_path: Path, kind: str) -> Path:
    prefix = make_dataset(tmp_path / kind / "data_text_document", num_docs=5, doc_len=4)
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    sequences = 5
    if kind == "bin shorter":
        with open(bin_, "r+b") as handle:
            handle.truncate(bin_.stat().st_size - 2)
    elif kind == "bin longer":
        with open(bin_, "ab") as handle:
            handle.write(b"\0\0")
    elif kind == "bad magic":
        _patch(idx, 0, b"NOTANIDX\0")
    elif kind == "bad version":
        _patch(idx, 9, struct.pack("<Q", 2))
    elif kind == "bad dtype":
        _patch(idx, 17, struct.pack("<B", 7))  # float32: not a token dtype
    elif kind == "idx truncated":
        with open(idx, "r+b") as handle:
            handle.truncate(idx.stat().st_size - 8)
    elif kind == "idx longer":
        with open(idx, "ab") as handle:
            handle.write(b"\0" * 3)
    elif kind == "pointer":
        _patch(idx, HEADER + 4 * sequences + 8 * 2, struct.pack("<q", 3))
    elif kind == "negative length":
        _patch(idx, HEADER + 4 * 1, struct.pack("<i", -4))
    elif kind == "document index":
        _patch(idx, HEADER + 12 * sequences + 8 * 3, struct.pack("<q", 99))
    return prefix


EXPECTED = {
    "bin shorter": r"\.bin is shorter than its index describes \(38 bytes, .*\.idx describes 20 "
    r"uint16 tokens = 40 bytes",
    "bin longer": r"\.bin is longer than its index describes \(42 bytes",
    "bad magic": r"\.idx is not a Megatron indexed-dataset index \(its first bytes are "
    r"b'NOTANIDX\\x00'",
    "bad version": r"\.idx has index version 2; this reader knows version 1",
    "bad dtype": r"\.idx has token dtype code 7, not one of 1 uint8, 2 int8, 3 int16, 4 int32, 5 "
    r"int64, 8 uint16",
    "idx truncated": r"\.idx is truncated \(\d+ bytes; 5 sequences and 6 document indices take",
    "idx longer": r"\.idx is longer than its header describes",
    "pointer": r"\.idx: sequence 2 points at byte 3 of the \.bin, not 16 where it starts",
    "negative length": r"\.idx: sequence 1 has a negative length",
    "document index": r"\.idx: document index 3 is 99, out of range \(document boundaries run "
    r"from 0 up to the 5 sequences\)",
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_each_damage_is_named(tmp_path, kind):
    prefix = _damaged(tmp_path, kind)
    with pytest.raises(DataError, match=EXPECTED[kind]) as caught:
        check_dataset(str(prefix))
    assert str(prefix) in str(caught.value)
    assert "copy the dataset again or re-run tools/preprocess_data.py" in str(caught.value) or (
        kind == "bad version"
    )


def test_a_whole_dataset_passes(tmp_path):
    prefix = make_dataset(tmp_path / "ok", num_docs=7, doc_len=9)
    assert check_dataset(str(prefix)) == 63
    empty = DatasetWriter(str(tmp_path / "empty"), VOCAB)
    empty.finalize()
    assert check_dataset(str(tmp_path / "empty")) == 0


# ------------------------------------------------------------------------- real processes


def _one_error(run: subprocess.CompletedProcess) -> str:
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Traceback" not in run.stdout + run.stderr
    return errors[0]


def _python(cwd: Path, *argv) -> subprocess.CompletedProcess:
    """`python -m MODULE args` / `python SCRIPT args` (tests.support.runs.run_command)."""
    from tests.support.runs import run_command  # torch and megatron-core: the integration test

    entry, *args = argv
    if entry == "-m":
        entry, *args = args
    return run_command(str(entry), args, cwd, timeout=600)


@pytest.mark.integration
def test_tools_name_the_damaged_file_before_working(tmp_path):
    good = make_dataset(tmp_path / "good" / "data_text_document")
    runs = {}

    short = tmp_path / "short"
    shutil.copytree(good.parent, short)
    bin_ = short / "data_text_document.bin"
    with open(bin_, "r+b") as handle:
        handle.truncate(bin_.stat().st_size // 2)
    train = [
        "-m", "pretrain_leviathan", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--split", "1,0,0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--eval-iters", "0",
        "--no-loss-curve", "--data-path", "short/data_text_document",
    ]  # fmt: skip
    runs["train"] = (_python(tmp_path, *train), "short/data_text_document.bin is shorter")

    grown = tmp_path / "grown"
    shutil.copytree(good.parent, grown)
    with open(grown / "data_text_document.bin", "ab") as handle:
        handle.write(b"\0" * 6)
    merge = [REPO / "tools" / "merge_datasets.py", "--input", "good/data_text_document",
             "grown/data_text_document", "--output-prefix", "merged"]  # fmt: skip
    runs["merge"] = (_python(tmp_path, *merge), "grown/data_text_document.bin is longer")

    magic = tmp_path / "magic"
    shutil.copytree(good.parent, magic)
    _patch(magic / "data_text_document.idx", 0, b"XXXXXXXXX")
    evaluate = [REPO / "tools" / "evaluate.py", "perplexity", "--load", "no_checkpoint_needed",
                "--data-path", "magic/data_text_document"]  # fmt: skip
    runs["evaluate"] = (
        _python(tmp_path, *evaluate),
        "magic/data_text_document.idx is not a Megatron indexed-dataset index",
    )

    docs = tmp_path / "docs"
    shutil.copytree(good.parent, docs)
    _patch(docs / "data_text_document.idx", HEADER + 12 * 60 + 8 * 5, struct.pack("<q", -1))
    frequency = [REPO / "tools" / "evaluate.py", "frequency", "--load", "no_checkpoint_needed",
                 "--data-path", "good/data_text_document", "--counts-prefix",
                 "docs/data_text_document", "--output-dir", "freq"]  # fmt: skip
    runs["frequency"] = (
        _python(tmp_path, *frequency),
        "docs/data_text_document.idx: document index 5 is -1, out of range",
    )
    for name, (run, expected) in runs.items():
        line = _one_error(run)
        assert expected in line, (name, line)
    assert " iteration        1/" not in runs["train"][0].stdout  # found before training
    assert not list(tmp_path.glob("merged*")) and not (tmp_path / "freq").exists()
