"""What the training loop runs around each iteration for Megatron-LM's feature flags:
`RunExtras` (the batch-size ramp-up's global batch, manual garbage collection, empty-cache
levels, the torch profiler window, Weights & Biases) and `memory_stats`."""

from __future__ import annotations

import gc
import logging
import os
import resource
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

from megatron_ext import cpu_accel

if TYPE_CHECKING:
    from megatron_ext.config.run import LoggingConfig, RunConfig

logger = logging.getLogger(__name__)

__all__ = ["RunExtras", "memory_stats"]


def memory_stats() -> dict[str, float]:
    """Memory in use, in GiB: the CUDA allocator's counters, or this process's RSS on CPU."""
    gib = float(1 << 30)
    if torch.cuda.is_available():
        return {
            "mem-allocated-gigabytes": torch.cuda.memory_allocated() / gib,
            "mem-max-allocated-gigabytes": torch.cuda.max_memory_allocated() / gib,
            "mem-reserved-gigabytes": torch.cuda.memory_reserved() / gib,
        }
    out = {"mem-max-rss-gigabytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)}
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        out["mem-rss-gigabytes"] = pages * os.sysconf("SC_PAGESIZE") / gib
    except (OSError, ValueError, IndexError):
        pass
    return out


class RunExtras:
    """Per-iteration hooks of the feature flags; every rank calls them at the same points."""

    def __init__(self, run: RunConfig, param_bytes: int = 0) -> None:
        """`param_bytes`: this rank's parameter bytes (whether a CPU run keeps its largest
        freed blocks, `cpu_accel.host_memory`)."""
        self.log, self.memory = run.log, run.memory
        self.rank = dist.get_rank()
        self.is_rank0 = self.rank == 0
        self.global_batch_size = run.batch.global_batch_size
        self.rampup = run.batch.rampup(run.parallel.data_parallel_size)
        # Profiler traces beside the TensorBoard events, else under --save; W&B likewise.
        self.log_dir = run.log.tensorboard_dir
        self.save_dir = run.ckpt.save
        self._profiler = None
        self.wandb = None
        if self.memory.manual_gc:
            gc.disable()
            gc.collect()
        host_memory = cpu_accel.host_memory_tuning()
        if self.memory.retain_host_memory and host_memory is not None:
            # On CPU the step's activations are host memory: keep the largest blocks too, unless
            # they are a large model's gradients and optimizer states (`host_memory`).
            why_not = host_memory.retain_freed_host_memory(
                large_blocks=not torch.cuda.is_available()
                and param_bytes < host_memory.LARGE_BLOCKS_PARAM_LIMIT
            )
            if why_not is not None and self.is_rank0:
                logger.info("freed host memory is returned to the OS: %s", why_not)
        if self.log.wandb_project and self.is_rank0:
            self.wandb = _init_wandb(run, self.save_dir or self.log_dir)

    def global_batch(self, consumed_samples: int) -> int:
        """Global batch size after `consumed_samples` samples (smaller while the rampup lasts)."""
        if self.rampup is None:
            return self.global_batch_size
        return self.rampup.global_batch(consumed_samples)

    def before_step(self, iteration: int) -> None:
        """`iteration` is the one about to run (1-based)."""
        c = self.log
        if c.profile and iteration == c.profile_step_start + 1 and self.rank in c.profile_ranks:
            self._start_profiler()

    def after_step(self, iteration: int) -> None:
        """After iteration `iteration`: advance or stop the profiler, run the manual GC on its
        interval and empty the CUDA cache at --empty-unused-memory-level >= 1."""
        m = self.memory
        if self._profiler is not None:
            self._profiler.step()
            if iteration >= self.log.profile_step_end:
                self._stop_profiler()
        if m.manual_gc and m.manual_gc_interval and iteration % m.manual_gc_interval == 0:
            gc.collect()
        if m.empty_unused_memory_level >= 1 and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def around_eval(self) -> None:
        """Called before and after each evaluation: manual GC (with --manual-gc-eval) and, at
        --empty-unused-memory-level >= 2, emptying the CUDA cache."""
        if self.memory.manual_gc and self.memory.manual_gc_eval:
            gc.collect()
        if self.memory.empty_unused_memory_level >= 2 and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def trace_dir(self) -> str:
        """Directory of the profiler traces: --tensorboard-dir, else <save>/profile."""
        return self.log_dir or os.path.join(self.save_dir, "profile")

    def _start_profiler(self) -> None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(
            activities=activities,
            on_trace_ready=tensorboard_trace_handler(self.trace_dir(), f"rank{self.rank}"),
            record_shapes=True,
        )
        self._profiler.start()
        logger.info(
            "profiling iterations %d-%d", self.log.profile_step_start + 1, self.log.profile_step_end
        )

    def _stop_profiler(self) -> None:
        self._profiler.stop()
        self._profiler = None
        logger.info("profiler trace written to %s", self.trace_dir())

    def close(self) -> None:
        """End of the run: stop the profiler, re-enable GC after --manual-gc, finish the W&B run."""
        if self._profiler is not None:
            self._stop_profiler()
        if self.memory.manual_gc:
            gc.enable()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _init_wandb(run: RunConfig, run_dir: Optional[str]):
    import wandb  # optional dependency (the [wandb] extra), imported only with --wandb-project

    cfg: LoggingConfig = run.log

    save_dir = cfg.wandb_save_dir or os.path.join(run_dir or ".", "wandb")
    os.makedirs(save_dir, exist_ok=True)
    # Offline unless the user configured otherwise: a run never needs the network to start.
    mode = os.environ.get("WANDB_MODE", "offline")
    return wandb.init(
        project=cfg.wandb_project,
        name=cfg.wandb_exp_name,
        entity=cfg.wandb_entity,
        dir=save_dir,
        mode=mode,
        config={k: v for k, v in run.args_json().items() if not k.startswith("wandb")},
    )
