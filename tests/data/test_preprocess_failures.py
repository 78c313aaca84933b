"""Preprocessing failures seen on real web text: a lone surrogate is a counted bad record; a run
whose every record is bad fails; an error in the middle of a run and Ctrl-C print the clear
line alone (no worker tracebacks), through tools/preprocess_data.py with 2 workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zstandard

from megatron_ext.data import preprocess as pp
from megatron_ext.data.readers import DataError

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "preprocess_data.py"


def _config(path, prefix, sp_model, **kw) -> pp.PreprocessConfig:
    kw.setdefault("tokenizer_type", "SentencePieceTokenizer")
    kw.setdefault("tokenizer_model", sp_model)
    return pp.PreprocessConfig(input=[str(path)], output_prefix=str(prefix), **kw)


@pytest.mark.parametrize("workers", [1, 2])
def test_lone_surrogate_is_a_counted_bad_record(sp_model, tmp_path, caplog, workers):
    path = tmp_path / "web.jsonl"
    # json.dumps escapes the surrogate: valid JSON text, as in web dumps.
    lines = [{"text": "good one"}, {"text": "broken \ud800 pair"}, {"text": "good two"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert "\\ud800" in path.read_text()
    with caplog.at_level("WARNING"):
        [summary] = pp.preprocess(_config(path, tmp_path / "out", sp_model, workers=workers))
    assert summary["documents"] == 2 and summary["bad_records"] == 1
    assert "web.jsonl:2: skipped bad record: invalid Unicode in 'text' (lone surrogate U+D800" in (
        caplog.text
    )


def test_a_run_whose_every_record_is_bad_fails(tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps({"text": f"plain words {i}"}) + "\n" for i in range(5)))
    config = pp.PreprocessConfig(
        input=[str(path)],
        output_prefix=str(tmp_path / "out"),
        tokenizer_type="NullTokenizer",
        vocab_size=100,
    )
    with pytest.raises(DataError, match="every record was bad .5 bad records.*NullTokenizer"):
        pp.preprocess(config)
    assert sorted(os.listdir(tmp_path)) == ["text.jsonl"]  # no empty dataset left behind


def _tool(sp_model: str, source: Path, prefix: Path) -> list[str]:
    return [
        sys.executable, str(TOOL), "--input", str(source), "--output-prefix", str(prefix),
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
        "--workers", "2", "--chunk-size-mb", "0.02", "--log-interval", "20",
    ]  # fmt: skip


def _no_tracebacks(stderr: str) -> None:
    for marker in ("Traceback", "ForkPoolWorker", "KeyboardInterrupt"):
        assert marker not in stderr, stderr[-4000:]


def test_mid_run_error_and_ctrl_c_print_one_line(sp_model, tmp_path):
    docs = b"".join(
        json.dumps({"text": f"document {i} " + "some words here " * 40}).encode() + b"\n"
        for i in range(6000)
    )
    compressed = zstandard.ZstdCompressor().compress(docs)
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(compressed[: len(compressed) * 2 // 3])
    run = subprocess.run(
        _tool(sp_model, cut, tmp_path / "a"), cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 2, run.stderr[-3000:]
    _no_tracebacks(run.stderr)
    errors = [line for line in run.stderr.splitlines() if not line.startswith("[")]
    assert errors == [f"error: {cut}: truncated zstd file (the stream ends inside a frame); "
                      "re-download or re-compress it"], errors  # fmt: skip

    # Ctrl-C: the terminal signals the whole foreground process group, workers included.
    big = tmp_path / "big.jsonl"
    big.write_bytes(docs)
    proc = subprocess.Popen(
        _tool(sp_model, big, tmp_path / "b"),
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # As in a terminal: a suite started in the background (`cmd &` without job control)
        # hands its children SIGINT ignored, and Python keeps an ignored SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "Processed" in line:
            break
    os.killpg(proc.pid, signal.SIGINT)
    # A tool that hangs on Ctrl-C (as multiprocessing.Pool.terminate can) fails here, not CI.
    watchdog = threading.Timer(60, os.killpg, (proc.pid, signal.SIGKILL))
    watchdog.start()
    rest = proc.stderr.read()
    watchdog.cancel()
    assert proc.wait() == 130, "exit code (-9: hung after Ctrl-C)\n" + "".join(seen) + rest
    _no_tracebacks(rest)
    assert [line for line in rest.splitlines() if not line.startswith("[")] == [
        "interrupted: temporary outputs removed, finished outputs kept"
    ], rest
    assert sorted(os.listdir(tmp_path)) == ["big.jsonl", "cut.jsonl.zst"]
