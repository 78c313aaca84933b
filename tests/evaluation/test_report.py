"""The comparison report: the decomposition's arithmetic and the report's table and files."""

import json
import math

import pytest

from megatron_ext.evaluation.report import decomposition, write_comparison_report


def test_decomposition_telescopes_to_lev_vs_albert():
    losses = {"albert": 5.0, "flat-mlp": 4.9, "factored-mlp": 4.85, "lev": 4.8, "tied": 5.1}
    parts = decomposition(losses)
    assert [p[0] for p in parts] == [
        "continuous representation",
        "compositional structure",
        "separable spline smoothness",
    ]
    assert [p[3] for p in parts] == pytest.approx([2.0, 1.0, 1.0])
    assert sum(p[3] for p in parts) == pytest.approx(100 * (5.0 - 4.8) / 5.0)
    assert decomposition({"tied": 5.0, "lev": 4.9}) is None


def _freq(losses):
    rows = [{"run": arm, "bin": "all", "loss": loss} for arm, loss in losses.items()]
    return {"rows": rows + [{"run": "tied", "bin": "<1e-05", "loss": 9.0}]}


def test_report_table_against_the_inputs(tmp_path):
    arms = ("tied", "lev")
    runs = {
        "tied": {"parameters": 1000, "final_valid_loss": 5.5},
        "lev": {"parameters": 800, "final_valid_loss": 5.25},
    }
    losses = {"tied": 5.0, "lev": 4.9}
    summary = write_comparison_report(
        tmp_path,
        title="T",
        setup="Same everything.",
        arms=arms,
        runs=runs,
        freq=_freq(losses),
        freq_md="| bin | run |\n",
        efficiency_lines=["lev reaches tied's final loss after 10 tokens"],
        bin_edges=(1e-5, 1e-3),
    )
    md = (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(summary))
    lev_row = next(ln for ln in md.splitlines() if ln.startswith("| LEV |"))
    cells = [c.strip() for c in lev_row.strip("|").split("|")]
    assert cells[1:] == [
        "800",
        "-20.0%",
        "5.2500",
        "4.9000",
        f"{math.exp(4.9):.2f}",
        f"{100 * (math.exp(4.9) / math.exp(5.0) - 1):+.1f}%",
    ]
    assert summary["valid_loss_all_tokens"] == losses and summary["decomposition"] is None
    assert "## Ablation decomposition" not in md
    assert "curves_absolute" not in md  # two arms: one picture of the absolute curves
    assert "- lev reaches tied's final loss" in md and "edges 1e-05, 0.001" in md


def test_report_with_the_four_ablation_arms_decomposes(tmp_path):
    arms = ("albert", "flat-mlp", "factored-mlp", "lev")
    losses = {"albert": 5.0, "flat-mlp": 4.9, "factored-mlp": 4.85, "lev": 4.8}
    runs = {a: {"parameters": 100 + i, "final_valid_loss": 5.0} for i, a in enumerate(arms)}
    summary = write_comparison_report(
        tmp_path, title="T", setup="", arms=arms, runs=runs, freq=_freq(losses), freq_md="",
        efficiency_lines=[], bin_edges=(1e-3,),
    )  # fmt: skip
    md = (tmp_path / "report.md").read_text()
    assert "| total (LEV vs ALBERT) | ALBERT | LEVIATHAN | +4.00% |" in md
    assert "- (no other run)" in md and "vs ALBERT" in md
    assert "Each arm's loss minus ALBERT's" in md and "(curves_absolute.png)" in md
    assert [p[3] for p in summary["decomposition"]] == pytest.approx([2.0, 1.0, 1.0])
