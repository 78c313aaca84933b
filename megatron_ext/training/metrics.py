"""What a run reports: Megatron-style log lines, TensorBoard scalars, model FLOPs and MFU,
the run's provenance (git hash, package versions) and a loss-curve PNG at the end."""

from __future__ import annotations

import importlib.metadata
import logging
import math
import os
import platform
import subprocess
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.utils.tensorboard import SummaryWriter

from megatron_ext.models.memory import flops_per_token

logger = logging.getLogger(__name__)

__all__ = [
    "flops_per_iteration",
    "peak_tflops",
    "run_info",
    "format_train_line",
    "Reporter",
]

# Dense BF16 tensor-core peaks (TFLOP/s) by GPU name fragment; --peak-tflops overrides.
_PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A10G": 125.0,
    "L40S": 362.0,
    "L4": 121.0,
    "V100": 125.0,
}


def flops_per_iteration(model_config, global_batch_size: int) -> float:
    """Model FLOPs of one training iteration of `global_batch_size` sequences: the one formula
    of the project, `models.memory.flops_per_token` (every GEMM of the SwiGLU/GQA backbone,
    full attention scores, the output head and the input embedding's own FLOPs: LEV's
    generator, the MLP arms), times the iteration's tokens. `tools/gpu_check.py` computes its
    MFU from the same function."""
    return float(flops_per_token(model_config)) * global_batch_size * model_config.seq_length


def peak_tflops(override: Optional[float] = None) -> Optional[float]:
    """Per-device dense BF16 peak, or None on CPU / unknown GPUs."""
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for fragment, value in _PEAK_BF16_TFLOPS.items():
        if fragment in name:
            return value
    return None


def _git_hash() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        )
        if out.returncode == 0:
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def run_info() -> dict[str, str]:
    """Provenance logged at the start of every run."""
    info = {"git": _git_hash(), "python": platform.python_version(), "host": platform.node()}
    for package in (
        "torch",
        "megatron-core",
        "numpy",
        "transformer-engine",
        "megatron-ext-leviathan",
    ):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return info


def _hms(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def format_train_line(values: dict) -> str:
    """Megatron-LM's training log line (fields it does not know are appended)."""
    parts = [
        f" iteration {values['iteration']:8d}/{values['train_iters']:8d}",
        f"consumed samples: {values['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {values['iteration_ms']:.1f}",
    ]
    # Megatron-LM's fields keep their order (log parsers rely on it); ours follow.
    if values.get("consumed_tokens") is not None:
        parts.append(f"consumed tokens: {values['consumed_tokens']:14d}")
    if values.get("elapsed") is not None:
        parts.append(f"elapsed: {_hms(values['elapsed'])}")
    if values.get("eta") is not None:
        parts.append(f"ETA: {_hms(values['eta'])}")
    if values.get("tflops") is not None:
        parts.append(f"throughput per GPU (TFLOP/s/GPU): {values['tflops']:.1f}")
    if values.get("mfu") is not None:
        parts.append(f"MFU: {100 * values['mfu']:.1f}%")
    parts += [
        f"tokens per second: {values['tokens_per_sec']:.0f}",
        f"learning rate: {values['lr']:.6E}",
        f"global batch size: {values['global_batch_size']:5d}",
    ]
    if values.get("loss") is not None:
        parts.append(f"lm loss: {values['loss']:.6E}")
    if values.get("loss_scale") is not None:
        parts.append(f"loss scale: {values['loss_scale']:.1f}")
    if values.get("grad_norm") is not None:
        parts.append(f"grad norm: {values['grad_norm']:.3f}")
    extras = values.get("extras") or {}
    if "params-norm" in extras:
        parts.append(f"params norm: {extras['params-norm']:.3f}")
    if "num-zeros" in extras:
        parts.append(f"num zeros: {int(extras['num-zeros'])}")
    parts += [
        f"number of skipped iterations: {values['skipped']:3d}",
        f"number of nan iterations: {values['nonfinite']:3d}",
    ]
    return " | ".join(parts) + " |"


@dataclass
class Reporter:
    """Rank 0's TensorBoard writer and the in-memory history for the loss-curve PNG.

    The event file is created with the first value logged (text entries wait for it), so a
    launch that fails before its first iteration leaves no empty event file or directory.
    """

    tensorboard_dir: Optional[str] = None
    queue_size: int = 1000
    enabled: bool = True
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.writer = None
        self.wandb = None
        """A wandb run (--wandb-project), set by the loop on rank 0."""
        self._pending_text: list[tuple[str, str]] = []

    def _open(self):
        """The writer, created (with the text entries logged so far) on first use."""
        if self.writer is None and self.enabled and self.tensorboard_dir:
            self.writer = SummaryWriter(log_dir=self.tensorboard_dir, max_queue=self.queue_size)
            for tag, text in self._pending_text:
                self.writer.add_text(tag, text)
            self._pending_text = []
        return self.writer

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Record a finite scalar in the history and TensorBoard (ignored when disabled)."""
        if not self.enabled or value is None or not math.isfinite(value):
            return
        self.history.setdefault(tag, []).append((step, float(value)))
        if self._open() is not None:
            self.writer.add_scalar(tag, value, step)
        if self.wandb is not None and " vs " not in tag:  # W&B keys share one step axis
            self.wandb.log({tag: value}, step=step)

    def text(self, tag: str, text: str) -> None:
        """A TensorBoard text entry, written with the first value (or at a completed close)."""
        if self.writer is not None:
            self.writer.add_text(tag, text)
        elif self.enabled and self.tensorboard_dir:
            self._pending_text.append((tag, text))

    def flush(self) -> None:
        """Flush pending TensorBoard events to disk."""
        if self.writer is not None:
            self.writer.flush()

    def close(self, curve_dir: Optional[str] = None, completed: bool = True) -> Optional[str]:
        """Close the writer; write loss_curve.png into `curve_dir` (if any) and return it.

        A run that `completed` without logging a value still gets its text entries written;
        one that failed before its first value writes no event file.
        """
        path = None
        if self.enabled and curve_dir and self.history.get("lm loss"):
            path = self._plot(curve_dir)
        if completed and self._pending_text:
            self._open()
        self._pending_text = []
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        return path

    def _plot(self, directory: str) -> Optional[str]:
        try:
            # deferred: matplotlib is slow to import and only the plots need it
            import matplotlib.pyplot as plt
        except ImportError:  # pragma: no cover
            return None
        plt.switch_backend("Agg")
        os.makedirs(directory, exist_ok=True)
        fig, ax = plt.subplots(figsize=(7, 4))
        for tag, label in (("lm loss", "train"), ("lm loss validation", "validation")):
            points = self.history.get(tag)
            if points:
                ax.plot(*zip(*points), label=label, marker="." if len(points) < 50 else None)
        ax.set_xlabel("iteration")
        ax.set_ylabel("lm loss")
        ax.grid(alpha=0.3)
        ax.legend()
        path = os.path.join(directory, "loss_curve.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
