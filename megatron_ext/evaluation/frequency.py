"""Frequency-stratified perplexity (the paper's central analysis).

Each target token is binned by its relative frequency in the *training* data, from the
`<prefix>_counts.npy` files preprocessing writes (summed over the blended datasets). Bins are
half-open intervals between `edges` (default 1e-7, 1e-6, 1e-5, 1e-4: "<1/10M" to ">=1/10k"); an
id seen exactly at an edge belongs to the more frequent bin, ids never seen in training to the
rarest. Every bin is reported, also when it holds no target token.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from megatron_ext._paths import atomic_write
from megatron_ext.data.fingerprint import check_dataset_tokenizers
from megatron_ext.data.indexed import check_dataset, counts_path, get_idx_path
from megatron_ext.evaluation.outputs import (
    EvaluationError,
    format_markdown_table,
    pyplot,
    save_figure,
    write_csv,
    write_json,
)

__all__ = [
    "DEFAULT_EDGES",
    "FrequencyBins",
    "FrequencyStats",
    "bin_labels",
    "compare_runs",
    "training_counts",
    "write_frequency_report",
]

DEFAULT_EDGES = (1e-7, 1e-6, 1e-5, 1e-4)


def _one_in(edge: float) -> str:
    n = 1.0 / edge
    for value, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, "")):
        scaled = n / value
        if scaled >= 1 and abs(scaled - round(scaled)) < 1e-6 * scaled:
            return f"1/{round(scaled)}{suffix}"
    return f"{edge:g}"


def bin_labels(edges: Sequence[float]) -> list[str]:
    """Readable names of the len(edges)+1 bins, rarest first ("<1/10M", "1/10M-1/1M", ...)."""
    names = [_one_in(e) for e in edges]
    labels = [f"<{names[0]}"]
    labels += [f"{a}-{b}" for a, b in zip(names[:-1], names[1:])]
    labels.append(f">={names[-1]}")
    return labels


def training_counts(
    prefixes: Sequence[str], vocab_size: int, tokenizer: Optional[dict] = None
) -> np.ndarray:
    """Summed token counts (int64 [vocab_size]) of the datasets `prefixes`, each checked
    against `tokenizer` (a record; None: the vocabulary size only). EvaluationError: a missing,
    unreadable or mis-sized counts file; DataError / TokenizerMismatchError from the dataset."""
    total: Optional[np.ndarray] = None
    for prefix in prefixes:
        path = counts_path(prefix)
        if not os.path.isfile(path):
            made = os.path.isfile(get_idx_path(prefix))
            raise EvaluationError(
                f"token counts {path} not found (this project's tools/preprocess_data.py writes "
                "them, Megatron-LM's does not); "
                + (
                    f"write them with: python tools/count_tokens.py --data-path {prefix} "
                    "<the run's tokenizer flags>"
                    if made
                    else "pass the training data prefixes with --counts-prefix"
                )
            )
        if os.path.isfile(get_idx_path(prefix)):
            check_dataset(prefix)  # counts of a damaged dataset are not trusted either
        try:
            counts = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as error:
            raise EvaluationError(
                f"{path} is not a token-counts file ({error}); re-run tools/preprocess_data.py"
            ) from None
        if counts.ndim != 1 or len(counts) != vocab_size:
            raise EvaluationError(
                f"{path} counts {counts.shape[0] if counts.ndim else 0} ids but the run's "
                f"tokenizer has {vocab_size}: it belongs to another tokenizer; give the "
                "counts of the run's training data"
            )
        total = np.array(counts, dtype=np.int64) if total is None else total + counts
    if total is None:
        raise EvaluationError("no training datasets to count tokens from (--counts-prefix)")
    check_dataset_tokenizers(
        prefixes,
        tokenizer,
        against="the run's tokenizer",
        fix="give the counts of the data the run was trained on with --counts-prefix",
    )
    if total.sum() == 0:
        raise EvaluationError(f"{counts_path(prefixes[0])} holds no tokens")
    return total


class FrequencyBins:
    """Maps token ids to frequency bins of `counts` (int64 [V]) between `edges` (increasing,
    in (0, 1)); a `TokenConsumer` accumulating per-bin loss."""

    def __init__(self, counts: np.ndarray, edges: Sequence[float] = DEFAULT_EDGES) -> None:
        edges = [float(e) for e in edges]
        if not edges or any(not 0 < e < 1 for e in edges) or edges != sorted(set(edges)):
            raise EvaluationError(
                f"frequency bin edges must be increasing values in (0, 1), got {edges}"
            )
        self.edges = edges
        self.labels = bin_labels(edges)
        counts = np.asarray(counts, dtype=np.int64)
        self.frequency = counts / float(counts.sum())
        # side="right": a frequency equal to an edge belongs to the bin above it.
        self.bin_of_id = np.searchsorted(np.asarray(edges), self.frequency, side="right")
        n = len(self.labels)
        self.stats = FrequencyStats(self.labels, edges, np.zeros(n, np.int64), np.zeros(n))

    def bins(self, ids: np.ndarray) -> np.ndarray:
        """Bin index (0 = rarest) of each id."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self.bin_of_id)):
            raise EvaluationError(
                f"target id {int(ids.max())} is outside the counts' vocabulary of "
                f"{len(self.bin_of_id)} ids: the counts belong to another tokenizer"
            )
        return self.bin_of_id[ids]

    def update(self, targets: np.ndarray, losses: np.ndarray) -> None:
        """Add each target's loss to its frequency bin; targets: [n] ids, losses: [n] nats."""
        b = self.bins(targets)
        n = len(self.labels)
        self.stats.tokens += np.bincount(b, minlength=n).astype(np.int64)
        self.stats.loss_sum += np.bincount(b, weights=losses, minlength=n)


def _mean(tokens: int, loss_sum: float) -> dict:
    """Mean loss and perplexity of `tokens` targets (NaN without any)."""
    loss = loss_sum / tokens if tokens else float("nan")
    return {"loss": loss, "perplexity": math.exp(loss) if tokens else float("nan")}


@dataclass
class FrequencyStats:
    """Per-bin target count (int64 [bins]) and loss sum (float64 [bins]) of one run."""

    labels: list[str]
    edges: list[float]
    tokens: np.ndarray
    loss_sum: np.ndarray

    def rows(self) -> list[dict]:
        """One dict per bin: tokens, share, loss, perplexity (NaN loss for an empty bin)."""
        total = int(self.tokens.sum())
        rows = []
        for label, n, loss_sum in zip(self.labels, self.tokens.tolist(), self.loss_sum.tolist()):
            share = n / total if total else float("nan")
            rows.append({"bin": label, "tokens": n, "share": share, **_mean(n, loss_sum)})
        return rows

    def overall(self) -> dict:
        """Token count, mean loss and perplexity over all bins (NaN loss without tokens)."""
        n = int(self.tokens.sum())
        return {"tokens": n, **_mean(n, float(self.loss_sum.sum()))}


def relative_change(value: float, baseline: float) -> float:
    """(value - baseline) / baseline; NaN when either is missing."""
    if not (math.isfinite(value) and math.isfinite(baseline)) or baseline == 0:
        return float("nan")
    return value / baseline - 1.0


def compare_runs(results: dict[str, FrequencyStats], baseline: Optional[str]) -> list[dict]:
    """Rows (bin x run, then "all" x run) with the relative perplexity change vs `baseline`."""
    if baseline is not None and baseline not in results:
        raise EvaluationError(f"--baseline {baseline} is not one of the runs {list(results)}")
    rows = []
    per_run = {
        name: stats.rows() + [dict(bin="all", share=1.0, **stats.overall())]
        for name, stats in results.items()
    }
    for i in range(len(next(iter(per_run.values())))):
        for name, stats_rows in per_run.items():
            row = dict(stats_rows[i], run=name)
            if baseline is not None:
                row["ppl_change_vs_baseline"] = relative_change(
                    row["perplexity"], per_run[baseline][i]["perplexity"]
                )
            rows.append(row)
    return rows


_FORMATS = {"share": ".2%", "loss": ".4f", "perplexity": ".2f", "ppl_change_vs_baseline": "+.1%"}


def _fmt(value: float, spec: str) -> str:
    return "empty" if not math.isfinite(value) else format(value, spec)


def write_frequency_report(
    results: dict[str, FrequencyStats], baseline: Optional[str], output_dir: str
) -> dict[str, str]:
    """frequency.md / .csv / .json and frequency.png (one bar group per bin, one bar per run,
    log-scale perplexity) in `output_dir`; returns the paths."""
    rows = compare_runs(results, baseline)
    keys = ["bin", "run", "tokens", "share", "loss", "perplexity"]
    header = list(keys)
    if baseline is not None:
        keys.append("ppl_change_vs_baseline")
        header.append(f"ppl change vs {baseline}")
    cells = [[_fmt(r[k], _FORMATS[k]) if k in _FORMATS else r[k] for k in keys] for r in rows]
    paths = {}
    paths["md"] = atomic_write(
        os.path.join(output_dir, "frequency.md"), format_markdown_table(header, cells)
    )
    paths["csv"] = write_csv(
        os.path.join(output_dir, "frequency.csv"), keys, [[r[k] for k in keys] for r in rows]
    )
    first = next(iter(results.values()))
    paths["json"] = write_json(
        os.path.join(output_dir, "frequency.json"),
        {"edges": first.edges, "bins": first.labels, "baseline": baseline, "rows": rows},
    )
    paths["png"] = _plot(results, baseline, os.path.join(output_dir, "frequency.png"))
    return paths


def _plot(results: dict[str, FrequencyStats], baseline: Optional[str], path: str) -> str:
    plt = pyplot()
    names = list(results)
    labels = next(iter(results.values())).labels
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 2, 4.2))
    x = np.arange(len(labels))
    for j, name in enumerate(names):
        ppl = [r["perplexity"] for r in results[name].rows()]
        heights = [p if math.isfinite(p) else float("nan") for p in ppl]  # empty: no bar
        bars = ax.bar(x + (j - (len(names) - 1) / 2) * width, heights, width, label=name)
        if baseline is not None and name != baseline:
            base = [r["perplexity"] for r in results[baseline].rows()]
            for bar, p, q in zip(bars, ppl, base):
                change = relative_change(p, q)
                if math.isfinite(change):
                    top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
                    ax.annotate(f"{change:+.0%}", top, ha="center", va="bottom", fontsize=7)
    counts = next(iter(results.values())).tokens
    ax.set_xticks(x, [f"{lab}\n({int(n)} tok)" for lab, n in zip(labels, counts)], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(bottom=1.0)  # bars from perplexity 1: their log-height is the loss
    ax.set(
        xlabel="training-data frequency of the target token",
        ylabel="perplexity (log scale)",
        title="Frequency-stratified perplexity",
    )
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend()
    return save_figure(fig, path)
