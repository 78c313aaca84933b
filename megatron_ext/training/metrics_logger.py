"""Where a run's numbers go: the Megatron-style iteration line, TensorBoard, W&B, --log-jsonl
records, evaluation lines and the loss-curve PNG at the end.

`MetricsLogger` is rank 0's sink (every method is a no-op elsewhere, except `Timers`, which
all ranks keep for --timing-log-level). It reads nothing from the engine: the loop hands it a
`StepResult` and the run's counters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

from megatron_ext._paths import atomic_open
from megatron_ext.config.run import RunConfig
from megatron_ext.training.engine import StepResult
from megatron_ext.training.metrics import format_train_line, peak_tflops

logger = logging.getLogger(__name__)

__all__ = ["MetricsLogger", "Timers", "truncate_jsonl"]


class Timers:
    """--timing-log-level: wall time per named part of the iteration, summed until the next log
    line. Level 1 times the iteration's consecutive parts (`mark`); level 2 also the spans
    inside them (`span`, e.g. LEV's forward and backward inside forward-backward)."""

    def __init__(self, level: int = 0) -> None:
        self.enabled = level > 0
        self.detailed = level > 1  # whether `span` times
        self.totals: dict[str, float] = {}
        self.spans: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: Optional[str] = None) -> None:
        """Add the time since the previous mark to `name` (None: only restart the clock)."""
        if not self.enabled:
            return
        now = self.now()
        if name is not None:
            self.totals[name] = self.totals.get(name, 0.0) + now - self._last
        self._last = now

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """At level 2, add the wall time of the block to `name` (a part of the enclosing
        mark's time, not a mark: the clock of `mark` is left alone)."""
        if not self.detailed:
            yield
            return
        start = self.now()
        try:
            yield
        finally:
            self.add(name, self.now() - start)

    def add(self, name: str, seconds: float) -> None:
        """At level 2, add `seconds` (measured with `now`) to the span `name`."""
        if self.detailed:
            self.spans[name] = self.spans.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The totals since the previous call (the marks' in order, then the spans'), cleared."""
        out = {**self.totals, **self.spans}
        self.totals, self.spans = {}, {}
        return out

    @staticmethod
    def now() -> float:
        """perf_counter after the device's queued work (what the timers measure with)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()


def truncate_jsonl(path: str, iteration: int) -> None:
    """--log-jsonl keeps one record per iteration: a run resumed at `iteration` drops the
    records after it (those iterations are trained again), and a torn last line."""
    if not os.path.isfile(path):
        return
    with open(path) as handle:
        lines = handle.readlines()
    keep = []
    for line in lines:
        try:
            if json.loads(line)["iteration"] <= iteration:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    if len(keep) == len(lines):
        return
    with atomic_open(path) as handle:
        handle.writelines(keep)
    logger.info(
        "--log-jsonl %s: dropped %d record(s) after iteration %d",
        path,
        len(lines) - len(keep),
        iteration,
    )


class MetricsLogger:
    """The iteration line, TensorBoard/W&B scalars and --log-jsonl records of one run.

    Only rank 0 writes. `flops_per_batch`: model FLOPs of one iteration at the full
    --global-batch-size (None: no TFLOP/s); `wandb`: the W&B run (--wandb-project). The
    TensorBoard event file is created with the first value logged (text entries wait for it),
    so a launch that fails before its first iteration leaves no empty event file or directory.
    """

    def __init__(self, cfg: RunConfig, flops_per_batch: Optional[float], wandb=None) -> None:
        self.cfg, self.flops_per_batch, self.wandb = cfg, flops_per_batch, wandb
        self.is_rank0, self.world_size = dist.get_rank() == 0, dist.get_world_size()
        self.peak = peak_tflops(cfg.log.peak_tflops)  # per device (None: no MFU)
        self.writer: Optional[SummaryWriter] = None
        self.history: dict[str, list[tuple[int, float]]] = {}  # tag -> (step, value), for the PNG
        self._pending_text: list[tuple[str, str]] = []
        self.extras: dict[str, float] = {}  # logged extras of the latest logged iteration
        self._losses: list[float] = []  # of the iterations since the last log line
        self._grad_norm: Optional[float] = None  # the latest
        self._interval_start = time.time()
        self._first_record = 1  # the first iteration this run logs (`start` sets it)
        # skipped / non-finite iterations since the last log line (as Megatron-LM counts them)
        self._skipped = self._nonfinite = 0

    def start(self, iteration: int) -> None:
        """Before the first iteration: drop --log-jsonl records past `iteration`, start the
        interval clock."""
        if self.is_rank0 and self.cfg.log.log_jsonl:
            truncate_jsonl(self.cfg.log.log_jsonl, iteration)
        self._first_record = iteration + 1
        self._interval_start = time.time()

    def _open(self) -> Optional[SummaryWriter]:
        """The TensorBoard writer, created (with the text entries logged so far) on first use."""
        if self.writer is None and self.is_rank0 and self.cfg.log.tensorboard_dir:
            self.writer = SummaryWriter(
                log_dir=self.cfg.log.tensorboard_dir, max_queue=self.cfg.log.tensorboard_queue_size
            )
            for tag, text in self._pending_text:
                self.writer.add_text(tag, text)
            self._pending_text = []
        return self.writer

    def scalar(self, tag: str, value: Optional[float], step: int) -> None:
        """Record a finite scalar in the history, TensorBoard and W&B (rank 0)."""
        if not self.is_rank0 or value is None or not math.isfinite(value):
            return
        self.history.setdefault(tag, []).append((step, float(value)))
        if self._open() is not None:
            self.writer.add_scalar(tag, value, step)
        if self.wandb is not None and " vs " not in tag:  # W&B keys share one step axis
            self.wandb.log({tag: value}, step=step)

    def text(self, tag: str, text: str) -> None:
        """A TensorBoard text entry (rank 0), written with the first value or at a completed
        close."""
        if self.writer is not None:
            self.writer.add_text(tag, text)
        elif self.is_rank0 and self.cfg.log.tensorboard_dir:
            self._pending_text.append((tag, text))

    def iteration(
        self,
        result: StepResult,
        state,
        *,
        global_batch: int,
        seconds: float,
        cpu_seconds: float,
        loss_scale: Optional[float],
        elapsed_since_start: float,
        timers: Timers,
    ) -> None:
        """Record one finished iteration (`state` already counts it): TensorBoard every
        --tensorboard-log-interval, the jsonl record every iteration, the iteration line (with
        the `timers` taken) every --log-interval."""
        it = state.iteration
        self._losses.append(result.loss)
        self._grad_norm = result.grad_norm
        self._skipped += int(result.skipped)
        self._nonfinite += int(result.nonfinite)
        if it % self.cfg.log.tensorboard_log_interval == 0:
            self._tensorboard(result, state, global_batch, loss_scale)
        if self.cfg.log.log_jsonl and self.is_rank0:
            record = dict(
                iteration=it,
                consumed_samples=state.consumed_train_samples,
                loss=result.loss,
                grad_norm=result.grad_norm,
                lr=result.lr,
                stepped=result.stepped,
                seconds=seconds,
                cpu_seconds=cpu_seconds,  # this process's CPU time: robust on a shared machine
            )
            path = self.cfg.log.log_jsonl
            if it == self._first_record:  # its directory is made by the first write
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        if it % self.cfg.log.log_interval == 0:
            self._line(state, global_batch, result.lr, loss_scale, elapsed_since_start, timers)

    def _tensorboard(self, result: StepResult, state, global_batch: int, loss_scale) -> None:
        log, it = self.cfg.log, state.iteration
        self.scalar("lm loss", result.loss, it)
        self.scalar("lm loss vs samples", result.loss, state.consumed_train_samples)
        if math.isfinite(result.loss):
            self.scalar("lm loss ppl", math.exp(min(20.0, result.loss)), it)
        self.scalar("learning-rate", result.lr, it)
        self.scalar("grad-norm", result.grad_norm, it)
        if loss_scale is not None and log.log_loss_scale_to_tensorboard:
            self.scalar("loss-scale", loss_scale, it)
        tokens = state.consumed_train_samples * self.cfg.model.seq_length
        self.scalar("lm loss vs tokens", result.loss, tokens)
        self.scalar("batch-size", global_batch, it)
        if log.log_world_size_to_tensorboard:
            self.scalar("world-size", self.world_size, it)
        for key, value in self.extras.items():
            self.scalar(key, value, it)

    def _line(self, state, global_batch, lr, loss_scale, elapsed_since_start, timers) -> None:
        """The iteration line over the iterations since the previous one, then restart the
        interval."""
        timers = timers.take()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        iters = max(len(self._losses), 1)
        elapsed = (time.time() - self._interval_start) / iters
        b = self.cfg.batch
        tflops = None
        if self.flops_per_batch:
            flops = self.flops_per_batch * global_batch / b.global_batch_size
            tflops = flops / elapsed / self.world_size / 1e12
        tokens = global_batch * self.cfg.model.seq_length / elapsed
        finite = [x for x in self._losses if math.isfinite(x)]
        show_tflops = tflops is not None and (
            torch.cuda.is_available() or self.cfg.log.log_throughput
        )
        values = dict(
            iteration=state.iteration,
            train_iters=b.train_iters,
            consumed_samples=state.consumed_train_samples,
            iteration_ms=1000 * elapsed,
            tflops=tflops if show_tflops else None,
            mfu=tflops / self.peak if (self.peak and tflops is not None) else None,
            tokens_per_sec=tokens,
            lr=lr,
            global_batch_size=global_batch,
            elapsed=elapsed_since_start,
            eta=elapsed * (b.train_iters - state.iteration),
            consumed_tokens=state.consumed_train_samples * self.cfg.model.seq_length,
            extras=self.extras,
            loss=sum(finite) / len(finite) if finite else float("nan"),
            loss_scale=loss_scale,
            grad_norm=self._grad_norm,
            skipped=self._skipped,
            nonfinite=self._nonfinite,
        )
        if self.is_rank0:
            logger.info(format_train_line(values))
            it = state.iteration
            if timers:
                logger.info(
                    "    time per iteration (ms): %s",
                    " | ".join(f"{k}: {1000 * v / iters:.1f}" for k, v in timers.items()),
                )
                if self.cfg.log.log_timers_to_tensorboard:
                    for key, value in timers.items():
                        self.scalar(f"timers/{key}", value / iters, it)
            self.scalar("iteration-time", elapsed, it)
            self.scalar("throughput/tokens per second", tokens, it)
            if tflops is not None:
                self.scalar("throughput/TFLOP per second per GPU", tflops, it)
            if values["mfu"] is not None:
                self.scalar("throughput/MFU", values["mfu"], it)
            if self.writer is not None:
                self.writer.flush()
        self._interval_start = time.time()
        self._losses, self._grad_norm = [], None
        self._skipped = self._nonfinite = 0

    def evaluation(self, loss: Optional[float], name: str, state) -> None:
        """The boxed validation/test line and its scalars (nothing when `loss` is None)."""
        if loss is None or not self.is_rank0:
            return
        ppl = math.exp(min(20.0, loss))
        it = state.iteration
        line = (
            f" {name} loss at iteration {it} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
        )
        bar = "-" * len(line)
        logger.info("%s\n%s\n%s", bar, line, bar)
        tag = "lm loss validation" if name == "validation" else f"lm loss {name}"
        self.scalar(tag, loss, it)
        self.scalar(f"{tag} ppl", ppl, it)
        self.scalar(f"{tag} vs samples", loss, state.consumed_train_samples)

    def close(self, completed: bool = True) -> None:
        """Close TensorBoard (a run that did not complete and logged no value writes no event
        file); with --loss-curve write loss_curve.png beside the run's logs (TensorBoard events,
        else the --log-jsonl file; never into --save, which holds checkpoints only)."""
        log, curve_dir = self.cfg.log, self.cfg.log.tensorboard_dir or None
        if not curve_dir and log.log_jsonl:
            curve_dir = os.path.dirname(os.path.abspath(log.log_jsonl))
        if self.is_rank0 and log.loss_curve:
            curve = self._plot(curve_dir) if curve_dir and self.history.get("lm loss") else None
            if curve:
                logger.info("loss curve: %s", curve)
            elif curve_dir is None and completed:
                logger.info(
                    "loss curve: not written (it goes beside --tensorboard-dir or --log-jsonl, "
                    "neither given; --no-loss-curve turns this line off)"
                )
        if completed and self._pending_text:
            self._open()
        self._pending_text = []
        if self.writer is not None:
            self.writer.close()
            self.writer = None

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
