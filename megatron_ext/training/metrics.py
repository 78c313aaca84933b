"""What a run reports, computed: the Megatron-style iteration line, model FLOPs and the peak for
MFU, the run's provenance (git hash, package versions). `metrics_logger` writes them."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Optional

import torch

import megatron_ext
from megatron_ext.models.memory import flops_per_token

__all__ = ["flops_per_iteration", "peak_tflops", "run_info", "format_train_line"]

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
    """Model FLOPs of one training iteration of `global_batch_size` sequences: the project's one
    formula, `models.memory.flops_per_token`, times the iteration's tokens."""
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


def run_info() -> dict[str, str]:
    """Provenance logged at the start of every run."""
    info = {
        "git": megatron_ext.git_revision(),
        "python": platform.python_version(),
        "host": platform.node(),
    }
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
