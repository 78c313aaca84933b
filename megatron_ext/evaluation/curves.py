"""Loss curves and sample efficiency from the logs of several runs: a TensorBoard directory (the
loop's `lm loss` and `lm loss validation` against samples) or a `--log-jsonl` file (training
loss only), against tokens (consumed samples times the sequence length).

Sample efficiency (the paper's "2.1x fewer tokens"): the tokens run A needs to reach run B's
final validation loss (linear interpolation between A's evaluation points), against B's.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

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


def _curve(points: Sequence[tuple[float, float]], seq_length: int) -> Optional[Curve]:
    if not points:
        return None
    points = sorted({int(x): float(y) for x, y in points}.items())  # last value per step wins
    x = np.array([p[0] for p in points], dtype=np.float64) * seq_length
    return Curve(x, np.array([p[1] for p in points], dtype=np.float64))


def _read_tensorboard(path: str) -> tuple[dict[str, list[tuple[float, float]]], Optional[int]]:
    """(tag -> (step, value) scalars, the --seq-length the run's flags record in the "config"
    text entry or None) of the TensorBoard event files under `path`."""
    # deferred: keeps tensorboard (slow) out of this module's import
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(os.path.join(path, "**", "events.out.tfevents.*"), recursive=True)
    if not files:
        raise EvaluationError(
            f"{path} holds no TensorBoard event files (train with --tensorboard-dir {path})"
        )
    # its reader logs "Directory watcher advancing from ... to ..." per event file at INFO
    logging.getLogger("tensorboard").setLevel(logging.WARNING)
    scalars: dict[str, list[tuple[float, float]]] = {}
    seq_length: Optional[int] = None
    for directory in sorted({os.path.dirname(p) for p in files}):
        acc = EventAccumulator(directory, size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        tags = acc.Tags()
        for tag in tags.get("scalars", []):
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
        if "config/text_summary" in tags.get("tensors", []):
            for event in acc.Tensors("config/text_summary"):
                for text in event.tensor_proto.string_val:
                    found = re.search(r"^\s*seq_length: (\d+)\s*$", text.decode(), re.MULTILINE)
                    if found and seq_length is None:
                        seq_length = int(found.group(1))
    return scalars, seq_length


def _read_jsonl(path: str) -> list[tuple[float, float]]:
    """(consumed samples, loss) of each record of a --log-jsonl file."""
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
                    f"{path}:{number} is not a --log-jsonl record (needs consumed_samples and loss)"
                ) from None
    return points


def read_run_curves(name: str, path: str, seq_length: Optional[int] = None) -> RunCurves:
    """Curves of one run from a TensorBoard directory or a --log-jsonl file (training loss
    only), in tokens: `seq_length` tokens a sample (default: the run's own, which a
    TensorBoard directory records)."""
    if seq_length is not None and seq_length < 1:
        raise EvaluationError(f"--seq-length must be >= 1, got {seq_length}")
    if os.path.isdir(path):
        tags, recorded = _read_tensorboard(path)
        train = tags.get("lm loss vs samples", [])
        valid = tags.get("lm loss validation vs samples", [])
    elif os.path.isfile(path):
        train, valid, recorded = _read_jsonl(path), [], None
    else:
        raise EvaluationError(f"{path} does not exist (give a TensorBoard dir or a jsonl file)")
    seq_length = recorded if seq_length is None else seq_length
    if seq_length is None:
        raise EvaluationError(
            f"{path} does not record the run's --seq-length (a --log-jsonl file, or "
            "TensorBoard events without the run's config); pass --seq-length"
        )
    curves = RunCurves(name, _curve(train, seq_length), _curve(valid, seq_length), source=path)
    if curves.train is None and curves.validation is None:
        raise EvaluationError(f"{path} holds no loss values")
    return curves


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
        return {**dataclasses.asdict(self), "ratio": self.ratio, "message": self.message()}


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


def _smoothed_train(run: RunCurves, smoothing: float) -> Optional[Curve]:
    if run.train is None:
        return None
    return Curve(run.train.tokens, smooth(run.train.loss, smoothing))


def _colors(plt) -> Iterator[str]:
    """Matplotlib's colours in turn: each run keeps its colour in every picture."""
    return itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])


def _plot_absolute(runs: Sequence[RunCurves], path: str, smoothing: float) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run, color in zip(runs, _colors(plt)):
        train, valid = _smoothed_train(run, smoothing), run.validation
        if train is not None:
            ax.plot(train.tokens, train.loss, color=color, label=f"{run.name} train", linewidth=1.2)
        if valid is not None:
            label = f"{run.name} validation"
            ax.plot(valid.tokens, valid.loss, "o--", color=color, markersize=3, label=label)
    title = "Loss curves" + (f" (train smoothed {smoothing:g})" if smoothing else "")
    ax.set(xlabel="tokens", ylabel="lm loss (nats)", title=title)
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
    base_train = _smoothed_train(base, smoothing)
    for run, color in zip(runs, _colors(plt)):
        if run is base:
            continue
        for ax, curve, ref, style in (
            (valid_ax, run.validation, base.validation, dict(marker="o", markersize=3)),
            (train_ax, _smoothed_train(run, smoothing), base_train, dict(linewidth=1.2)),
        ):
            delta = None if curve is None or ref is None else loss_difference(curve, ref)
            if delta is not None:
                ax.plot(delta.tokens, delta.loss, color=color, label=run.name, **style)
    trained = f", smoothed {smoothing:g}" if smoothing else ""
    for ax, what in ((valid_ax, "validation loss"), (train_ax, f"train loss{trained}")):
        ax.axhline(0.0, color="black", linewidth=0.8, label=reference)
        title = f"{what.capitalize()}: each arm minus {reference} (below 0: better)"
        ax.set(xlabel="tokens", ylabel=f"loss minus {reference}'s (nats)", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)
