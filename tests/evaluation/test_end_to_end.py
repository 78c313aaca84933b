"""End to end: tools/evaluate.py on a TIED run and a LEV run saved at TP=2 (the session's
`trained` checkpoints, tests/conftest.py)."""

from __future__ import annotations

import gzip
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from tests.support.runs import run_command, run_tool

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _validation_losses(tensorboard_dir: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tensorboard_dir)
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("lm loss validation")}


def _assert_png(path: str) -> None:
    import matplotlib.image

    with open(path, "rb") as handle:
        assert handle.read(8) == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.parametrize("arm", ["tied", "lev"])
def test_validation_loss_equals_the_training_loops(eval_runs, tool, tmp_path, arm):
    """The loop validated the final weights at iteration 6 (both arms at TP=2); the tool
    evaluates the same batches at TP=1."""
    out = tmp_path / arm
    assert tool("perplexity", "--load", eval_runs.ckpt(arm), "--split", "valid",
                "--output-dir", out, "--no-progress") == 0  # fmt: skip
    result = json.loads((out / "perplexity.json").read_text())
    loop = _validation_losses(eval_runs.tensorboard(arm))[6]
    assert result["tokens"] == 2 * 8 * 32  # --eval-iters 2 x --global-batch-size 8 x seq 32
    assert result["loss"] == pytest.approx(loop, rel=1e-5)  # float32 sums in another order
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))


def test_tp2_saved_checkpoint_gives_the_same_loss_at_tp1_and_tp2(eval_runs, tool, tmp_path):
    from megatron_ext.data.readers import iter_lines

    texts = [json.loads(line)["text"] for _, line in iter_lines(str(eval_runs.val_jsonl))]
    text = tmp_path / "held_out.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:4]))
    flags = ["perplexity", "--load", eval_runs.ckpt("lev"), "--text", str(text), "--no-progress"]
    assert tool(*flags, "--output-dir", tmp_path / "tp1") == 0
    args = [*flags, "--tensor-model-parallel-size", "2", "--output-dir", str(tmp_path / "tp2")]
    run = run_command("megatron_ext.evaluation.evaluate", args, tmp_path, nproc=2)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    tp1 = json.loads((tmp_path / "tp1" / "perplexity.json").read_text())
    tp2 = json.loads((tmp_path / "tp2" / "perplexity.json").read_text())
    assert tp1["tokens"] == tp2["tokens"] > 500
    assert abs(tp1["loss"] - tp2["loss"]) < 1e-5


def test_whole_dataset_perplexity_and_frequency_report(eval_runs, tool, tmp_path, capsys):
    from megatron_ext.data.indexed import num_tokens

    prefix = eval_runs.val_prefix
    assert tool("perplexity", "--load", eval_runs.ckpt("tied"), "--data-path", prefix,
                "--output-dir", tmp_path / "ppl", "--micro-batch-size", "64") == 0  # fmt: skip
    whole = json.loads((tmp_path / "ppl" / "perplexity.json").read_text())
    assert whole["tokens"] == num_tokens(prefix) - 1  # every token but the first, once

    out = tmp_path / "freq"
    edges = ["1e-5", "1e-4", "1e-3", "1e-2"]
    capsys.readouterr()
    assert tool("frequency", "--load", eval_runs.ckpt("tied"), "--load", eval_runs.ckpt("lev"),
                "--names", "tied", "lev", "--baseline", "tied", "--data-path", prefix,
                "--bin-edges", *edges, "--output-dir", out, "--no-progress",
                "--micro-batch-size", "64") == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "| bin | run | tokens | share | loss | perplexity | ppl change vs tied |" in printed
    for name in ("frequency.md", "frequency.csv", "frequency.json"):
        assert (out / name).stat().st_size > 0
    _assert_png(str(out / "frequency.png"))
    report = json.loads((out / "frequency.json").read_text())
    assert report["bins"] == ["<1/100k", "1/100k-1/10k", "1/10k-1/1k", "1/1k-1/100", ">=1/100"]
    for run in ("tied", "lev"):
        rows = [r for r in report["rows"] if r["run"] == run]
        assert [r["bin"] for r in rows] == [*report["bins"], "all"]  # no bin dropped
        assert sum(r["tokens"] for r in rows[:-1]) == rows[-1]["tokens"] == whole["tokens"]
        for r in rows[:-1]:
            assert (r["tokens"] == 0) == (r["loss"] is None)  # empty bins: reported, no loss
        assert sum(r["share"] for r in rows[:-1] if r["tokens"]) == pytest.approx(1.0)
    tied_all = [r for r in report["rows"] if r["run"] == "tied" and r["bin"] == "all"][0]
    assert tied_all["loss"] == pytest.approx(whole["loss"], rel=1e-9)
    lev_all = [r for r in report["rows"] if r["run"] == "lev" and r["bin"] == "all"][0]
    assert lev_all["ppl_change_vs_baseline"] == pytest.approx(
        lev_all["perplexity"] / tied_all["perplexity"] - 1
    )


def test_wikitext_zero_shot(eval_runs, tool, tmp_path, capsys):
    from megatron_ext.data.tokenizers import build_tokenizer
    from megatron_ext.evaluation.wikitext import detokenize, read_wikitext
    from tools.make_demo_data import wikitext_from_jsonl

    wiki = wikitext_from_jsonl(str(eval_runs.val_jsonl), str(tmp_path / "wiki.test.tokens"), 4)
    assert tool("wikitext", "--load", eval_runs.ckpt("lev"), "--file", wiki, "--context", "32",
                "--stride", "16", "--output-dir", tmp_path, "--no-progress") == 0  # fmt: skip
    result = json.loads((tmp_path / "wikitext.json").read_text())
    articles = read_wikitext(wiki)
    tokenizer = build_tokenizer("SentencePieceTokenizer", str(eval_runs.corpus / "tok.model"))
    assert result["articles"] == 4
    assert result["tokens"] == sum(len(tokenizer.tokenize(detokenize(a))) for a in articles)
    assert result["words"] == sum(len(a.split()) for a in articles)
    total = result["token_loss"] * result["tokens"]
    assert result["word_perplexity"] == pytest.approx(math.exp(total / result["words"]))
    assert "word perplexity" in capsys.readouterr().out


def test_curves_and_sample_efficiency(eval_runs, tool, tmp_path, capsys):
    out = tmp_path / "curves"
    assert tool("curves", "--run", f"tied={eval_runs.tensorboard('tied')}",
                "--run", f"lev={eval_runs.tensorboard('lev')}", "--seq-length", "32",
                "--smoothing", "0.5", "--reference", "tied", "--output-dir", out) == 0  # fmt: skip
    _assert_png(str(out / "curves.png"))
    (row,) = json.loads((out / "sample_efficiency.json").read_text())
    tied = _validation_losses(eval_runs.tensorboard("tied"))
    assert row["target_loss"] == pytest.approx(tied[6])
    assert row["reference_tokens"] == 6 * 8 * 32
    assert row["message"] in capsys.readouterr().out
    assert tool("curves", "--run", f"lev={eval_runs.jsonl('lev')}", "--seq-length", "32",
                "--output-dir", tmp_path / "jsonl") == 0  # fmt: skip
    _assert_png(str(tmp_path / "jsonl" / "curves.png"))


def test_curves_read_the_runs_sequence_length_quietly(eval_runs, tmp_path):
    """`evaluate.py curves` as a user runs it, without --seq-length: each TensorBoard run
    records its own (the same tokens as --seq-length 32 gives), and TensorBoard's reader adds
    no "Directory watcher advancing" lines; a --log-jsonl run, which does not record it, is one
    line asking for --seq-length, with nothing written."""
    runs = ["--run", f"tied={eval_runs.tensorboard('tied')}"]
    runs += ["--run", f"lev={eval_runs.tensorboard('lev')}", "--reference", "tied"]
    result = run_tool("evaluate.py", ["curves", *runs, "--output-dir", tmp_path / "own"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Directory watcher" not in result.stdout + result.stderr, result.stderr[-3000:]
    (row,) = json.loads((tmp_path / "own" / "sample_efficiency.json").read_text())
    assert row["reference_tokens"] == 6 * 8 * 32
    jsonl = run_tool("evaluate.py", ["curves", "--run", f"lev={eval_runs.jsonl('lev')}",
                                     "--output-dir", tmp_path / "jsonl"], tmp_path)  # fmt: skip
    errors = [line for line in jsonl.stderr.splitlines() if line.startswith("error:")]
    assert jsonl.returncode == 2 and len(errors) == 1, jsonl.stderr[-3000:]
    assert (
        "does not record the run's --seq-length" in errors[0] and "pass --seq-length" in errors[0]
    )
    assert not (tmp_path / "jsonl").exists()


def test_bad_input_is_one_line(eval_runs, tool, tmp_path, capsys):
    empty_ckpt = tmp_path / "empty_run"
    empty_ckpt.mkdir()
    empty_text = tmp_path / "empty.txt"
    empty_text.write_text("  \n")
    not_wiki = tmp_path / "notes.txt"
    not_wiki.write_text("plain text\n")
    np.save(tmp_path / "foreign_counts.npy", np.ones(100, dtype=np.int64))
    # a copy of the held-out dataset whose counts say another vocabulary made it
    for suffix in (".bin", ".idx"):
        os.link(eval_runs.val_prefix + suffix, tmp_path / f"other{suffix}")
    np.save(tmp_path / "other_counts.npy", np.ones(1000, dtype=np.int64))
    # a copy whose tokenizer record says another tokenizer of the same vocabulary made it
    for suffix in (".bin", ".idx", "_counts.npy"):
        os.link(eval_runs.val_prefix + suffix, tmp_path / f"foreign_tok{suffix}")
    record = json.loads(Path(eval_runs.val_prefix + "_tokenizer.json").read_text())
    (tmp_path / "foreign_tok_tokenizer.json").write_text(
        json.dumps({**record, "fingerprint": "0123456789abcdef", "model": "other.model"})
    )
    latin1 = tmp_path / "gutenberg.txt"
    latin1.write_bytes(" = Caf\xe9 = \n\n Na\xefve text . \n".encode("latin-1"))
    gz = tmp_path / "wiki.test.tokens.gz"
    gz.write_bytes(gzip.compress(b" = T = \n" * 50))
    out = tmp_path / "out"
    lev = eval_runs.ckpt("lev")
    tied_tb = f"tied={eval_runs.tensorboard('tied')}"
    cases = [
        (["perplexity", "--load", tmp_path / "nowhere", "--split", "valid"], "does not exist"),
        (["perplexity", "--load", empty_ckpt, "--split", "valid"], "holds no complete checkpoint"),
        (["perplexity", "--load", lev, "--data-path", tmp_path / "missing"], "does not exist"),
        (["perplexity", "--load", lev, "--text", empty_text], "no text to evaluate"),
        (["perplexity", "--load", lev, "--data-path", tmp_path / "other"],
         "preprocessed with a vocab of 1000 ids"),
        (["frequency", "--load", lev, "--split", "valid", "--output-dir", out,
          "--counts-prefix", tmp_path / "foreign"], "belongs to another tokenizer"),
        (["perplexity", "--load", lev, "--data-path", tmp_path / "foreign_tok"],
         "was tokenized with SentencePieceTokenizer other.model (fingerprint 0123456789abcdef) "
         "but the checkpoint's tokenizer is SentencePieceTokenizer tok.model"),
        (["frequency", "--load", lev, "--split", "valid", "--output-dir", out,
          "--counts-prefix", tmp_path / "foreign_tok"], "give the counts of the data the run"),
        (["wikitext", "--load", lev, "--file", not_wiki], "is not in the wikitext format"),
        (["curves", "--run", f"x={empty_ckpt}", "--seq-length", "32", "--output-dir", out],
         "holds no TensorBoard event files"),
        (["wikitext", "--load", lev, "--file", latin1],
         f"{latin1} is not valid utf-8 text: byte 0xe9 at byte offset 6"),
        (["wikitext", "--load", lev, "--file", gz], "looks like gzip-compressed data"),
        (["perplexity", "--load", lev, "--text", latin1], "pass its --encoding"),
        (["perplexity", "--load", lev, "--text", latin1, "--encoding", "klingon"],
         "--encoding 'klingon' is not a text encoding"),
        # every argument is checked before curves.png is written
        (["curves", "--run", tied_tb, "--seq-length", "32", "--reference", "nobody",
          "--output-dir", out], "--reference nobody is not one of ['tied']"),
        (["curves", "--run", tied_tb, "--run", f"lev={eval_runs.jsonl('lev')}",
          "--seq-length", "32", "--reference", "lev", "--output-dir", out],
         "has no validation losses"),
        (["lm-eval", "--load", lev, "--tasks", "x", "--log-samples"], "give --output-dir"),
    ]  # fmt: skip
    for argv, expected in cases:
        capsys.readouterr()
        assert tool(*argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], (argv, err)
    assert not out.exists()  # nothing half-written


def test_checkpoints_and_datasets_record_the_tokenizer(eval_runs):
    from megatron_ext.data.fingerprint import read_sidecar
    from megatron_ext.data.tokenizers import build_tokenizer

    fingerprint = build_tokenizer(
        "SentencePieceTokenizer", str(eval_runs.corpus / "tok.model")
    ).fingerprint
    for arm in ("tied", "lev"):
        saved = sorted(Path(eval_runs.ckpt(arm)).glob("iter_*/args.json"))
        assert saved
        for args_json in saved:
            assert json.loads(args_json.read_text())["tokenizer_fingerprint"] == fingerprint
    for prefix in (eval_runs.val_prefix, str(eval_runs.corpus / "sample_text_document")):
        assert read_sidecar(prefix)["fingerprint"] == fingerprint


def test_text_in_another_encoding_with_encoding_flag(eval_runs, tool, tmp_path, capsys):
    """The same text as UTF-8 and as Latin-1 (with --encoding latin-1) scores identically."""
    text = " = Caf\u00e9 = \n\n Na\u00efve r\u00e9sum\u00e9 of the river . \n" * 4
    (tmp_path / "utf8.txt").write_text(text, encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes(text.encode("latin-1"))
    lev = eval_runs.ckpt("lev")
    for name, extra in (("utf8", []), ("latin1", ["--encoding", "latin-1"])):
        assert tool("perplexity", "--load", lev, "--text", tmp_path / f"{name}.txt", *extra,
                    "--output-dir", tmp_path / name) == 0  # fmt: skip
        assert tool("wikitext", "--load", lev, "--file", tmp_path / f"{name}.txt", *extra,
                    "--output-dir", tmp_path / name) == 0  # fmt: skip
    for result in ("perplexity.json", "wikitext.json"):
        a, b = (json.loads((tmp_path / n / result).read_text()) for n in ("utf8", "latin1"))
        key = "loss" if result == "perplexity.json" else "token_loss"
        assert a[key] == b[key] and a["tokens"] == b["tokens"]
