"""The comparison report of several arms trained alike (``report.md`` and ``summary.json``): a
parameter/perplexity table, the loss curves, the frequency-stratified table and, with the four
ablation arms, the paper's decomposition of LEV's gain (docs/lev.md section 3), from each run's
``run.json`` and what ``tools/evaluate.py frequency`` and ``curves`` wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence

from megatron_ext._paths import atomic_write
from megatron_ext.evaluation.outputs import format_markdown_table

__all__ = ["DECOMPOSITION", "decomposition", "write_comparison_report"]

# A chain of arms that each add one ingredient of LEV (see `_decomposition_section`).
DECOMPOSITION = (
    ("continuous representation", "albert", "flat-mlp"),
    ("compositional structure", "flat-mlp", "factored-mlp"),
    ("separable spline smoothness", "factored-mlp", "lev"),
)


def decomposition(losses: dict[str, float]) -> Optional[list[tuple[str, str, str, float]]]:
    """Each ingredient's share of LEV's gain over ALBERT, as a reduction of validation loss in
    percent of ALBERT's loss (the three steps telescope to LEV vs ALBERT); None without the
    four arms."""
    if not all(a in losses for a in ("albert", "flat-mlp", "factored-mlp", "lev")):
        return None
    ref = losses["albert"]
    return [(name, a, b, 100.0 * (losses[a] - losses[b]) / ref) for name, a, b in DECOMPOSITION]


def write_comparison_report(
    out_dir: Path,
    *,
    title: str,
    setup: str,
    arms: Sequence[str],
    runs: dict[str, dict],
    freq: dict,
    freq_md: str,
    efficiency_lines: Sequence[str],
    bin_edges: Sequence[float],
) -> dict:
    """Write ``report.md`` and ``summary.json`` into ``out_dir``; return the summary.
    ``runs[arm]`` holds ``parameters`` and ``final_valid_loss``; the baseline is TIED if present,
    else the first arm; ``setup`` says what the arms share."""
    base = "tied" if "tied" in arms else arms[0]
    alls = {row["run"]: row for row in freq["rows"] if row["bin"] == "all"}  # every token's
    table, losses = _perplexity_table(arms, runs, alls, base)
    parts = decomposition(losses)
    md = [
        f"# {title}", "", setup, "",
        *table,
        *_curves_section(arms, base, efficiency_lines),
        *_frequency_section(bin_edges, freq_md),
        *(_decomposition_section(parts) if parts is not None else []),
        *_files_section(arms),
    ]  # fmt: skip
    summary = {
        "runs": runs,
        "valid_loss_all_tokens": losses,
        "decomposition": parts,
        "sample_efficiency": list(efficiency_lines),
    }
    atomic_write(Path(out_dir) / "summary.json", json.dumps(summary, indent=1))
    atomic_write(Path(out_dir) / "report.md", "\n".join(md))
    return summary


def _perplexity_table(arms, runs, alls, base) -> tuple[list[str], dict[str, float]]:
    """The "Validation perplexity" section and each arm's loss over every validation token."""
    rows, losses = [], {}
    base_params = runs[base]["parameters"]
    base_loss = float(alls[base]["loss"])
    for arm in arms:
        r = runs[arm]
        loss = losses[arm] = float(alls[arm]["loss"])
        rows.append([
            arm.upper(), f"{r['parameters']:,}",
            f"{100.0 * (r['parameters'] - base_params) / base_params:+.1f}%",
            f"{r['final_valid_loss']:.4f}", f"{loss:.4f}", f"{math.exp(loss):.2f}",
            f"{100.0 * (math.exp(loss) / math.exp(base_loss) - 1):+.1f}%",
        ])  # fmt: skip
    header = [
        "arm", "parameters", "vs " + base.upper(), "loop's valid loss",
        "valid loss (all tokens)", "valid perplexity", f"ppl vs {base.upper()}",
    ]  # fmt: skip
    return [
        "## Validation perplexity",
        "",
        "`loop's valid loss`: the training loop's last validation (its `--eval-iters` "
        "batches); the other columns score every token of the validation split "
        "(`tools/evaluate.py frequency`, row `all`).",
        "",
        format_markdown_table(header, rows),
        "",
    ], losses


def _curves_section(arms, base: str, efficiency_lines) -> list[str]:
    md = ["## Loss curves", ""]
    if len(arms) > 2:
        md += [
            f"Each arm's loss minus {base.upper()}'s against tokens (validation left, smoothed "
            "train right; below zero is better). The absolute curves: "
            "[curves_absolute.png](curves_absolute.png).",
            "",
        ]
    md += [
        "![loss curves](curves.png)",
        "",
        "Sample efficiency (tokens to reach the final validation loss of "
        f"{base.upper()}, `tools/evaluate.py curves --reference {base}`):",
        "",
    ]
    return md + ([f"- {ln}" for ln in efficiency_lines] or ["- (no other run)"])


def _frequency_section(bin_edges, freq_md: str) -> list[str]:
    return [
        "",
        "## Frequency-stratified perplexity",
        "",
        "Validation tokens binned by their relative frequency in the training data "
        f"(edges {', '.join(f'{e:g}' for e in bin_edges)}; a small corpus has no tokens "
        "in the paper's rarest bins).",
        "",
        freq_md.strip(),
        "",
        "![frequency-stratified perplexity](frequency.png)",
        "",
    ]


def _decomposition_section(parts) -> list[str]:
    total = sum(p[3] for p in parts)
    return [
        "## Ablation decomposition",
        "",
        "Each step adds one ingredient of LEV (docs/lev.md section 3): ALBERT (linear "
        "compression) -> FLAT-MLP (continuous generation from a plain seed) -> "
        "FACTORED-MLP (compositional digit seed) -> LEVIATHAN (separable spline "
        "instead of an MLP). A step's share is the reduction of validation loss (all "
        "tokens) in percent of ALBERT's loss, so the three add up to LEV vs ALBERT. "
        "Paper: +1.13%, +0.37%, +0.62%.",
        "",
        format_markdown_table(
            ["ingredient", "from", "to", "loss reduction"],
            [[n, a.upper(), b.upper(), f"{v:+.2f}%"] for n, a, b, v in parts]
            + [["total (LEV vs ALBERT)", "ALBERT", "LEVIATHAN", f"{total:+.2f}%"]],
        ),
        "",
    ]


def _files_section(arms) -> list[str]:
    return [
        "## Files",
        "",
        f"- checkpoints: {', '.join(f'`train_{a}/ckpt`' for a in arms)} "
        "(TensorBoard in `train_<arm>/tb`, full logs in `train_<arm>/train.log`)",
        "- `evaluate/frequency/frequency.{md,csv,json,png}`",
        "- `report/curves.png`"
        + (", `report/curves_absolute.png`" if len(arms) > 2 else "")
        + ", `report/frequency.png`, `report/sample_efficiency.md`",
        "",
    ]
