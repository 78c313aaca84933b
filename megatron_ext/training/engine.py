"""The training engine interface: what the loop needs from whoever runs the step, and what a
module may declare to the engines (`ModuleHooks`).

As narrow as Megatron-LM's `train_step`: an engine owns this stage's model chunks, optimizer,
LR scheduler and FP16 loss scaler (what a checkpoint saves), and offers `step` (one global
batch), `evaluate` and `log_stats`. Two implementations: `engine_portable.PortableEngine` (gloo
and NCCL) and `megatron_engine.MegatronEngine` (megatron-core's DDP, optimizer and schedules).
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "Engine",
    "StepResult",
    "Phase",
    "NonFiniteError",
    "add_reports",
    "ModuleHooks",
    "time_forwards",
]


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm became NaN/inf; the run stopped without saving it."""


@dataclass
class Phase:
    """What the rank is doing and over which group, named when a collective times out."""

    what: str = "setup"
    group: Optional[dist.ProcessGroup] = None

    def set(self, what: str, group: Optional[dist.ProcessGroup] = None) -> None:
        """Enter a phase; `group` None means the world group."""
        self.what, self.group = what, group


@dataclass
class StepResult:
    """One iteration as the loop sees it (identical on every rank)."""

    loss: float  # mean over the global batch's tokens (nan when not finite)
    grad_norm: float  # global L2 norm before clipping (nan when unknown or not finite)
    stepped: bool  # the optimizer stepped
    skipped: bool  # FP16 overflow or a skipped non-finite step
    nonfinite: bool  # the loss or grad norm was not finite (counted as a nan iteration)
    lr: float  # after the step (of the first parameter group)
    flags: tuple[bool, ...] = field(default_factory=tuple)  # the caller's, ORed over the ranks
    note: str = ""  # why a non-finite step was skipped (logged with the iteration)


def add_reports(totals: dict, reports: dict) -> dict:
    """Add `reports` (name -> [sum, count]) into `totals`, in float64; returns `totals`."""
    for name, value in reports.items():
        value = value.detach().double()
        totals[name] = totals[name] + value if name in totals else value
    return totals


class ModuleHooks(Protocol):
    """What a module of the model may declare to the engines and the optimizer (duck-typed;
    `LEVEmbedding` declares it all). A module with an `engine_name` has its training forwards
    timed as "<engine_name>-forward" and its optimizer groups set by `param_settings`. One whose
    `defers_gradients` is true gets its gradients after the pipeline schedule, in
    `end_global_batch`, averaged over data parallelism by the engine (DDP leaves them out)."""

    engine_name: str
    defers_gradients: bool

    def param_settings(self) -> dict[int, tuple[bool, float]]:
        """id(parameter) -> (weight decay?, lr multiplier); a group whose multiplier is not 1
        is named with the suffix "_<engine_name>"."""

    def begin_global_batch(self) -> None:
        """Before the first micro-batch."""

    def end_global_batch(self) -> None:
        """After the schedule: the backward that fills the deferred gradients."""

    def abort_global_batch(self) -> None:
        """The step failed: drop what `begin_global_batch` started."""


def time_forwards(chunks: Sequence[torch.nn.Module], timers) -> None:
    """--timing-log-level 2: time every training-mode forward of the modules of `chunks` with
    an `engine_name` as the `Timers` span "<engine_name>-forward" (a part of forward-backward),
    through forward hooks. Registers nothing below level 2 (`timers.detailed` false)."""
    if not timers.detailed:
        return
    started: list[Optional[float]] = []

    def before(module, args):
        started.append(timers.now() if module.training else None)

    def after(module, args, output):
        start = started.pop()
        if start is not None:
            timers.add(f"{module.engine_name}-forward", timers.now() - start)

    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "engine_name"):
                module.register_forward_pre_hook(before)
                module.register_forward_hook(after)


class Engine(abc.ABC):
    """One training engine: the model chunks it runs, its optimizer and scheduler, and `step`.
    Every implementation sets the attributes below in `__init__` (a checkpoint holds four)."""

    model: torch.nn.Module  # this stage's unwrapped model (what checkpoints and FLOPs read)
    optimizer: Any  # `param_groups` and `get_lr()` at least
    scheduler: Any  # megatron-core's OptimizerParamScheduler over `optimizer`
    scaler: Any  # the FP16 loss scaler (`scale`, `state_dict`), or None
    phase: Phase  # shared with the loop, updated around the engine's collectives
    pg: Any  # the run's `ProcessGroups`
    device: torch.device  # where the step's statistics are reduced

    @abc.abstractmethod
    def step(
        self, data_iterator: Iterator, global_batch: int, flags: Sequence[bool] = ()
    ) -> StepResult:
        """Train on one global batch of `global_batch` samples drawn from `data_iterator`."""

    @abc.abstractmethod
    def _forward_only(self, data_iterator: Iterator) -> dict:
        """One global batch forward: the loss reports' totals on the last stage, else {}."""

    def evaluate(self, data_iterator: Iterator, eval_iters: int) -> Optional[float]:
        """Mean forward-only loss over `eval_iters` global batches (None without tokens)."""
        totals: dict[str, torch.Tensor] = {}
        self.train(False)
        try:
            with torch.no_grad():
                for _ in range(eval_iters):
                    add_reports(totals, self._forward_only(data_iterator))
        finally:
            self.train()
        stats = self.world_stats(totals)
        return stats[0] / stats[1] if stats[1] > 0 else None

    def _counts_loss(self) -> bool:
        """TP rank 0 of the last stage counts the loss (once per DP replica)."""
        return self.pg.is_last_stage and self.pg.tp_rank == 0

    def world_stats(self, totals: dict, flags: Sequence[bool] = ()) -> list[float]:
        """[loss sum, token count, *flags] summed over the world in one all-reduce (the loss of
        the ranks that `_counts_loss`)."""
        stats = torch.zeros(2 + len(flags), dtype=torch.float64)
        if self._counts_loss() and "lm loss" in totals:
            stats[0:2] = totals["lm loss"].double().cpu()
        for i, flag in enumerate(flags):
            stats[2 + i] = 1.0 if flag else 0.0
        if self.device.type == "cuda":
            stats = stats.cuda()
        dist.all_reduce(stats)
        return stats.cpu().tolist()

    @abc.abstractmethod
    def log_stats(self) -> dict[str, float]:
        """Collective: the optional logged extras of the latest step (params-norm, num-zeros)."""

    def train(self, mode: bool = True) -> None:
        """Put the model chunks in training (or evaluation) mode."""
        self.model.train(mode)

    @contextlib.contextmanager
    def checkpoint_view(self):
        """The checkpoint manager saves and loads inside this context (an engine with
        low-precision parameters shows their float32 master copies here)."""
        yield
