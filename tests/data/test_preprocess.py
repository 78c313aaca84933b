"""preprocess: round trip, determinism across worker counts, counts, splitting, safety."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest
import zstandard

from megatron_ext.data import indexed
from megatron_ext.data import preprocess as pp
from megatron_ext.data.indexed import load_dataset, merge_datasets, read_counts
from megatron_ext.data.readers import CorruptInputError, DataError, iter_lines
from megatron_ext.data.tokenizers import TokenizerError, build_tokenizer

pytestmark = pytest.mark.integration


def write_jsonl(path, records_or_lines) -> str:
    """Write records (dicts) or raw lines (bytes/str) to a .jsonl file."""
    with open(path, "wb") as handle:
        for item in records_or_lines:
            if isinstance(item, dict):
                item = json.dumps(item)
            if isinstance(item, str):
                item = item.encode("utf-8")
            handle.write(item + b"\n")
    return str(path)


def _config(inputs, prefix, model, **kw):
    defaults = dict(
        input=inputs if isinstance(inputs, list) else [inputs],
        output_prefix=str(prefix),
        tokenizer_type="SentencePieceTokenizer",
        tokenizer_model=model,
        append_eod=True,
        chunk_size_mb=1 / 64,  # 16 KiB
        log_interval=100,
    )
    defaults.update(kw)
    return pp.PreprocessConfig(**defaults)


def _files(directory):
    return sorted(os.listdir(directory))


def test_round_trip_and_counts(corpus_dir, sp_model, tmp_path):
    val = os.path.join(corpus_dir, "val.jsonl.zst")
    [summary] = pp.preprocess(_config(val, tmp_path / "val", sp_model, workers=2))
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    ds = load_dataset(str(tmp_path / "val_text_document"))
    texts = [json.loads(line)["text"] for _, line in iter_lines(val)]
    assert len(ds) == len(texts) == summary["documents"]
    for i, text in enumerate(texts):
        stored = ds[i].tolist()
        assert stored[:-1] == tok.tokenize(text)
        assert stored[-1] == tok.eod and stored.count(tok.eod) == 1
        assert tok.detokenize(stored[:-1]) == text
    assert ds.index.dtype == np.uint16
    counts = read_counts(str(tmp_path / "val_text_document"))
    assert counts.dtype == np.int64 and len(counts) == tok.vocab_size
    assert counts.sum() == ds.sequence_lengths.sum() == summary["tokens"]
    assert counts[tok.eod] == len(texts)
    assert not [f for f in _files(tmp_path) if f.endswith(".tmp")]


def test_bytes_identical_across_workers(corpus_dir, sp_model, tmp_path):
    train = os.path.join(corpus_dir, "train")
    outputs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        pp.preprocess(_config(train, prefix, sp_model, workers=workers))
        base = f"{prefix}_text_document"
        outputs.append([open(base + ext, "rb").read() for ext in (".bin", ".idx", "_counts.npy")])
    assert outputs[0] == outputs[1]


def test_index_matches_megatron_builder(corpus_dir, sp_model, tmp_path):
    """Our .idx is byte-identical to Megatron-Core's IndexedDatasetBuilder output."""
    import megatron_ext.megatron_import  # noqa: F401

    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    val = os.path.join(corpus_dir, "val.jsonl.zst")
    pp.preprocess(_config(val, tmp_path / "ours", sp_model))
    ours = load_dataset(str(tmp_path / "ours_text_document"))
    ref = str(tmp_path / "ref")
    builder = IndexedDatasetBuilder(ref + ".bin", dtype=np.uint16)
    for i in range(len(ours)):
        doc = torch.from_numpy(ours[i].astype(np.int64))
        builder.add_document(doc, [len(doc)])
    builder.finalize(ref + ".idx")
    for ext in (".bin", ".idx"):
        ours_bytes = open(str(tmp_path / "ours_text_document") + ext, "rb").read()
        assert ours_bytes == open(ref + ext, "rb").read()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_index_writer_matches_megatron_index_writer(tmp_path, dtype):
    """indexed._write_index (no megatron.core import) == Megatron-Core's _IndexWriter, byte for
    byte, for both token dtypes, including an empty dataset and one-document datasets."""
    import megatron_ext.megatron_import  # noqa: F401

    from megatron.core.datasets.indexed_dataset import _IndexWriter

    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 517):
        lengths = rng.integers(1, 5000, size=n).astype(np.int32)
        ours, ref = tmp_path / f"ours{n}.idx", tmp_path / f"ref{n}.idx"
        indexed._write_index(str(ours), dtype, lengths)
        with _IndexWriter(str(ref), dtype) as writer:
            writer.write(lengths.tolist(), None, list(range(n + 1)))
        assert ours.read_bytes() == ref.read_bytes()


def test_tool_is_quiet_and_does_not_import_megatron_core(corpus_dir, sp_model, tmp_path):
    """Issue 22 item 7: no Megatron-FSDP banners; the data tool never imports megatron.core (its
    import was the seconds of start-up of a tiny split). Output equals the library call's."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    val = os.path.join(corpus_dir, "val.jsonl.zst")
    code = (
        "import runpy, sys; sys.argv = sys.argv[1:]\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "finally:\n    print('megatron.core imported:', 'megatron.core' in sys.modules)\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            os.path.join(repo, "tools", "preprocess_data.py"),
            "--input",
            val,
            "--output-prefix",
            str(tmp_path / "cli"),
            "--workers",
            "2",
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            sp_model,
            "--append-eod",
        ],
        capture_output=True,
        text=True,
        cwd=repo,
        timeout=300,
        env={**os.environ, "PYTHONPATH": repo},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Megatron-FSDP" not in output and "Detected Megatron Core" not in output
    assert "megatron.core imported: False" in result.stdout
    pp.preprocess(_config(val, tmp_path / "lib", sp_model, workers=1))
    for ext in (".bin", ".idx", "_counts.npy"):
        cli = open(str(tmp_path / "cli_text_document") + ext, "rb").read()
        assert cli == open(str(tmp_path / "lib_text_document") + ext, "rb").read()


def test_split_by_pile_set_name(corpus_dir, sp_model, tmp_path):
    val = os.path.join(corpus_dir, "val.jsonl.zst")
    [summary] = pp.preprocess(
        _config(val, tmp_path / "val", sp_model, split_by="meta.pile_set_name", workers=2)
    )
    names = {json.loads(line)["meta"]["pile_set_name"] for _, line in iter_lines(val)}
    expected = {f"{tmp_path}/val_{pp._group_name(n)}_text_document" for n in names}
    assert set(summary["datasets"]) == expected
    datasets = [load_dataset(prefix) for prefix in expected]
    total = sum(len(ds) for ds in datasets)
    assert total == summary["documents"]
    assert os.path.exists(str(tmp_path / "val_Wikipedia_en_text_document.idx"))


def test_shard_output_resume_and_merge(corpus_dir, sp_model, tmp_path):
    out = str(tmp_path / "shards") + "/"
    config = _config(corpus_dir, out, sp_model, workers=2, shard_output=True)
    summaries = pp.preprocess(config)
    assert sorted(os.path.basename(s["output_prefix"]) for s in summaries) == [
        "test",
        "train_00",
        "train_01",
        "val",
    ]
    # existing outputs: clear error without --skip-existing/--overwrite; resume skips all
    with pytest.raises(DataError, match="output exists"):
        pp.preprocess(_config(corpus_dir, out, sp_model, shard_output=True))
    os.remove(out + "train_01_summary.json")  # as if the run had stopped before this shard
    again = pp.preprocess(_config(corpus_dir, out, sp_model, shard_output=True, skip_existing=True))
    assert [os.path.basename(s["output_prefix"]) for s in again] == ["train_01"]
    parts = [out + f"train_0{i}_text_document" for i in range(2)]
    merged = str(tmp_path / "merged_text_document")
    summary = merge_datasets(parts, merged)
    # keep the datasets referenced: their arrays are views of mmaps closed on deletion
    part_ds = [load_dataset(p) for p in parts]
    merged_ds = load_dataset(merged)
    sizes = [len(ds) for ds in part_ds]
    assert summary["documents"] == len(merged_ds) == sum(sizes)
    assert np.array_equal(merged_ds[0], part_ds[0][0])
    assert np.array_equal(merged_ds[sizes[0]], part_ds[1][0])
    total = sum(read_counts(p) for p in parts)
    assert np.array_equal(read_counts(merged), total)
    assert read_counts(merged).sum() == merged_ds.sequence_lengths.sum()


BAD_LINES = [
    {"text": "good one"},
    b"{not json",
    {"other": "missing key"},
    {"text": 123},
    b'{"text": "bad \xff utf8"}',
    {"text": ""},
    {"text": "   "},
    b"[1, 2]",
    b"",
    {"text": "good two"},
]


def test_bad_records_counted_and_skipped(sp_model, tmp_path, caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    with caplog.at_level("WARNING"):
        [summary] = pp.preprocess(_config(path, tmp_path / "out", sp_model))
    assert summary["documents"] == 2
    assert summary["bad_records"] == 5
    assert summary["empty_documents"] == 2
    text = caplog.text
    for line_no, reason in [
        (2, "invalid JSON"),
        (3, "missing key 'text'"),
        (4, "non-string 'text' (int)"),
        (5, "invalid UTF-8"),
        (8, "not a JSON object"),
    ]:
        assert f"bad.jsonl:{line_no}: skipped bad record: {reason}" in text


def test_strict_aborts_without_output(sp_model, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    with pytest.raises(pp.BadRecordError, match=r"bad.jsonl:2: bad record: invalid JSON"):
        pp.preprocess(_config(path, tmp_path / "out", sp_model, strict=True, workers=2))
    assert _files(tmp_path) == ["bad.jsonl"]


def test_truncated_zst_reported_by_name(sp_model, tmp_path):
    data = b"".join(json.dumps({"text": f"doc {i} " * 50}).encode() + b"\n" for i in range(2000))
    compressed = zstandard.ZstdCompressor().compress(data)
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(compressed[: len(compressed) // 2])
    with pytest.raises(CorruptInputError, match="cut.jsonl.zst: truncated zstd"):
        pp.preprocess(_config(str(path), tmp_path / "out", sp_model, workers=2))
    assert _files(tmp_path) == ["cut.jsonl.zst"]


def test_gzip_input_and_truncated_gzip(sp_model, tmp_path):
    data = b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(50))
    good = tmp_path / "a.json.gz"
    good.write_bytes(gzip.compress(data))
    [summary] = pp.preprocess(_config(str(good), tmp_path / "gz", sp_model))
    assert summary["documents"] == 50
    cut = tmp_path / "b.json.gz"
    cut.write_bytes(gzip.compress(data * 50)[:300])
    with pytest.raises(CorruptInputError, match="b.json.gz: truncated gzip"):
        pp.preprocess(_config(str(cut), tmp_path / "gz2", sp_model))


def test_missing_input_existing_output_bad_tokenizer(sp_model, tmp_path):
    with pytest.raises(DataError, match="input not found"):
        pp.preprocess(_config(str(tmp_path / "none*.jsonl"), tmp_path / "o", sp_model))
    path = write_jsonl(tmp_path / "ok.jsonl", [{"text": "hello"}])
    pp.preprocess(_config(path, tmp_path / "o", sp_model))
    with pytest.raises(DataError, match="output exists: .*o_summary.json"):
        pp.preprocess(_config(path, tmp_path / "o", sp_model))
    [summary] = pp.preprocess(_config(path, tmp_path / "o", sp_model, overwrite=True))
    assert summary["documents"] == 1
    with pytest.raises(TokenizerError, match="not found"):
        pp.preprocess(_config(path, tmp_path / "p", str(tmp_path / "missing.model")))


def test_exception_mid_run_leaves_no_partial_output(corpus_dir, sp_model, tmp_path, monkeypatch):
    calls = {"n": 0}
    original = indexed.DatasetWriter.add_documents

    def flaky(self, tokens, lengths):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # what Ctrl-C raises in the main thread
        return original(self, tokens, lengths)

    monkeypatch.setattr(indexed.DatasetWriter, "add_documents", flaky)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        pp.preprocess(_config(os.path.join(corpus_dir, "train"), out / "x", sp_model, workers=2))
    assert calls["n"] == 3
    assert _files(out) == []


def test_tiktoken_and_null_tokenizers(tiktoken_file, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "the theory in there"}, {"text": "1 2 3"}])
    [s] = pp.preprocess(
        _config(path, tmp_path / "tik", tiktoken_file, tokenizer_type="TikTokenizer", workers=2)
    )
    tok = build_tokenizer("TikTokenizer", tiktoken_file)
    ds = load_dataset(str(tmp_path / "tik_text_document"))
    assert ds[0].tolist() == tok.tokenize("the theory in there") + [tok.eod]
    [s] = pp.preprocess(
        _config(
            path,
            tmp_path / "null",
            None,
            tokenizer_type="NullTokenizer",
            vocab_size=10,
            json_keys=["text"],
        )
    )
    assert (s["documents"], s["bad_records"]) == (1, 1)  # text that is not ids is a bad record
    null_ds = load_dataset(str(tmp_path / "null_text_document"))
    assert null_ds[0].tolist() == [1, 2, 3, 10]


def _local_hf_tokenizer(directory, texts) -> str:
    """A Hugging Face tokenizer trained here and saved with save_pretrained (no hub access)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", eos_token="</s>"
    )
    fast.save_pretrained(str(directory))
    return str(directory)


def test_huggingface_tokenizer_from_a_local_directory(corpus_dir, tmp_path):
    val = os.path.join(corpus_dir, "val.jsonl.zst")
    texts = [json.loads(line)["text"] for _, line in iter_lines(val)]
    hf_dir = _local_hf_tokenizer(tmp_path / "hf", texts)
    tok = build_tokenizer("HuggingFaceTokenizer", hf_dir)
    assert tok.eod == 1 and tok.pad is None and tok.vocab_size == 300
    assert tok.encode_batch(texts[:5]) == [tok.tokenize(t) for t in texts[:5]]
    [summary] = pp.preprocess(
        _config(val, tmp_path / "hfval", hf_dir, tokenizer_type="HuggingFaceTokenizer", workers=2)
    )
    ds = load_dataset(str(tmp_path / "hfval_text_document"))
    assert len(ds) == len(texts) == summary["documents"]
    for i in (0, len(texts) - 1):
        stored = ds[i].tolist()
        assert stored[:-1] == tok.tokenize(texts[i]) and stored[-1] == tok.eod
        assert tok.detokenize(stored[:-1]) == texts[i]
