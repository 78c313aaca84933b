"""benchmarks/scale_1p2b.py at a shrunk width (it cannot rot): the 1.2B recipe's model with one
layer at hidden 64, on the real o200k vocabulary and KJV text, through every stage: train with a
save, bit-identical resume, reshard, export-hf, the export's logits in transformers against
ours, perplexity and generation, each with its time and per-rank peak memory, the planner's
figure beside the training step, the save and the export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import scale_1p2b

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SHRUNK = [
    "--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--seq-length", "64", "--iters", "2", "--save-interval", "1",
    "--arms", "lev", "--held-out", "1",
]  # fmt: skip


def test_every_stage_at_a_shrunk_width(tmp_path):
    out = tmp_path / "scale"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "scale_1p2b.py"), "--out", str(out), *SHRUNK],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    lines = run.stdout
    assert "o200k (200019 ids, padded to 200192)" in lines  # the real vocabulary
    report = json.loads((out / "results.json").read_text())
    lev = report["arms"]["lev"]
    stages = lev["stages"]
    assert list(stages) == [
        "build", "train", "save", "resume", "reshard", "export", "hf-logits", "evaluate",
        "generate",
    ]  # fmt: skip
    for name, stage in stages.items():
        assert stage["seconds"] > 0, name
        ranks = sorted(int(r) for r in stage["peaks"])
        assert ranks == ([0] if name in ("reshard", "export", "hf-logits") else [0, 1]), name
        assert all(100 << 20 < b < 8 << 30 for b in stage["peaks"].values()), (name, stage)
        assert f"[lev] {name}" in lines
    for name in ("train", "save", "export"):
        assert stages[name]["planned"] > 0, name
        assert f"[lev] {name}: measured / planned" in lines
    assert lev["resume_identical"], stages["resume"]["note"]
    assert "bit-identical" in stages["resume"]["note"]
    logits = lev["logits"]
    assert logits["vocab"] == 200019 and logits["tokens"] == 64
    assert logits["rel_max_diff"] < 1e-5 and logits["argmax_agree"] == 1.0
    assert "16 tokens" in stages["generate"]["note"]
    assert len(lev["step_seconds"]) == len(lev["lev_seconds"]) == 2
    assert "LEV's own time" in lines
    # Checkpoints and exports are removed unless --keep.
    assert not (out / "lev" / "run").exists() and not (out / "lev" / "hf").exists()


def test_the_o200k_file_is_checked_against_the_published_digest(tmp_path, monkeypatch):
    path = scale_1p2b.o200k_tokenizer(tmp_path)
    assert path.stat().st_size > 3_000_000
    import hashlib

    assert hashlib.sha256(path.read_bytes()).hexdigest() == scale_1p2b.O200K_SHA256
    # A changed file is refused, not used.
    monkeypatch.setattr(scale_1p2b, "O200K_SHA256", "0" * 64)
    with pytest.raises(SystemExit, match="is not OpenAI's o200k_base"):
        scale_1p2b.o200k_tokenizer(tmp_path / "again")
