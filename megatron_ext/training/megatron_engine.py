"""`--ddp-impl megatron`: megatron-core's own training machinery as an `Engine`, as Megatron-LM's
`pretrain` uses it: BF16 parameters under `Float16Module`, float32 main gradients in its
`DistributedDataParallel`, its optimizer (float32 master weights, the distributed optimizer),
`get_forward_backward_func` with `finalize_model_grads`. Checkpoints hold the float32 master
weights in the project's format, so either engine's checkpoint loads into the other. The pieces
need CUDA: they come from a `MegatronParts`, which the tests replace with CPU doubles.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import megatron_ext.megatron_import  # noqa: F401

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import (
    OptimizerConfig,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megatron_ext.config.run import RunConfig
from megatron_ext.parallel import ProcessGroups
from megatron_ext.training.engine import (
    Engine,
    NonFiniteError,
    Phase,
    StepResult,
    add_reports,
    time_forwards,
)
from megatron_ext.training.metrics_logger import Timers
from megatron_ext.training.optimizer import all_finite, build_scheduler, is_decoupled_param
from megatron_ext.training.pipeline import ForwardStep
from megatron_ext.training.unique_params import params_norm

logger = logging.getLogger(__name__)

__all__ = ["MegatronEngine", "MegatronParts"]


@dataclass(frozen=True)
class MegatronParts:
    """The megatron-core callables the engine is built from: by default megatron-core's own
    (CUDA); the tests pass CPU doubles with the same signatures."""

    ddp: Callable = DistributedDataParallel
    ddp_config: Callable = DistributedDataParallelConfig
    float16_module: Callable = Float16Module
    optimizer_config: Callable = OptimizerConfig
    config_overrides: Callable = get_standard_config_overrides
    get_optimizer: Callable = get_megatron_optimizer
    forward_backward: Callable = get_forward_backward_func
    finalize_model_grads: Callable = finalize_model_grads


class _OptimizerState:
    """megatron's optimizer seen by `checkpoint.format` (`owns`, `owned_state`, `set_state`,
    `param_groups`, `get_lr`): Adam's state per model parameter, whether megatron keeps it on
    a float32 main copy (BF16 parameters) or on the parameter itself (float32)."""

    def __init__(self, chained) -> None:
        self.inner = chained
        # (model parameter, the tensor Adam updates) for every parameter of this rank
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.main_of: dict[int, torch.Tensor] = {}  # id(param) -> float32 main (BF16 params)
        self.owners: dict[int, Any] = {}  # id(param) -> the torch optimizer holding its state
        for opt in chained.chained_optimizers:
            pairs = []
            if hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
                for model_group, main_group in zip(
                    opt.float16_groups, opt.fp32_from_float16_groups
                ):
                    pairs += list(zip(model_group, main_group))
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    if not any(param is main for _, main in pairs):
                        pairs.append((param, param))
            for model_param, main in pairs:
                if main is not model_param:
                    self.main_of[id(model_param)] = main
                self.owners[id(model_param)] = opt.optimizer
            self.pairs += pairs

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def get_lr(self) -> float:
        return float(self.inner.param_groups[0]["lr"])

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self.owners

    def owned_state(self) -> dict[torch.Tensor, dict]:
        out = {}
        for model_param, main in self.pairs:
            state = self.owners[id(model_param)].state.get(main)
            if state:
                out[model_param] = state
        return out

    def set_state(self, param: torch.Tensor, state: dict) -> None:
        main = self.main_of.get(id(param), param)
        state = {
            k: v.to(torch.float32) if k != "step" and torch.is_tensor(v) else v
            for k, v in state.items()
        }
        self.owners[id(param)].state[main] = state


class MegatronEngine(Engine):
    """megatron-core's DDP, optimizer and schedule behind the `Engine` interface, over this
    stage's `model` (a GPTModel); `parts` default to megatron-core's own (CUDA)."""

    def __init__(
        self,
        cfg: RunConfig,
        model: torch.nn.Module,
        forward_step: ForwardStep,
        pg: ProcessGroups,
        phase: Phase,
        timers: Timers,
        parts: Optional[MegatronParts] = None,
    ) -> None:
        if parts is None:
            if not torch.cuda.is_available():
                raise RuntimeError("--ddp-impl megatron needs CUDA")
            parts = MegatronParts()
        self.cfg, self.model, self.forward_step, self.pg = cfg, model, forward_step, pg
        self.phase, self.timers, self.parts = phase, timers, parts
        time_forwards([model], timers)
        self.scaler = None  # megatron's optimizer owns loss scaling (BF16/float32: none)
        config = model.config
        module = parts.float16_module(config, model) if config.bf16 else model
        collection = pg.megatron_collection()
        ddp_config = parts.ddp_config(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=cfg.engine.overlap_grad_reduce,
            overlap_param_gather=cfg.engine.overlap_param_gather,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
            bucket_size=cfg.engine.ddp_bucket_size,
            check_for_nan_in_grad=cfg.exit.check_for_nan_in_loss_and_grad,
            fp8_param_gather=cfg.precision.fp8_param_gather,
        )
        self.ddp = parts.ddp(
            config=config, ddp_config=ddp_config, module=module, pg_collection=collection
        )
        o = cfg.optim
        # megatron's decoupled-lr group is its input embedding and output layer; here the
        # input embedding is the whole arm (every LEV generator parameter), as in the
        # portable engine.
        for name, param in model.named_parameters():
            if o.decoupled_lr is not None and is_decoupled_param(name):
                param.is_embedding_or_output_parameter = True
        opt_config = parts.optimizer_config(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            decoupled_lr=o.decoupled_lr,
            decoupled_min_lr=o.decoupled_min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
            log_num_zeros_in_grad=cfg.log.log_num_zeros_in_grad,
        )
        self.megatron_optimizer = parts.get_optimizer(
            opt_config,
            [self.ddp],
            config_overrides=parts.config_overrides(opt_config),
            pg_collection=collection,
        )
        self.optimizer = _OptimizerState(self.megatron_optimizer)
        self.scheduler = build_scheduler(self.optimizer, o)
        config.finalize_model_grads_func = parts.finalize_model_grads
        config.grad_scale_func = self.megatron_optimizer.scale_loss
        if cfg.engine.overlap_grad_reduce:
            config.no_sync_func = self.ddp.no_sync
            config.grad_sync_func = self.ddp.start_grad_sync
        if cfg.engine.overlap_param_gather:
            config.param_sync_func = self.ddp.start_param_sync
        self.forward_backward = parts.forward_backward(pp_size=pg.pp_size, vp_size=None)
        self.device = next(model.parameters()).device
        self.num_zeros: Optional[int] = None  # in the latest step's gradients

    def _run(self, data_iterator: Iterator, num_microbatches: int, forward_only: bool) -> dict:
        b, p = self.cfg.batch, self.cfg.parallel
        reports = self.forward_backward(
            forward_step_func=self.forward_step,
            data_iterator=data_iterator,
            model=[self.ddp],
            num_microbatches=num_microbatches,
            seq_length=self.cfg.model.seq_length // p.context_parallel_size,
            micro_batch_size=b.micro_batch_size,
            forward_only=forward_only,
        )
        totals: dict[str, torch.Tensor] = {}
        for report in reports if self.pg.is_last_stage else ():
            add_reports(totals, report)
        return totals

    def step(
        self, data_iterator: Iterator, global_batch: int, flags: Sequence[bool] = ()
    ) -> StepResult:
        """See `Engine.step`."""
        b, p = self.cfg.batch, self.cfg.parallel
        self.timers.mark()
        self.ddp.zero_grad_buffer()
        self.megatron_optimizer.zero_grad()
        self.phase.set("forward-backward (megatron schedule)", self.pg.mp)
        totals = self._run(
            data_iterator, global_batch // (b.micro_batch_size * p.data_parallel_size), False
        )
        self.timers.mark("forward-backward")
        loss_ok = all_finite(totals.values())
        self.phase.set("all-reduce of the iteration's loss and exit flags (world group)")
        stats = self.world_stats(totals, [not loss_ok, *flags])
        loss = stats[0] / stats[1] if stats[1] > 0 and stats[2] == 0 else float("nan")
        if not math.isfinite(loss) and self.cfg.exit.check_for_nan_in_loss_and_grad:
            raise NonFiniteError(
                f"loss {loss} is not finite; stopped without saving (--ddp-impl megatron "
                "stops on a non-finite loss; its optimizer skips non-finite gradients)"
            )
        self.phase.set("megatron optimizer step (model-parallel group)", self.pg.mp)
        stepped, grad_norm, num_zeros = self.megatron_optimizer.step()
        self.num_zeros = None if num_zeros is None else int(num_zeros)
        grad_norm = float("nan") if grad_norm is None else float(grad_norm)
        if stepped:
            self.scheduler.step(increment=global_batch)
        self.timers.mark("optimizer")
        return StepResult(
            loss=loss,
            grad_norm=grad_norm,
            stepped=bool(stepped),
            skipped=not stepped,
            nonfinite=not stepped and not math.isfinite(grad_norm),
            lr=self.optimizer.get_lr(),
            flags=tuple(v > 0 for v in stats[3:]),
            note="megatron's optimizer skipped the step" if not stepped else "",
        )

    def _forward_only(self, data_iterator: Iterator) -> dict:
        return self._run(data_iterator, self.cfg.num_microbatches, True)

    def log_stats(self) -> dict[str, float]:
        """See `Engine.log_stats`."""
        log, out = self.cfg.log, {}
        if log.log_params_norm:  # of the float32 main parameters, which the optimizer updates
            params = [model_param for model_param, _ in self.optimizer.pairs]
            out["params-norm"] = params_norm(params, self.pg, self.optimizer.main_of)
        if log.log_num_zeros_in_grad and self.num_zeros is not None:
            out["num-zeros"] = float(self.num_zeros)
        return out

    def train(self, mode: bool = True) -> None:
        """Put the wrapped model in training (or evaluation) mode."""
        self.ddp.train(mode)

    @contextlib.contextmanager
    def checkpoint_view(self):
        """While checkpointing, each BF16 parameter shows its float32 main copy (so checkpoints
        hold the master weights); afterwards the BF16 parameters are refreshed from it."""
        swapped = []
        for model_param, main in self.optimizer.pairs:
            if main is not model_param:
                swapped.append((model_param, model_param.data))
                model_param.data = main.data
        try:
            yield
        finally:
            for model_param, data in swapped:
                data.copy_(model_param.data)
                model_param.data = data
