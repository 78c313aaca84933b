"""Loss curves and sample efficiency from the logs of several runs.

Sources: a TensorBoard directory (the training loop's `lm loss`, `lm loss validation` and
their `... vs samples` tags) or a `--log-jsonl` file (training loss only: the loop writes
validation losses to TensorBoard). x is in tokens: consumed samples times the sequence length.

Sample efficiency (the paper's "2.1x fewer tokens"): the tokens run A needs to reach run B's
final validation loss, by linear interpolation between A's evaluation points, and the ratio
B's tokens / A's tokens.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from megatron_ext.evaluation.outputs import EvaluationError, pyplot, save_figure

__all__ = [
    "Curve",
    "RunCurves",
    "SampleEfficiency",
    "read_run_curves",
    "sample_efficiency",
    "smooth",
    "loss_difference",
    "plot_curves",
]


@dataclass
class Curve:
    """Loss against tokens seen, in increasing token order."""

    tokens: np.ndarray
    loss: np.ndarray


@dataclass
class RunCurves:
    """Loss curves of one run (None where the source has none) and the path they were read from."""

    name: str
    train: Optional[Curve] = None
    validation: Optional[Curve] = None
    source: str = ""
    extra: dict = field(default_factory=dict)


def _curve(points: Sequence[tuple[float, float]], seq_length: int) -> Optional[Curve]:
    if not points:
        return None
    points = sorted({int(x): float(y) for x, y in points}.items())  # last value per step wins
    x = np.array([p[0] for p in points], dtype=np.float64) * seq_length
    return Curve(x, np.array([p[1] for p in points], dtype=np.float64))


def _event_files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "**", "events.out.tfevents.*"), recursive=True))


def _accumulators(paths: Iterable[str], guidance: dict) -> Iterator:
    """A loaded TensorBoard `EventAccumulator` of each of `paths` (event files or directories)."""
    # deferred: keeps tensorboard (slow) out of this module's import
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # its reader logs "Directory watcher advancing from ... to ..." per event file at INFO
    logging.getLogger("tensorboard").setLevel(logging.WARNING)
    for events in paths:
        acc = EventAccumulator(events, size_guidance=guidance)
        acc.Reload()
        yield acc


def _read_tensorboard(path: str) -> dict[str, list[tuple[float, float]]]:
    files = _event_files(path)
    if not files:
        raise EvaluationError(
            f"{path} holds no TensorBoard event files (train with --tensorboard-dir {path})"
        )
    out: dict[str, list[tuple[float, float]]] = {}
    for acc in _accumulators(sorted({os.path.dirname(p) for p in files}), {"scalars": 0}):
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def recorded_seq_length(path: str) -> Optional[int]:
    """The --seq-length a run's TensorBoard directory records (the run's flags, as its
    args.json, in the "config" text entry), or None (a jsonl file, a run without the entry)."""
    if not os.path.isdir(path):
        return None
    for acc in _accumulators(_event_files(path), {"tensors": 0}):
        if "config/text_summary" not in acc.Tags().get("tensors", []):
            continue
        for event in acc.Tensors("config/text_summary"):
            for text in event.tensor_proto.string_val:
                found = re.search(r"^\s*seq_length: (\d+)\s*$", text.decode(), re.MULTILINE)
                if found:
                    return int(found.group(1))
    return None


def read_run_curves(name: str, path: str, seq_length: Optional[int] = None) -> RunCurves:
    """Curves of one run from a TensorBoard directory or a --log-jsonl file, in tokens
    (`seq_length` tokens a sample; default: the run's own, which a TensorBoard directory
    records)."""
    if seq_length is None:
        seq_length = recorded_seq_length(path)
        if seq_length is None:
            raise EvaluationError(
                f"{path} does not record the run's --seq-length (a --log-jsonl file, or "
                "TensorBoard events without the run's config); pass --seq-length"
            )
    if seq_length < 1:
        raise EvaluationError(f"--seq-length must be >= 1, got {seq_length}")
    if os.path.isdir(path):
        tags = _read_tensorboard(path)
        train = _curve(tags.get("lm loss vs samples", []), seq_length)
        valid = _curve(tags.get("lm loss validation vs samples", []), seq_length)
    elif os.path.isfile(path):
        points = []
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    points.append((record["consumed_samples"], record["loss"]))
                except (ValueError, KeyError, TypeError):
                    raise EvaluationError(
                        f"{path}:{number} is not a --log-jsonl record (needs consumed_samples "
                        "and loss)"
                    ) from None
        train, valid = _curve(points, seq_length), None
    else:
        raise EvaluationError(f"{path} does not exist (give a TensorBoard dir or a jsonl file)")
    if train is None and valid is None:
        raise EvaluationError(f"{path} holds no loss values")
    return RunCurves(name, train, valid, source=path)


def smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's debiased exponential moving average (weight 0 = no smoothing)."""
    if not 0 <= weight < 1:
        raise EvaluationError(f"--smoothing must be in [0, 1), got {weight}")
    out = np.empty_like(values, dtype=np.float64)
    last = 0.0
    for i, v in enumerate(values):
        last = last * weight + (1 - weight) * v
        out[i] = last / (1 - weight ** (i + 1))
    return out


@dataclass
class SampleEfficiency:
    """Tokens `run` needs to reach `reference`'s final validation loss, against the tokens
    `reference` took (see `sample_efficiency`)."""

    run: str
    reference: str
    target_loss: float
    """The reference's final validation loss."""
    reference_tokens: float
    tokens: Optional[float]
    """Tokens `run` needs to reach target_loss (None: it never does)."""
    best_loss: float
    best_tokens: float
    at_first_point: bool = False
    """`run` was already below target_loss at its first evaluation (tokens is an upper bound)."""

    @property
    def ratio(self) -> Optional[float]:
        """reference_tokens / tokens: how many times fewer tokens `run` needs (None: never)."""
        return None if self.tokens is None else self.reference_tokens / self.tokens

    def message(self) -> str:
        """One-line summary of the comparison for logs and reports."""
        if self.tokens is None:
            return (
                f"{self.run} never reaches {self.reference}'s final validation loss "
                f"{self.target_loss:.4f} (its best is {self.best_loss:.4f} at "
                f"{self.best_tokens:.4g} tokens)"
            )
        bound = " (already at its first evaluation: an upper bound)" if self.at_first_point else ""
        return (
            f"{self.run} reaches {self.reference}'s final validation loss {self.target_loss:.4f} "
            f"after {self.tokens:.4g} tokens{bound}; {self.reference} took "
            f"{self.reference_tokens:.4g}: {self.ratio:.2f}x fewer tokens"
        )

    def as_dict(self) -> dict:
        """The fields plus `ratio` and `message` as a JSON-ready dict."""
        return {
            "run": self.run,
            "reference": self.reference,
            "target_loss": self.target_loss,
            "reference_tokens": self.reference_tokens,
            "tokens": self.tokens,
            "ratio": self.ratio,
            "best_loss": self.best_loss,
            "best_tokens": self.best_tokens,
            "at_first_point": self.at_first_point,
            "message": self.message(),
        }


def tokens_to_reach(curve: Curve, target: float) -> tuple[Optional[float], bool]:
    """First token count at which the piecewise-linear `curve` is <= target; whether that was
    already its first point."""
    x, y = curve.tokens, curve.loss
    if y[0] <= target:
        return float(x[0]), True
    for i in range(1, len(x)):
        if y[i] <= target:
            frac = (y[i - 1] - target) / (y[i - 1] - y[i])
            return float(x[i - 1] + frac * (x[i] - x[i - 1])), False
    return None, False


def sample_efficiency(run: RunCurves, reference: RunCurves) -> SampleEfficiency:
    """How many tokens `run` needs to reach `reference`'s final validation loss."""
    for r in (run, reference):
        if r.validation is None:
            raise EvaluationError(
                f"{r.source} has no validation losses; sample efficiency needs the TensorBoard "
                "directory of a run trained with --eval-interval and --tensorboard-dir"
            )
    target = float(reference.validation.loss[-1])
    tokens, first = tokens_to_reach(run.validation, target)
    best = int(np.argmin(run.validation.loss))
    return SampleEfficiency(
        run=run.name,
        reference=reference.name,
        target_loss=target,
        reference_tokens=float(reference.validation.tokens[-1]),
        tokens=tokens,
        best_loss=float(run.validation.loss[best]),
        best_tokens=float(run.validation.tokens[best]),
        at_first_point=first,
    )


def loss_difference(run: Curve, reference: Curve) -> Optional[Curve]:
    """`run`'s loss minus `reference`'s at `run`'s token counts inside the reference's range
    (the reference linearly interpolated between its points); None where they do not overlap."""
    inside = (run.tokens >= reference.tokens[0]) & (run.tokens <= reference.tokens[-1])
    if not inside.any():
        return None
    tokens = run.tokens[inside]
    return Curve(tokens, run.loss[inside] - np.interp(tokens, reference.tokens, reference.loss))


def plot_curves(
    runs: Sequence[RunCurves],
    path: str,
    smoothing: float = 0.0,
    reference: Optional[str] = None,
) -> list[str]:
    """The loss-curve pictures; the paths written. Up to two runs, or without a `reference`:
    train and validation loss against tokens in `path`; else each run's loss minus the
    reference's in `path` and the absolute curves in `<path stem>_absolute.png`."""
    if reference is None or len(runs) <= 2:
        return [_plot_absolute(runs, path, smoothing)]
    absolute = os.path.splitext(path)[0] + "_absolute.png"
    return [
        _plot_differences(runs, path, smoothing, reference),
        _plot_absolute(runs, absolute, smoothing),
    ]


def _plot_absolute(runs: Sequence[RunCurves], path: str, smoothing: float) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        if run.train is not None:
            ax.plot(
                run.train.tokens,
                smooth(run.train.loss, smoothing),
                color=color,
                label=f"{run.name} train",
                linewidth=1.2,
            )
        if run.validation is not None:
            ax.plot(
                run.validation.tokens,
                run.validation.loss,
                color=color,
                linestyle="--",
                marker="o",
                markersize=3,
                label=f"{run.name} validation",
            )
    ax.set_xlabel("tokens")
    ax.set_ylabel("lm loss (nats)")
    title = "Loss curves" + (f" (train smoothed {smoothing:g})" if smoothing else "")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _plot_differences(
    runs: Sequence[RunCurves], path: str, smoothing: float, reference: str
) -> str:
    """Validation and smoothed train loss of every run minus `reference`'s, against tokens."""
    plt = pyplot()
    base = next(r for r in runs if r.name == reference)
    fig, (valid_ax, train_ax) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    base_train = None
    if base.train is not None:
        base_train = Curve(base.train.tokens, smooth(base.train.loss, smoothing))
    for i, run in enumerate(runs):
        if run is base:
            continue
        color = colors[i % len(colors)]  # each arm keeps its colour of the absolute picture
        if run.validation is not None and base.validation is not None:
            delta = loss_difference(run.validation, base.validation)
            if delta is not None:
                valid_ax.plot(delta.tokens, delta.loss, color=color, marker="o", markersize=3,
                              label=run.name)  # fmt: skip
        if run.train is not None and base_train is not None:
            smoothed = Curve(run.train.tokens, smooth(run.train.loss, smoothing))
            delta = loss_difference(smoothed, base_train)
            if delta is not None:
                train_ax.plot(delta.tokens, delta.loss, color=color, linewidth=1.2, label=run.name)
    trained = f", smoothed {smoothing:g}" if smoothing else ""
    for ax, what in ((valid_ax, "validation loss"), (train_ax, f"train loss{trained}")):
        ax.axhline(0.0, color="black", linewidth=0.8, label=reference)
        ax.set_xlabel("tokens")
        ax.set_ylabel(f"loss minus {reference}'s (nats)")
        ax.set_title(f"{what.capitalize()}: each arm minus {reference} (below 0: better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)
