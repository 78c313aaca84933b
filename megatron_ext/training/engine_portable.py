"""The portable training engine (the default; gloo on CPU, NCCL on GPU).

float32 parameters, gradients and Adam states; --bf16/--fp16 run forward and backward under
autocast. One step: forward/backward over the micro-batches (`schedules.forward_backward`,
1F1B under pipeline parallelism) with the data-parallel gradient average -> Megatron's
gradient reductions (sequence-parallel norms, tied embeddings) -> global grad-norm clipping
-> one world all-reduce of [loss sum, token count, non-finite flags, the caller's flags] ->
optimizer step (or a stop / skip on a non-finite loss or grad norm) -> scheduler step.
LEV input layers (`--lev-dedup-global-batch`) evaluate each distinct id of the global batch
once: the step brackets the micro-batches with `LEVEmbedding.begin_global_batch` and
`end_global_batch`, which runs LEV's backward after the last micro-batch's.

Data-parallel gradients: with one pipeline stage, torch's `DistributedDataParallel` over
`pg.dp_cp` (bucketed all-reduce overlapped with the last micro-batch's backward; earlier
micro-batches accumulate under `no_sync`). Its communication hook averages each bucket, notes
whether this rank's own gradients were finite (to name the rank of a NaN) and, with
--grad-reduce-in-bf16, sends BF16. Under pipeline parallelism the 1F1B schedule (interleaved
1F1B over model chunks, `--num-layers-per-virtual-pipeline-stage`) interleaves the backwards of
different micro-batches, which DDP's reducer cannot attribute to the forward that prepared it,
so there the gradients are averaged after the schedule by
`optimizer.allreduce_data_parallel_grads` (bucketed, asynchronous).
"""

from __future__ import annotations

import logging
import math
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from megatron_ext.lev.layer import LEVEmbedding
from megatron_ext.parallel import ProcessGroups
from megatron_ext.training.config import RunConfig
from megatron_ext.training.engine import (
    CheckpointParts,
    Engine,
    NonFiniteError,
    Phase,
    StepResult,
    time_lev_forwards,
    world_stats,
)
from megatron_ext.training.finalize_grads import (
    allreduce_sequence_parallel_grads,
    allreduce_tied_embedding_grads,
)
from megatron_ext.training.metrics_logger import Timers
from megatron_ext.training.optimizer import (
    LossScaler,
    all_finite,
    allreduce_data_parallel_grads,
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
)
from megatron_ext.training.precision import autocast_factory, pipeline_dtype
from megatron_ext.training.run_extras import num_zeros_in_grad, params_norm
from megatron_ext.training.schedules import ForwardStep, PipelineShape, forward_backward

logger = logging.getLogger(__name__)

__all__ = ["PortableEngine"]


class _AverageHook:
    """State of `_average_hook`: the group, the dtype on the wire, and whether this rank's own
    gradients were finite in this iteration's buckets."""

    def __init__(self, group: dist.ProcessGroup, reduce_dtype: Optional[torch.dtype]) -> None:
        self.group, self.reduce_dtype = group, reduce_dtype
        self.finite = True


def _average_hook(state, bucket):  # annotations left off: DDP checks them at run time
    """DDP communication hook: average one gradient bucket over `state.group` (sent in
    `state.reduce_dtype` when given), after noting whether it was finite on this rank."""
    buffer = bucket.buffer()
    if not bool(torch.isfinite(buffer).all()):
        state.finite = False
    buffer.div_(dist.get_world_size(state.group))
    wire = buffer if state.reduce_dtype is None else buffer.to(state.reduce_dtype)
    future = dist.all_reduce(wire, group=state.group, async_op=True).get_future()

    def unpack(done):
        reduced = done.value()[0]
        if reduced is not buffer:
            buffer.copy_(reduced)
        return buffer

    return future.then(unpack)


class PortableEngine(Engine):
    """The portable engine over this stage's `model` (see the module doc).

    Args:
        cfg: the run's settings.
        model: this pipeline stage's model (float32 parameters), or its model chunks in order
            (virtual pipeline stages: the interleaved 1F1B schedule).
        forward_step: Megatron's `(data_iterator, model) -> (output, loss_func)`.
        pg: the run's process groups.
        phase: shared with the loop, named when a collective times out.
        timers: --timing-log-level's timers.
    """

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
        self.optimizer = build_optimizer(
            model,
            cfg.optim,
            pg.dp_cp if cfg.parallel.use_distributed_optimizer else None,
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
        device = next(model.parameters()).device
        hidden = self.chunks[0].config.hidden_size
        seq = b.seq_length // cfg.parallel.context_parallel_size
        if cfg.parallel.sequence_parallel:
            seq //= cfg.parallel.tensor_model_parallel_size
        self.shape = PipelineShape((seq, b.micro_batch_size, hidden), pipeline_dtype(prec), device)
        self.consecutive_nonfinite = 0
        self._hook = _AverageHook(pg.dp_cp, torch.bfloat16 if prec.grad_reduce_in_bf16 else None)
        self.lev = [
            m
            for chunk in self.chunks
            for m in chunk.modules()
            if isinstance(m, LEVEmbedding) and m.dedups_global_batch
        ]
        """LEV modules evaluated once per distinct id of the global batch: their backward runs
        after the last micro-batch (`LEVEmbedding.begin_global_batch`)."""
        time_lev_forwards(self.chunks, timers)
        self.ddp: Optional[DistributedDataParallel] = None
        """torch DDP over `pg.dp_cp` (one pipeline stage and DP x CP > 1), else None."""
        if pg.pp_size == 1 and pg.dp_cp_size > 1:
            # Those LEV parameters get their gradients after DDP's backward: DDP leaves them out
            # (its reducer would wait for them) and `step` averages them itself.
            lev_params = {id(p) for m in self.lev for p in m.parameters()}
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, [name for name, p in model.named_parameters() if id(p) in lev_params]
            )
            self.ddp = DistributedDataParallel(
                model,
                process_group=pg.dp_cp,
                broadcast_buffers=False,
                init_sync=False,  # every DP rank built the same weights from the same seed
            )
            self.ddp.register_comm_hook(self._hook, _average_hook)

    def _counts_loss(self) -> bool:
        return self.pg.is_last_stage and self.pg.tp_rank == 0

    def step(
        self, data_iterator: Iterator, global_batch: int, flags: Sequence[bool] = ()
    ) -> StepResult:
        """See `Engine.step`."""
        b, p = self.cfg.batch, self.cfg.parallel
        per_token_loss = self.cfg.engine.calculate_per_token_loss
        self.timers.mark()
        self.optimizer.zero_grad()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        ddp = self.ddp
        self.phase.set(
            "forward-backward (tensor/pipeline-parallel group)"
            if ddp is None
            else "forward-backward with the data-parallel all-reduce (model- and data-parallel "
            "groups)",
            self.pg.mp if ddp is None else self.pg.dp_cp,
        )
        self._hook.finite = True
        for module in self.lev:
            module.begin_global_batch()
        try:
            totals = forward_backward(
                forward_step=self.forward_step,
                data_iterator=data_iterator,
                model=self.chunks if ddp is None else ddp,
                num_microbatches=global_batch // (b.micro_batch_size * p.data_parallel_size),
                shape=self.shape,
                pg=self.pg,
                loss_scale=scale,
                autocast=self.autocast,
                per_token_loss=per_token_loss,
                no_sync=None if ddp is None else ddp.no_sync,
            )
            if self.lev:  # a model without LEV logs no lev-backward span
                with self.timers.span("lev-backward"):
                    for module in self.lev:
                        module.end_global_batch()
        finally:
            for module in self.lev:
                module.abort_global_batch()
        self.timers.mark("forward-backward")
        if p.sequence_parallel:
            allreduce_sequence_parallel_grads(self.chunks, self.pg.tp)
        allreduce_tied_embedding_grads(self.chunks, self.pg.embd)
        grad_scale = 1.0 / scale
        if per_token_loss:
            grad_scale *= self._per_token_grad_scale(totals)
        if ddp is not None:  # averaged over DP x CP during backward
            grads_ok = self._hook.finite
            if self.lev:  # the parameters DDP leaves out (see __init__)
                lev_ok = allreduce_data_parallel_grads(
                    [p for m in self.lev for p in m.parameters()],
                    self.pg.dp_cp,
                    reduce_dtype=self._hook.reduce_dtype,
                )
                grads_ok = grads_ok and lev_ok is not False
            for param in self.optimizer.params:
                if param.grad is None:  # every rank steps the same set
                    param.grad = torch.zeros_like(param)
            if grad_scale != 1.0:
                torch._foreach_mul_([p.grad for p in self.optimizer.params], grad_scale)
        else:
            self.phase.set("data-parallel gradient all-reduce (data-parallel group)", self.pg.dp_cp)
            grads_ok = allreduce_data_parallel_grads(
                self.optimizer.params,
                self.pg.dp_cp,
                scale=grad_scale,
                reduce_dtype=torch.bfloat16 if self.cfg.precision.grad_reduce_in_bf16 else None,
            )
        self.timers.mark("grads-all-reduce")
        grad_norm = clip_grad_norm(self.optimizer.params, self.cfg.optim.clip_grad, self.pg)
        if grads_ok is None:
            # No data parallelism: the gradients are still this rank's own. A finite norm over
            # the model-parallel world means finite gradients everywhere; only otherwise look.
            grads_ok = math.isfinite(grad_norm) or all_finite(p.grad for p in self.optimizer.params)
        self.timers.mark("grad-norm-and-clip")
        loss_ok = all_finite(totals.values())
        self.phase.set("all-reduce of the iteration's loss and exit flags (world group)")
        stats = world_stats(
            totals,
            self._counts_loss(),
            [not loss_ok, not grads_ok, *flags],
            self.shape.device,
        )
        loss = stats[0] / stats[1] if stats[1] > 0 else float("nan")
        grad_finite = math.isfinite(grad_norm)
        loss_finite = math.isfinite(loss) and stats[2] == 0
        stepped = skipped = nonfinite = False
        note = ""
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

    def evaluate(self, data_iterator: Iterator, eval_iters: int) -> Optional[float]:
        """See `Engine.evaluate`."""
        totals: dict[str, torch.Tensor] = {}
        self.model.eval()
        try:
            for _ in range(eval_iters):
                step = forward_backward(
                    forward_step=self.forward_step,
                    data_iterator=data_iterator,
                    model=self.chunks,
                    num_microbatches=self.cfg.num_microbatches,
                    shape=self.shape,
                    pg=self.pg,
                    forward_only=True,
                    autocast=self.autocast,
                )
                for key, value in step.items():
                    totals[key] = totals[key] + value if key in totals else value
        finally:
            self.model.train()
        stats = world_stats(totals, self._counts_loss(), [], self.shape.device)
        return stats[0] / stats[1] if stats[1] > 0 else None

    def log_stats(self) -> dict[str, float]:
        """See `Engine.log_stats`."""
        log, out = self.cfg.log, {}
        if log.log_params_norm:
            out["params-norm"] = params_norm(self.optimizer.params, self.pg)
        if log.log_num_zeros_in_grad:
            out["num-zeros"] = float(num_zeros_in_grad(self.optimizer.params, self.pg))
        return out

    def checkpoint_parts(self) -> CheckpointParts:
        """See `Engine.checkpoint_parts`."""
        return CheckpointParts(self.model, self.optimizer, self.scheduler, self.scaler)
