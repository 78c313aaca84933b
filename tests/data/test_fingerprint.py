"""Tokenizer fingerprints: recorded beside every dataset and in checkpoints, compared where a
dataset, a counts file, a checkpoint and a tokenizer meet (issue: a dataset made with another
tokenizer of the same vocabulary size used to be accepted silently)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from megatron_ext.checkpoint.format import CheckpointError
from megatron_ext.config.data import DataConfig
from megatron_ext.data.fingerprint import (
    TokenizerMismatchError,
    read_sidecar,
    sidecar_path,
    tokenizer_record,
)
from megatron_ext.data.indexed import dataset_files, merge_datasets
from megatron_ext.data.loading import build_train_valid_test_datasets
from megatron_ext.data.preprocess import PreprocessConfig, preprocess
from megatron_ext.data.readers import DataError
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.evaluation.frequency import training_counts
from megatron_ext.inference.loading import SavedRun, run_tokenizer


def _sp(path: str):
    return build_tokenizer("SentencePieceTokenizer", path)


def _preprocess(corpus_dir: str, model: str, prefix: str) -> str:
    preprocess(
        PreprocessConfig(
            input=[os.path.join(corpus_dir, "val.jsonl.zst")],
            output_prefix=prefix,
            tokenizer_type="SentencePieceTokenizer",
            tokenizer_model=model,
            append_eod=True,
            workers=1,
        )
    )
    return prefix + "_text_document"


@pytest.fixture(scope="module")
def datasets(corpus_dir, sp_model, other_sp_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fp_data")
    return {
        "ours": _preprocess(corpus_dir, sp_model, str(out / "ours")),
        "again": _preprocess(corpus_dir, sp_model, str(out / "again")),
        "other": _preprocess(corpus_dir, other_sp_model, str(out / "other")),
    }


def test_fingerprint_follows_the_files_content_not_their_location(
    sp_model, other_sp_model, tiktoken_file, tmp_path
):
    copy = tmp_path / "copied.model"
    shutil.copy(sp_model, copy)
    ours, other = _sp(sp_model), _sp(other_sp_model)
    assert ours.vocab_size == other.vocab_size == 600
    assert _sp(str(copy)).fingerprint == ours.fingerprint
    assert other.fingerprint != ours.fingerprint
    assert len(ours.fingerprint) == 16 and int(ours.fingerprint, 16) >= 0
    null = [build_tokenizer("NullTokenizer", vocab_size=n).fingerprint for n in (100, 100, 101)]
    assert null[0] == null[1] != null[2]
    # the same rank file with another split pattern maps text to other ids
    patterns = [
        build_tokenizer("TikTokenizer", tiktoken_file, tiktoken_pattern=p).fingerprint
        for p in ("o200k", "cl100k")
    ]
    assert patterns[0] != patterns[1]


def test_preprocessing_records_the_tokenizer_beside_each_dataset(datasets, sp_model):
    record = read_sidecar(datasets["ours"])
    assert record == tokenizer_record(_sp(sp_model))
    assert record["type"] == "SentencePieceTokenizer" and record["vocab_size"] == 600
    with open(datasets["ours"].replace("_text_document", "_summary.json")) as handle:
        assert json.load(handle)["tokenizer"] == record
    assert read_sidecar(datasets["other"])["fingerprint"] != record["fingerprint"]


def test_training_refuses_a_dataset_of_another_tokenizer_of_the_same_size(
    datasets, sp_model, other_sp_model, tmp_path, caplog
):
    def build(prefix: str, model: str):
        config = DataConfig(data_path=[prefix], split="90,7,3")
        return build_train_valid_test_datasets(
            config, _sp(model), [8, None, None], seq_length=32, seed=1
        )

    with pytest.raises(TokenizerMismatchError) as error:
        build(datasets["other"], sp_model)
    message = str(error.value)
    assert "\n" not in message
    assert datasets["other"] in message and "this run's tokenizer" in message
    assert _sp(other_sp_model).fingerprint in message and _sp(sp_model).fingerprint in message
    train, _, _ = build(datasets["ours"], sp_model)
    assert len(train) >= 8

    # a dataset written by stock Megatron-LM has no sidecar: it loads, with one warning
    stock = str(tmp_path / "stock_text_document")
    for src, dst in zip(dataset_files(datasets["ours"]), dataset_files(stock)):
        shutil.copy(src, dst)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train, _, _ = build(stock, other_sp_model)
    warnings = [r for r in caplog.records if "cannot be checked" in r.getMessage()]
    assert len(warnings) == 1 and stock in warnings[0].getMessage()
    assert len(train) >= 8


def test_merge_carries_the_record_and_refuses_mixed_tokenizers(datasets, tmp_path, caplog):
    merged = str(tmp_path / "merged")
    summary = merge_datasets([datasets["ours"], datasets["again"]], merged)
    assert read_sidecar(merged) == read_sidecar(datasets["ours"]) == summary["tokenizer"]

    mixed = str(tmp_path / "mixed")
    with pytest.raises(TokenizerMismatchError, match="cannot merge datasets made with different"):
        merge_datasets([datasets["ours"], datasets["other"]], mixed)
    assert not any(os.path.exists(p) for p in [*dataset_files(mixed), sidecar_path(mixed)])
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]

    # an input without a record: merged with a warning, and the output (overwriting one that
    # had a record) has none, since its tokenizer is not known
    stock = str(tmp_path / "stock")
    for src, dst in zip(dataset_files(datasets["again"]), dataset_files(stock)):
        shutil.copy(src, dst)
    with caplog.at_level(logging.WARNING):
        merge_datasets([datasets["ours"], stock], merged, overwrite=True)
    assert any("cannot be checked" in r.getMessage() for r in caplog.records)
    assert read_sidecar(merged) is None and os.path.exists(merged + ".idx")


def test_a_damaged_record_is_one_clear_error(datasets, tmp_path):
    prefix = str(tmp_path / "damaged")
    for src, dst in zip(dataset_files(datasets["ours"]), dataset_files(prefix)):
        shutil.copy(src, dst)
    text = open(sidecar_path(datasets["ours"])).read()
    with open(sidecar_path(prefix), "w") as handle:
        handle.write(text[: len(text) // 2])  # truncated
    with pytest.raises(DataError, match="unreadable tokenizer record") as error:
        read_sidecar(prefix)
    assert "\n" not in str(error.value)
    with open(sidecar_path(prefix), "w") as handle:
        json.dump({"type": "x"}, handle)
    with pytest.raises(DataError, match="not a tokenizer record"):
        read_sidecar(prefix)


def test_counts_of_another_tokenizer_are_refused_for_frequency_bins(
    datasets, sp_model, other_sp_model
):
    record = tokenizer_record(_sp(sp_model))
    counts = training_counts([datasets["ours"]], 600, record)
    assert counts.sum() > 0
    # 600 ids either way: only the fingerprint tells them apart
    with pytest.raises(TokenizerMismatchError, match="--counts-prefix"):
        training_counts([datasets["other"]], 600, record)


class _SavedRunWithoutTensors(SavedRun):
    def padded_vocab_size(self) -> int:  # read from the tensors' metadata in a real checkpoint
        return 640


def test_a_checkpoint_refuses_a_tokenizer_other_than_its_own(sp_model, other_sp_model, tmp_path):
    def run(fingerprint) -> SavedRun:
        args_json = dict(  # what args.json records of the tokenizer
            seq_length=32,
            tokenizer_type="SentencePieceTokenizer",
            tokenizer_model=sp_model,
            tokenizer_fingerprint=fingerprint,
            vocab_size=None,
            tiktoken_pattern=None,
            make_vocab_size_divisible_by=128,
            tensor_model_parallel_size=1,
        )
        return _SavedRunWithoutTensors(
            root=str(tmp_path), iteration=1, path=str(tmp_path), args_json=args_json, common={}
        )

    own = _sp(sp_model).fingerprint
    assert run_tokenizer(run(own)).fingerprint == own
    assert run_tokenizer(run(None)).fingerprint == own  # written before fingerprints
    # given another tokenizer of the same size, or the saved path now holds another model
    with pytest.raises(CheckpointError, match="another tokenizer was given") as error:
        run_tokenizer(run(own), tokenizer_model=other_sp_model)
    assert own in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(CheckpointError, match="the file changed after training"):
        run_tokenizer(run(_sp(other_sp_model).fingerprint))


def test_an_exported_tokenizer_keeps_its_sources_fingerprint_until_its_files_change(
    sp_model, tmp_path
):
    """export-hf turns a SentencePiece model into tokenizer.json files that encode
    identically, so an import-hf checkpoint still matches datasets made with the source."""
    pytest.importorskip("transformers")
    from megatron_ext.conversion.hf import export_tokenizer

    source = _sp(sp_model)
    out = tmp_path / "hf"
    out.mkdir()
    export_tokenizer(source, str(out))
    exported = build_tokenizer("HuggingFaceTokenizer", str(out))
    text = "The history of the river, a café and 東京."
    assert exported.tokenize(text) == source.tokenize(text)
    assert exported.fingerprint == source.fingerprint
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)  # what import-hf does with the files
    assert build_tokenizer("HuggingFaceTokenizer", str(copy)).fingerprint == source.fingerprint

    # edited after the export: its own files' fingerprint, no longer the source's
    config = json.loads((copy / "tokenizer.json").read_text())
    config["normalizer"] = None
    (copy / "tokenizer.json").write_text(json.dumps(config))
    assert build_tokenizer("HuggingFaceTokenizer", str(copy)).fingerprint != source.fingerprint
