"""The portable training engine (the default; gloo on CPU, NCCL on GPU): float32 parameters,
gradients and Adam states, --bf16/--fp16 under autocast. One step, the same under every layout
(docs/architecture.md draws it): the micro-batches through `pipeline.Pipeline`, each stage in
torch DDP over `pg.dp_cp` when DP x CP > 1; the deferred modules' backward
(`engine.ModuleHooks`) and their gradients' one average; Megatron's model-parallel gradient
sums and the 1 / loss-scale; clipping; one world all-reduce of the loss and flags; then the
optimizer step, or a stop / skip on a non-finite loss or grad norm.
"""

from __future__ import annotations

import logging
import math
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from megatron_ext.config.run import RunConfig
from megatron_ext.parallel import ProcessGroups
from megatron_ext.training import data_parallel
from megatron_ext.training.engine import (
    Engine,
    NonFiniteError,
    Phase,
    StepResult,
    time_forwards,
)
from megatron_ext.training.finalize_grads import (
    allreduce_sequence_parallel_grads,
    allreduce_tied_embedding_grads,
)
from megatron_ext.training.metrics_logger import Timers
from megatron_ext.training.optimizer import (
    LossScaler,
    Optimizer,
    all_finite,
    build_scheduler,
    clip_grad_norm,
)
from megatron_ext.training.pipeline import ForwardStep, Pipeline, PipelineShape
from megatron_ext.training.precision import autocast_factory
from megatron_ext.training.unique_params import num_zeros_in_grad, params_norm

logger = logging.getLogger(__name__)

__all__ = ["PortableEngine"]


class PortableEngine(Engine):
    """The portable engine over this stage's `model` (float32 parameters), or its model chunks
    in order (interleaved 1F1B); see the module doc."""

    def __init__(
        self,
        cfg: RunConfig,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        forward_step: ForwardStep,
        pg: ProcessGroups,
        phase: Phase,
        timers: Timers,
    ) -> None:
        self.chunks = list(model) if isinstance(model, Sequence) else [model]
        if len(self.chunks) > 1:
            model = torch.nn.ModuleList(self.chunks)
        self.cfg, self.model, self.forward_step, self.pg = cfg, model, forward_step, pg
        self.phase, self.timers = phase, timers
        b, prec, o = cfg.batch, cfg.precision, cfg.optim
        self.optimizer = Optimizer(
            model,
            cfg.optim,
            zero_group=pg.dp_cp if cfg.parallel.use_distributed_optimizer else None,
            decoupled=(o.decoupled_lr, o.decoupled_min_lr) if o.decoupled_lr else None,
        )
        self.scheduler = build_scheduler(self.optimizer, cfg.optim)
        self.scaler = (
            LossScaler(
                prec.loss_scale,
                prec.initial_loss_scale,
                prec.min_loss_scale,
                prec.loss_scale_window,
                prec.hysteresis,
            )
            if prec.fp16
            else None
        )
        self.autocast = autocast_factory(prec)
        self.device = device = next(model.parameters()).device
        hidden = self.chunks[0].config.hidden_size
        seq = cfg.model.seq_length // cfg.parallel.context_parallel_size
        tokens = seq  # of this context-parallel rank, in the loss stage's [b, s] output
        if cfg.parallel.sequence_parallel:
            seq //= cfg.parallel.tensor_model_parallel_size
        self.shape = PipelineShape(
            (seq, b.micro_batch_size, hidden),
            torch.float32,  # see precision.py
            device,
            loss_output=(b.micro_batch_size, tokens),
        )
        self.consecutive_nonfinite = 0
        self.deferred = [  # `ModuleHooks` whose backward runs after the last micro-batch
            m for c in self.chunks for m in c.modules() if getattr(m, "defers_gradients", False)
        ]
        time_forwards(self.chunks, timers)
        self.average: Optional[data_parallel.GradientAverage] = None  # over pg.dp_cp if > 1
        if pg.dp_cp_size > 1:
            self.average = data_parallel.GradientAverage(
                pg.dp_cp, torch.bfloat16 if prec.grad_reduce_in_bf16 else None
            )
        self.pipeline = Pipeline(
            self.chunks,
            forward_step,
            pg,
            self.shape,
            autocast=self.autocast,
            deferred=self._deferred_params(),
            wrap=lambda m: m if self.average is None else data_parallel.wrap(m, self.average),
        )
        # torch DDP around each pipeline stage's module (none when DP x CP is 1).
        self.ddp: list[DistributedDataParallel] = [
            m for m in self.pipeline.modules if isinstance(m, DistributedDataParallel)
        ]

    def _deferred_params(self) -> list[torch.nn.Parameter]:
        return [param for module in self.deferred for param in module.parameters()]

    def step(
        self, data_iterator: Iterator, global_batch: int, flags: Sequence[bool] = ()
    ) -> StepResult:
        """See `Engine.step`."""
        self.timers.mark()
        self.optimizer.zero_grad()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        totals = self._forward_backward(data_iterator, global_batch, scale)
        self._finish_grads(totals, scale)
        grads_ok = None if self.average is None else self.average.finite  # before the average
        self.timers.mark("grads-all-reduce")
        grad_norm = clip_grad_norm(self.optimizer.params, self.cfg.optim.clip_grad, self.pg)
        if grads_ok is None:
            # No data parallelism: the gradients are still this rank's own. A finite norm over
            # the model-parallel world means finite gradients everywhere; only otherwise look.
            grads_ok = math.isfinite(grad_norm) or all_finite(p.grad for p in self.optimizer.params)
        self.timers.mark("grad-norm-and-clip")
        loss_ok = all_finite(totals.values())
        self.phase.set("all-reduce of the iteration's loss and exit flags (world group)")
        stats = self.world_stats(totals, [not loss_ok, not grads_ok, *flags])
        loss = stats[0] / stats[1] if stats[1] > 0 else float("nan")
        stepped = skipped = nonfinite = False
        note = ""
        grad_finite = math.isfinite(grad_norm)
        loss_finite = math.isfinite(loss) and stats[2] == 0
        if self.scaler is not None and loss_finite and not grad_finite:
            # An FP16 overflow: halve the scale (after hysteresis) and skip the step.
            self.scaler.update(True)
            skipped = True
        elif self.cfg.exit.check_for_nan_in_loss_and_grad and not (loss_finite and grad_finite):
            note = self._nonfinite(loss, grad_norm, loss_ok, grads_ok, stats)
            skipped = nonfinite = True
        else:
            self.optimizer.step()
            self.scheduler.step(increment=global_batch)
            if self.scaler is not None:
                self.scaler.update(False)
            self.consecutive_nonfinite = 0
            stepped = True
        self.timers.mark("optimizer")
        return StepResult(
            loss=loss,
            grad_norm=grad_norm,
            stepped=stepped,
            skipped=skipped,
            nonfinite=nonfinite,
            lr=self.optimizer.get_lr(),
            flags=tuple(v > 0 for v in stats[4:]),
            note=note,
        )

    def _forward_backward(self, data_iterator: Iterator, global_batch: int, scale: float) -> dict:
        """The schedule over the global batch's micro-batches (with the deferred modules'
        bracket and their gradients' average); returns the loss reports' totals."""
        b, p, pg, average = self.cfg.batch, self.cfg.parallel, self.pg, self.average
        if average is None:
            self.phase.set("forward-backward (tensor/pipeline-parallel group)", pg.mp)
        elif dist.get_world_size(pg.mp) == 1:
            self.phase.set("forward-backward with the data-parallel all-reduce", pg.dp_cp)
        else:
            self.phase.set("forward-backward with the data-parallel all-reduce (world group)")
        if average is not None:
            average.finite = True
        for module in self.deferred:
            module.begin_global_batch()
        try:
            totals = self.pipeline.run(
                data_iterator,
                global_batch // (b.micro_batch_size * p.data_parallel_size),
                loss_scale=scale,
                per_token_loss=self.cfg.engine.calculate_per_token_loss,
            )
            for module in self.deferred:  # a model without them logs no such span
                with self.timers.span(f"{module.engine_name}-backward"):
                    module.end_global_batch()
        finally:
            for module in self.deferred:
                module.abort_global_batch()
        self.timers.mark("forward-backward")
        if average is not None and self.deferred:
            # The one data-parallel reduction outside DDP: the deferred gradients.
            self.phase.set("the deferred gradients' data-parallel all-reduce", pg.dp_cp)
            average.average_params(self._deferred_params())
        return totals

    def _finish_grads(self, totals: dict, scale: float) -> None:
        """Megatron's model-parallel gradient sums, a zero gradient for every parameter without
        one (every rank steps the same set), and the 1 / loss-scale (and per-token) scale."""
        if self.cfg.parallel.sequence_parallel:
            allreduce_sequence_parallel_grads(self.chunks, self.pg.tp)
        allreduce_tied_embedding_grads(self.chunks, self.pg.embd)
        for param in self.optimizer.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grad_scale = 1.0 / scale
        if self.cfg.engine.calculate_per_token_loss:
            grad_scale *= self._per_token_grad_scale(totals)
        if grad_scale != 1.0:
            torch._foreach_mul_([param.grad for param in self.optimizer.params], grad_scale)

    def _per_token_grad_scale(self, totals: dict) -> float:
        """--calculate-per-token-loss: the loss is a sum over tokens; the gradient divides by
        the global batch's token count (the DP average then multiplies back by DP x CP)."""
        count = torch.zeros(1, dtype=torch.float64, device=self.shape.device)
        if self._counts_loss() and "lm loss" in totals:
            count[0] = totals["lm loss"][1]
        dist.all_reduce(count)
        return self.pg.dp_cp_size / max(float(count.item()), 1.0)

    def _bad_ranks(self, local_bad: bool) -> list[int]:
        flags = torch.zeros(dist.get_world_size(), dtype=torch.float32, device=self.shape.device)
        flags[dist.get_rank()] = 1.0 if local_bad else 0.0
        dist.all_reduce(flags)
        return [r for r, f in enumerate(flags.tolist()) if f > 0]

    def _nonfinite(self, loss, grad_norm, loss_ok, grads_ok, stats) -> str:
        """A non-finite loss or grad norm: raise `NonFiniteError`, or (--skip-nonfinite-steps)
        return the message and let the caller skip the step. The loop prefixes the
        iteration to either."""
        ex = self.cfg.exit
        self.consecutive_nonfinite += 1
        bad_loss = self._bad_ranks(not loss_ok) if stats[2] else []
        bad_grad = self._bad_ranks(not grads_ok) if stats[3] else []
        where = []
        if bad_loss:
            where.append(f"non-finite loss on rank(s) {bad_loss}")
        if bad_grad:
            where.append(f"non-finite gradients on rank(s) {bad_grad}")
        message = f"loss {loss} / grad norm {grad_norm} is not finite"
        if where:
            message += f" ({'; '.join(where)})"
        if not ex.skip_nonfinite_steps:
            raise NonFiniteError(
                message + "; stopped without saving (--skip-nonfinite-steps skips such steps)"
            )
        if self.consecutive_nonfinite >= ex.max_nonfinite_steps:
            raise NonFiniteError(
                message + f"; {self.consecutive_nonfinite} non-finite iterations in a row "
                "(--max-nonfinite-steps), stopped"
            )
        return message

    def _forward_only(self, data_iterator: Iterator) -> dict:
        return self.pipeline.run(data_iterator, self.cfg.num_microbatches, forward_only=True)

    def log_stats(self) -> dict[str, float]:
        """See `Engine.log_stats`."""
        log, out = self.cfg.log, {}
        if log.log_params_norm:
            out["params-norm"] = params_norm(self.optimizer.params, self.pg)
        if log.log_num_zeros_in_grad:
            out["num-zeros"] = float(num_zeros_in_grad(self.optimizer.params, self.pg))
        return out
