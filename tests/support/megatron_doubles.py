"""CPU test doubles for megatron-core's CUDA-only training pieces, recording every call.

`training.megatron_engine.MegatronEngine` takes megatron-core's DDP, optimizer, schedule and
gradient finalisation from a `MegatronParts`. On CPU, `recording_parts()` returns one in which
those four are small doubles with megatron-core's call signatures and semantics:

- `RecordingDDP`: wraps the module; backward accumulates each gradient into `param.main_grad`
  (megatron's float32 gradient buffer) and drops `param.grad`; `finish_grad_sync` averages the
  main gradients over the data-parallel group, as megatron's DDP does;
- `RecordingOptimizer`: a ChainedOptimizer of one FP32Optimizer-like optimizer: megatron's own
  parameter groups (`_get_param_groups`: weight-decay and decoupled-lr groups from the
  config overrides the engine passes), torch AdamW on them, `step()` copying main gradients,
  clipping by the global norm and returning `(stepped, grad_norm, num_zeros)`;
- `recording_forward_backward`: `get_forward_backward_func(pp_size, vp_size)` returning
  megatron's no-pipelining schedule (loss / micro-batches, backward, then
  `config.finalize_model_grads_func`), for one pipeline stage;
- `recording_finalize_model_grads`: `finalize_model_grads(model_chunks, num_tokens)`.

Everything else (configs, Float16Module, the standard config overrides) is megatron-core's.
Each double appends `(name, details)` to the shared `CallLog`, so a test can assert the wiring.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import megatron_ext.megatron_import  # noqa: F401

import torch
import torch.distributed as dist
from megatron.core.optimizer import _get_param_groups

from megatron_ext.training.megatron_engine import MegatronParts
from megatron_ext.training.unique_params import counted_once

__all__ = ["CallLog", "RecordingDDP", "RecordingOptimizer", "recording_parts"]


class CallLog:
    """The calls the doubles received, in order: a list of (name, details dict)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def add(self, name: str, **details: Any) -> None:
        """Record one call."""
        self.calls.append((name, details))

    def names(self) -> list[str]:
        """The names of the calls, in order."""
        return [name for name, _ in self.calls]


class RecordingDDP(torch.nn.Module):
    """megatron's DistributedDataParallel reduced to its contract (see the module doc)."""

    def __init__(self, log: CallLog, *, config, ddp_config, module, pg_collection) -> None:
        super().__init__()
        self.log, self.config, self.ddp_config, self.module = log, config, ddp_config, module
        self.dp_group = pg_collection.dp_cp
        log.add("ddp.__init__", ddp_config=ddp_config, dp_size=dist.get_world_size(self.dp_group))
        for param in module.parameters():
            if param.requires_grad:
                param.main_grad = torch.zeros_like(param, dtype=torch.float32)
                param.register_post_accumulate_grad_hook(self._accumulate)

    @staticmethod
    def _accumulate(param: torch.Tensor) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None

    def forward(self, *args, **kwargs):
        """The wrapped module's forward."""
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self) -> None:
        """Zero the main gradients (megatron: the grad buffers)."""
        self.log.add("ddp.zero_grad_buffer")
        for param in self.module.parameters():
            if param.requires_grad:
                param.main_grad.zero_()

    @contextlib.contextmanager
    def no_sync(self):
        """megatron DDP's no_sync (recorded; nothing to defer here)."""
        self.log.add("ddp.no_sync")
        yield

    def start_grad_sync(self, *unused) -> None:
        """Recorded; the reduction happens in `finish_grad_sync`."""
        self.log.add("ddp.start_grad_sync")

    def start_param_sync(self, *unused, **unused_kw) -> None:
        """Recorded (no parameter gather without a distributed optimizer)."""
        self.log.add("ddp.start_param_sync")

    def finish_grad_sync(self) -> None:
        """Average the main gradients over the data-parallel group."""
        size = dist.get_world_size(self.dp_group)
        self.log.add("ddp.finish_grad_sync", dp_size=size)
        for param in self.module.parameters():
            if param.requires_grad and size > 1:
                param.main_grad.div_(size)
                dist.all_reduce(param.main_grad, group=self.dp_group)


class _FP32OptimizerDouble:
    """The one optimizer of the chain: torch AdamW on megatron's parameter groups."""

    def __init__(self, config, groups: list[dict]) -> None:
        self.config = config
        for group in groups:
            group.setdefault("lr", config.lr)
            group.setdefault("weight_decay", config.weight_decay)
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )


class RecordingOptimizer:
    """A ChainedOptimizer of one FP32Optimizer-like optimizer (see the module doc)."""

    def __init__(self, log: CallLog, config, model_chunks, config_overrides, pg_collection):
        self.log, self.config = log, config
        self.mp_group, self.tp_rank = pg_collection.mp, pg_collection.tp.rank()
        groups = _get_param_groups(model_chunks, config, config_overrides)
        log.add(
            "optimizer.__init__",
            groups=[
                dict(
                    n=len(g["params"]),
                    wd_mult=g.get("wd_mult"),
                    max_lr=g.get("max_lr"),
                    min_lr=g.get("min_lr"),
                )
                for g in groups
            ],
        )
        self.chained_optimizers = [_FP32OptimizerDouble(config, groups)]
        self.params = [p for g in groups for p in g["params"]]

    @property
    def param_groups(self) -> list[dict]:
        """All groups of the chained optimizers."""
        return [g for opt in self.chained_optimizers for g in opt.optimizer.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the `.grad` of every parameter (main gradients stay)."""
        self.log.add("optimizer.zero_grad")
        for param in self.params:
            param.grad = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """No loss scaling (float32)."""
        return loss

    def get_loss_scale(self) -> torch.Tensor:
        """No loss scaling: 1."""
        return torch.tensor([1.0])

    def step(self) -> tuple[bool, Optional[float], Optional[int]]:
        """Main gradients -> gradients, global-norm clipping, AdamW; megatron's return value."""
        for param in self.params:
            param.grad = param.main_grad.clone()
        local = sum(
            float(p.grad.double().square().sum())
            for p in self.params
            if counted_once(p, self.tp_rank)
        )
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total, group=self.mp_group)
        grad_norm = math.sqrt(total.item()) if math.isfinite(total.item()) else float("nan")
        num_zeros = None
        if self.config.log_num_zeros_in_grad:
            num_zeros = sum(int(p.grad.numel() - torch.count_nonzero(p.grad)) for p in self.params)
        self.log.add("optimizer.step", grad_norm=grad_norm)
        if not math.isfinite(grad_norm):
            return False, grad_norm, num_zeros
        if self.config.clip_grad > 0:
            coeff = self.config.clip_grad / (grad_norm + 1e-6)
            if coeff < 1.0:
                torch._foreach_mul_([p.grad for p in self.params], coeff)
        for opt in self.chained_optimizers:
            opt.optimizer.step()
        return True, grad_norm, num_zeros


def recording_forward_backward(log: CallLog):
    """`get_forward_backward_func` whose schedule is megatron's no-pipelining one."""

    def get(pp_size: Optional[int] = None, vp_size: Optional[int] = None):
        log.add("get_forward_backward_func", pp_size=pp_size, vp_size=vp_size)
        if pp_size not in (None, 1):
            raise NotImplementedError("the schedule double runs one pipeline stage")

        def forward_backward(
            *,
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            seq_length,
            micro_batch_size,
            forward_only=False,
            **unused,
        ):
            log.add(
                "forward_backward",
                num_microbatches=num_microbatches,
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=forward_only,
            )
            config = model[0].config
            reports = []
            for _ in range(num_microbatches):
                with torch.set_grad_enabled(not forward_only):
                    output, loss_func = forward_step_func(data_iterator, model[0])
                    loss, report = loss_func(output)
                    loss = loss / num_microbatches
                reports.append(report)
                if not forward_only:
                    if config.grad_scale_func is not None:
                        loss = config.grad_scale_func(loss)
                    loss.backward()
            if not forward_only:
                config.finalize_model_grads_func(model, None)
            return reports

        return forward_backward

    return get


def recording_finalize_model_grads(log: CallLog):
    """megatron's `finalize_model_grads`: finish each chunk's gradient sync (one stage, no
    sequence-parallel or tied-embedding reductions to do)."""

    def finalize_model_grads(model, num_tokens=None, pg_collection=None, **unused) -> None:
        log.add("finalize_model_grads", chunks=len(model))
        for chunk in model:
            chunk.finish_grad_sync()

    return finalize_model_grads


def recording_parts(log: CallLog):
    """A `MegatronParts` with the CUDA-only pieces replaced by the recording doubles."""

    def ddp(**kwargs):
        return RecordingDDP(log, **kwargs)

    def get_optimizer(config, model_chunks, config_overrides=None, pg_collection=None):
        return RecordingOptimizer(log, config, model_chunks, config_overrides, pg_collection)

    return MegatronParts(
        ddp=ddp,
        get_optimizer=get_optimizer,
        forward_backward=recording_forward_backward(log),
        finalize_model_grads=recording_finalize_model_grads(log),
    )
