"""`--ddp-impl megatron`: megatron-core's own training engine on CUDA.

The portable engine (`loop._Trainer`) keeps float32 parameters and runs the model under
autocast, with this project's gradient all-reduce, ZeRO-1 and pipeline schedule. This engine
swaps in megatron-core's machinery, as Megatron-LM's `pretrain` uses it:

- parameters in BF16 (the model is built with `bf16=True`; `Float16Module` wraps it), float32
  main gradients in megatron's `DistributedDataParallel` buffers, bucketed, with
  `--overlap-grad-reduce` and `--ddp-bucket-size`;
- megatron's optimizer (`get_megatron_optimizer`): float32 master weights, Adam, gradient
  clipping, and with `--use-distributed-optimizer` the distributed optimizer
  (`--overlap-param-gather`);
- megatron's schedules (`get_forward_backward_func`: no pipelining or 1F1B) with
  `finalize_model_grads` (DP reduce, TP/SP norm and tied-embedding gradients).

Status: written against megatron-core 0.16.1 and refused on CPU (`gpu_arguments`); it has not
been executed yet (no GPU was available while it was written): `scripts/gpu_check.sh` compares
its losses with the portable engine over 20 steps. Until that comparison passes it is opt-in,
and three things are refused with a one-line error instead of being half-done: checkpoints
(--save/--load: the optimizer state is megatron's, not the project's format yet), the
interleaved schedule (--num-layers-per-virtual-pipeline-stage: needs model chunks per virtual
stage) and --fp8-param-gather.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_ext.training.loop import _StepResult, _Trainer
from megatron_ext.training.optimizer import build_scheduler

logger = logging.getLogger(__name__)

__all__ = ["MegatronEngineTrainer"]


class _OptimizerAdapter:
    """megatron's optimizer with the two calls the loop makes (`get_lr`, `zero_grad`)."""

    def __init__(self, optimizer):
        self.inner = optimizer

    @property
    def param_groups(self):
        return self.inner.param_groups

    def get_lr(self) -> float:
        return float(self.inner.param_groups[0]["lr"])

    def zero_grad(self) -> None:
        self.inner.zero_grad()


def _build(cfg, model):
    """(DDP-wrapped model, megatron optimizer) for one model chunk."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = model.config
    if config.bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=cfg.engine.overlap_grad_reduce,
        overlap_param_gather=cfg.engine.overlap_param_gather,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        bucket_size=cfg.engine.ddp_bucket_size,
        check_for_nan_in_grad=cfg.exit.check_for_nan_in_loss_and_grad,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    o = cfg.optim
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        overlap_param_gather_with_optimizer_step=False,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    return ddp, optimizer


class MegatronEngineTrainer(_Trainer):
    """`_Trainer` whose step, optimizer and scheduler are megatron-core's."""

    def __init__(self, cfg, model, forward_step, pg):
        if not torch.cuda.is_available():
            raise RuntimeError("--ddp-impl megatron needs CUDA")
        # The base class reads model attributes (vocab size, config) that the wrappers hide;
        # the portable optimizer it builds holds no state until a step and is replaced here.
        super().__init__(cfg, model, forward_step, pg)
        ddp, optimizer = _build(cfg, model)
        self.model = ddp
        self.megatron_optimizer = optimizer
        self.optimizer = _OptimizerAdapter(optimizer)
        self.scheduler = build_scheduler(optimizer, cfg.optim)
        self.autocast = None  # parameters are BF16 already; TE handles FP8 from the config
        config = ddp.config
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
        if cfg.engine.overlap_grad_reduce:
            config.no_sync_func = ddp.no_sync
            config.grad_sync_func = ddp.start_grad_sync
        if cfg.engine.overlap_param_gather:
            config.param_sync_func = ddp.start_param_sync
        self.forward_backward_func = get_forward_backward_func()

    def train_step(self, data_iterator) -> _StepResult:
        """One training iteration with megatron-core's forward-backward schedule and optimizer;
        returns the world-reduced loss, the gradient norm and whether the step was taken."""
        b, p = self.cfg.batch, self.cfg.parallel
        self.model.zero_grad_buffer()
        self.megatron_optimizer.zero_grad()
        seq = b.seq_length // p.context_parallel_size
        reports = self.forward_backward_func(
            forward_step_func=self.forward_step,
            data_iterator=data_iterator,
            model=[self.model],
            num_microbatches=self.cfg.num_microbatches,
            seq_length=seq,
            micro_batch_size=b.micro_batch_size,
            forward_only=False,
        )
        totals: dict[str, torch.Tensor] = {}
        if self.pg.is_last_stage:
            for report in reports:
                for key, value in report.items():
                    value = value.double()
                    totals[key] = totals[key] + value if key in totals else value
        loss_ok = all(bool(torch.isfinite(v).all()) for v in totals.values())
        stepped, grad_norm, _ = self.megatron_optimizer.step()
        grad_norm = float("nan") if grad_norm is None else float(grad_norm)
        stats = self._world_stats(totals, loss_ok, stepped)
        loss = stats[0] / stats[1] if stats[1] > 0 else float("nan")
        if stepped:
            self.scheduler.step(increment=b.global_batch_size)
        else:
            self.state.skipped_iterations += 1
        return _StepResult(loss, grad_norm, bool(stepped), stats[4] > 0, stats[5] > 0)

    def evaluate(self, dataset, name: str = "validation"):
        """Not implemented for this engine: logs a warning and returns None."""
        logger.warning("--ddp-impl megatron: %s evaluation is not implemented yet", name)
        return None
