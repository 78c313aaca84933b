"""A Megatron-LM user's workflow, as they run it (issue 56): a run trained with GPT-2 BPE
(--vocab-file / --merge-file, recorded in args.json) is read by every tool that reads a
checkpoint without re-stating its files; a tokenizer file that moved is one line naming it and
the flag that points at it; data made by Megatron-LM's own preprocess (no _counts.npy, no
_tokenizer.json) with a tokenizer whose vocabulary does not cover its ids is one line on rank 0
before training, exit 2, nothing left behind.

Every command is a real process started in the run's directory with the relative paths a user
types; the training runs go through torchrun where the user would use it."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.data.readers import iter_lines
from megatron_ext.data.sample_corpus import SampleCorpusSpec, write_sample_corpus
from tests.support.gpt2_bpe import write_gpt2_bpe_files
from tests.support.runs import ENTRY_MODULE, run_command, run_tool

pytestmark = pytest.mark.integration

MODEL = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--ffn-hidden-size", "64", "--seq-length", "32", "--max-position-embeddings", "32",
    "--embedding-type", "lev", "--lev-seed-dim", "8", "--lev-rank", "2", "--lev-num-heads", "2",
    "--lev-num-knots", "5",
]  # fmt: skip
TRAIN = [
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--log-interval", "1",
    "--split", "98,1,1", "--eval-iters", "1", "--eval-interval", "2", "--no-loss-curve",
]  # fmt: skip
BPE = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "gpt2/vocab.json",
       "--merge-file", "gpt2/merges.txt"]  # fmt: skip


def _tool(cwd: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    return run_tool(script, list(args), cwd)


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    return result.stdout + result.stderr


def _one_error(result: subprocess.CompletedProcess, code: int = 2) -> str:
    out = result.stdout + result.stderr
    assert result.returncode == code, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out, out[-4000:]
    return errors[0]


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> Path:
    """A directory holding gpt2/ (GPT-2 BPE files), data/bpe_text_document (our preprocess) and
    ckpt/ (4 iterations of a tiny LEV model trained on it, saved at 2 and 4)."""
    root = tmp_path_factory.mktemp("bpe_run")
    write_sample_corpus(str(root / "raw"), spec=SampleCorpusSpec(size_mb=0.2, seed=3))
    source = sorted(glob.glob(str(root / "raw" / "train" / "*.jsonl*")))[0]
    texts = [json.loads(line)["text"] for _, line in iter_lines(source)][:300]
    write_gpt2_bpe_files(str(root / "gpt2"), texts, vocab_size=600)
    _ok(
        _tool(root, "preprocess_data.py", "--input", os.path.relpath(source, root), *BPE,
              "--output-prefix", "data/bpe", "--append-eod")
    )  # fmt: skip
    args = [*MODEL, *TRAIN, *BPE, "--data-path", "data/bpe_text_document", "--train-iters", "4"]
    args += ["--save", "ckpt", "--save-interval", "2"]
    run = run_command(ENTRY_MODULE, args, root, merge_stderr=True)
    assert run.returncode == 0, run.stdout[-4000:]
    return root


def test_every_tool_reads_a_gpt2_bpe_run(bpe_run):
    saved = json.loads((bpe_run / "ckpt" / "iter_0000004" / "args.json").read_text())
    assert (saved["vocab_file"], saved["merge_file"]) == ("gpt2/vocab.json", "gpt2/merges.txt")
    (bpe_run / "text.txt").write_text("The river runs past the old mill and into the sea.\n")

    # Each tool once (the latest checkpoint or an older one: a tool picks either the same way).
    out = _ok(_tool(bpe_run, "generate.py", "--load", "ckpt", "--iteration", "2",
                    "--prompt", "The river", "--max-new-tokens", "4"))  # fmt: skip
    assert "The river" in out and "ckpt/iter_0000002" in out
    out = _ok(_tool(bpe_run, "evaluate.py", "perplexity", "--load", "ckpt", "--split", "valid"))
    assert "ckpt/iter_0000004" in out and "perplexity" in out
    out = _ok(_tool(bpe_run, "evaluate.py", "perplexity", "--load", "ckpt", "--ckpt-step", "2",
                    "--text", "text.txt"))  # fmt: skip
    assert "ckpt/iter_0000002" in out and "perplexity" in out
    out = _ok(
        _tool(
            bpe_run,
            "evaluate.py",
            "frequency",
            "--load",
            "ckpt",
            "--text",
            "text.txt",
            "--counts-prefix",
            "data/bpe_text_document",
            "--output-dir",
            "freq",
        )
    )
    assert (bpe_run / "freq").is_dir()
    wiki = bpe_run / "wiki.test.tokens"
    wiki.write_text(" \n = River = \n \n The river runs past the mill . \n" * 4)
    _ok(_tool(bpe_run, "evaluate.py", "wikitext", "--load", "ckpt", "--file", wiki.name,
              "--context", "16", "--stride", "8"))  # fmt: skip

    convert = "convert_checkpoint.py"
    _ok(_tool(bpe_run, convert, "export-hf", "--load", "ckpt", "--output", "hf"))
    _ok(_tool(bpe_run, convert, "export-hf", "--load", "ckpt", "--output", "hf-bare",
              "--no-tokenizer"))  # fmt: skip
    assert not (bpe_run / "hf-bare" / "tokenizer.json").exists()
    transformers = pytest.importorskip("transformers")
    from megatron_ext.data.tokenizers import build_tokenizer

    ours = build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=str(bpe_run / "gpt2/vocab.json"),
        merge_file=str(bpe_run / "gpt2/merges.txt"),
    )
    exported = transformers.AutoTokenizer.from_pretrained(str(bpe_run / "hf"))
    text = "The mill's wheel turned, <|endoftext|> café 2026!\n\n  done"
    assert exported(text, add_special_tokens=False)["input_ids"] == ours.tokenize(text)
    assert exported.eos_token_id == ours.eod
    _ok(_tool(bpe_run, convert, "export-megatron", "--load", "ckpt", "--output", "megatron"))
    _ok(_tool(bpe_run, convert, "reshard", "--load", "ckpt", "--ckpt-step", "2", "--output",
              "resharded", "--target-tensor-parallel-size", "1"))  # fmt: skip
    assert (bpe_run / "resharded" / "iter_0000002" / "common.json").is_file()
    out = _ok(_tool(bpe_run, convert, "verify", "--load", "ckpt", "--ckpt-step", "2"))
    assert "iter_0000002" in out and "match" in out


def test_a_moved_tokenizer_is_one_line_and_a_flag(bpe_run, tmp_path):
    work = tmp_path / "elsewhere"
    work.mkdir()
    ckpt = str(bpe_run / "ckpt")
    before = sorted(os.listdir(work))
    line = _one_error(_tool(work, "generate.py", "--load", ckpt, "--prompt", "x"))
    assert "gpt2/vocab.json" in line and "--tokenizer-model" in line, line
    line = _one_error(
        _tool(
            work,
            "evaluate.py",
            "perplexity",
            "--load",
            ckpt,
            "--split",
            "valid",
            "--tokenizer-model",
            str(bpe_run / "gpt2" / "vocab.json"),
        )
    )
    assert "directory holding its vocab and merge files" in line, line
    assert sorted(os.listdir(work)) == before
    shutil.copytree(bpe_run / "gpt2", work / "moved")
    out = _ok(_tool(work, "generate.py", "--load", ckpt, "--prompt", "The river",
                    "--max-new-tokens", "2", "--tokenizer-model", "moved"))  # fmt: skip
    assert "The river" in out


def _megatron_lm_dataset(bpe_run: Path, where: Path) -> str:
    """The run's dataset as Megatron-LM's preprocess writes it (byte-identical .bin/.idx, no
    _counts.npy and no _tokenizer.json beside it)."""
    where.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(bpe_run / "data" / f"bpe_text_document{suffix}", where / f"mlm{suffix}")
    return str(where / "mlm")


def test_megatron_lm_data_with_a_smaller_tokenizer_is_one_line_before_training(bpe_run, tmp_path):
    prefix = _megatron_lm_dataset(bpe_run, tmp_path / "data")
    args = [*MODEL, *TRAIN, "--data-path", prefix, "--train-iters", "4"]
    args += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--save", "ckpt"]
    args += ["--tensorboard-dir", "tb", "--sequence-parallel"]  # a warning at TP=1
    run = run_command(ENTRY_MODULE, args, tmp_path, nproc=2, merge_stderr=True)
    out = run.stdout
    assert run.returncode != 0, out[-4000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1, out[-6000:]
    assert "Traceback" not in out, out[-6000:]  # no rank prints one
    largest = int(np.fromfile(prefix + ".bin", np.uint16).max())
    assert errors[0].startswith(f"error: {prefix} holds token id {largest}"), errors[0]
    assert "NullTokenizer) has only 256 ids" in errors[0], errors[0]
    assert "LEV got token id" not in out and "lm loss" not in out  # before the first iteration
    # rank 0's warnings are not repeated by rank 1 (issue 56 item 8)
    assert out.count("WARNING: --sequence-parallel is off") == 1, out[-6000:]
    assert "[rank 1] WARNING" not in out, out[-6000:]
    assert not (tmp_path / "ckpt").exists()
    assert sorted(os.listdir(tmp_path / "data")) == ["mlm.bin", "mlm.idx"]


def test_counts_for_megatron_lm_data_make_frequency_evaluation_work(bpe_run, tmp_path):
    prefix = _megatron_lm_dataset(bpe_run, tmp_path / "data")
    (tmp_path / "text.txt").write_text("The river runs past the old mill and into the sea.\n")
    ckpt = str(bpe_run / "ckpt")
    frequency = ["frequency", "--load", ckpt, "--text", "text.txt", "--counts-prefix", prefix]
    frequency += ["--output-dir", "freq", "--tokenizer-model", str(bpe_run / "gpt2")]
    line = _one_error(_tool(tmp_path, "evaluate.py", *frequency))
    assert f"python tools/count_tokens.py --data-path {prefix}" in line, line
    assert not (tmp_path / "freq").exists()

    # the wrong tokenizer: one line, nothing written
    line = _one_error(
        _tool(
            tmp_path,
            "count_tokens.py",
            "--data-path",
            prefix,
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "100",
        )
    )
    assert "holds token id" in line and "has only 101 ids" in line, line
    assert sorted(os.listdir(tmp_path / "data")) == ["mlm.bin", "mlm.idx"]

    flags = [f.replace("gpt2/", str(bpe_run / "gpt2") + "/") for f in BPE]
    _ok(_tool(tmp_path, "count_tokens.py", "--data-path", prefix, *flags))
    ours = bpe_run / "data" / "bpe_text_document"
    assert np.array_equal(np.load(prefix + "_counts.npy"), np.load(f"{ours}_counts.npy"))
    made = json.loads(Path(f"{ours}_tokenizer.json").read_text())
    assert json.loads(Path(prefix + "_tokenizer.json").read_text()) == made
    line = _one_error(_tool(tmp_path, "count_tokens.py", "--data-path", prefix, *flags))
    assert "--overwrite" in line, line
    _ok(_tool(tmp_path, "evaluate.py", *frequency))
    assert (tmp_path / "freq").is_dir()
    assert sorted(os.listdir(tmp_path / "data")) == [
        "mlm.bin", "mlm.idx", "mlm_counts.npy", "mlm_tokenizer.json"
    ]  # fmt: skip
