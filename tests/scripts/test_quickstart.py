"""The quick start end to end (shortened), its reuse of finished stages, and reproduce_small.sh.

One shortened run (4 iterations per arm on a 1 MB sample corpus: the session's `quickstart_run`,
tests/conftest.py, which the docs test shares) covers every stage; a second run, on a copy of
it, must reuse the finished stages and redo the one whose completion marker is missing.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.quickstart import ALL_ARMS, MARKER
from tests.support.runs import QUICKSTART_FLAGS

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

STAGES = ("corpus", "tokenizer", "data", "train_tied", "train_lev", "evaluate", "report", "export")


def _run(out: Path, *extra: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "tools" / "quickstart.py"), "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_every_promised_file(quickstart_run):
    import matplotlib.image as mpimg
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, stdout = Path(quickstart_run["out"]), quickstart_run["stdout"]
    for stage in STAGES:
        marker = json.loads((out / stage / MARKER).read_text())
        assert marker["fingerprint"] and marker["summary"]
    assert not list(out.glob(".*.tmp")), "temporary stage directories left behind"
    for png in ("report/curves.png", "report/frequency.png", "evaluate/frequency/frequency.png"):
        img = mpimg.imread(out / png)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, png

    report = (out / "report" / "report.md").read_text()
    assert "| arm | parameters |" in report
    summary = json.loads((out / "report" / "summary.json").read_text())
    for arm in ("tied", "lev"):
        run = summary["runs"][arm]
        assert run["final_iteration"] == 4 and run["tokens"] == 4 * 16 * 128
        row = next(ln for ln in report.splitlines() if ln.startswith(f"| {arm.upper()} |"))
        assert f"{run['parameters']:,}" in row
        # The table's perplexity is the frequency table's 'all' row of the same run.
        assert f"{summary['valid_loss_all_tokens'][arm]:.4f}" in row
        assert (out / f"train_{arm}" / "ckpt").is_dir()
    assert summary["runs"]["lev"]["parameters"] != summary["runs"]["tied"]["parameters"]
    assert "| all | lev |" in report and "![loss curves](curves.png)" in report
    assert summary["sample_efficiency"] and "lev" in summary["sample_efficiency"][0]

    hf = out / "export" / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert model.config.leviathan["embedding_type"] == "lev"
    assert not model.config.tie_word_embeddings
    text = (out / "export" / "continuation.txt").read_text()
    assert text.startswith("The history of the river")
    ids = tokenizer("The history of the river", return_tensors="pt").input_ids
    again = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert again.shape[1] > ids.shape[1]
    assert tokenizer.decode(again[0], skip_special_tokens=True) + "\n" == text

    assert "Open:" in stdout and "report/report.md" in stdout.splitlines()[-3]


def test_rerun_reuses_finished_stages_and_redoes_unfinished(quickstart_run, tmp_path):
    out = tmp_path / "run"  # a copy: the session's run is only read
    shutil.copytree(quickstart_run["out"], out)
    before = {s: (out / s / MARKER).stat().st_mtime_ns for s in STAGES}
    # An export interrupted mid-way: no marker in place, a temporary directory left over.
    (out / "export" / MARKER).unlink()
    (out / ".export.tmp").mkdir()
    (out / ".export.tmp" / "partial.safetensors").write_bytes(b"half")
    stdout = _run(out, *QUICKSTART_FLAGS)
    assert stdout.count("reusing the finished stage") == len(STAGES) - 1
    for stage in STAGES[:-1]:
        assert (out / stage / MARKER).stat().st_mtime_ns == before[stage]
    assert "export LEVIATHAN" in stdout and "tools/convert_checkpoint.py export-hf" in stdout
    assert (out / "export" / MARKER).is_file()
    assert not (out / ".export.tmp").exists()


def test_reproduce_small_runs_all_six_arms_identically():
    """The script hands the driver all six arms with one budget (PY=echo prints the call)."""
    env = dict(os.environ, PY="echo", ITERS="7", OUT="runs/x", CORPUS="a.jsonl", VALID="b.jsonl")
    proc = subprocess.run(
        ["bash", str(ROOT / "examples" / "reproduce_small.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    call = proc.stdout.splitlines()[0].split()
    assert call[:3] == ["tools/quickstart.py", "--out", "runs/x"]
    arms = call[call.index("--arms") + 1 : call.index("--no-export")]
    assert arms == list(ALL_ARMS)
    assert call[call.index("--iters") + 1] == "7"
    assert call[call.index("--corpus") + 1] == "a.jsonl"
    for size in ("200m", "400m", "1.2b"):
        assert f"bash examples/recipes/pretrain.sh {size} $arm" in proc.stdout


def test_bad_input_is_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "quickstart.py"),
            "--out",
            str(tmp_path),
            "--corpus",
            str(tmp_path / "missing.jsonl"),
            "--valid-corpus",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "missing.jsonl does not exist" in proc.stderr and "Traceback" not in proc.stderr
