"""Data-parallel gradient averaging of the portable engine over `pg.dp_cp`: torch's
`DistributedDataParallel` around each pipeline stage (`wrap`), whose communication hook
(`GradientAverage`) notes whether this rank's gradients were finite (a NaN's message names its
rank) and with --grad-reduce-in-bf16 sends BF16; and `GradientAverage.average_params` for the
gradients deferred past DDP (`engine.ModuleHooks`).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["GradientAverage", "wrap"]


class GradientAverage:
    """Averages gradients over `group` (sent as `reduce_dtype` when given) and records whether
    this rank's own gradients were all finite since `finite` was last set to True."""

    def __init__(self, group: dist.ProcessGroup, reduce_dtype: Optional[torch.dtype]) -> None:
        self.group, self.reduce_dtype = group, reduce_dtype
        self.finite = True

    def average(self, flat: torch.Tensor) -> torch.futures.Future:
        """Start averaging the 1-D gradient buffer `flat` in place; the future's value is
        `flat`, averaged."""
        if not bool(torch.isfinite(flat).all()):
            self.finite = False
        flat.div_(dist.get_world_size(self.group))
        wire = flat if self.reduce_dtype in (None, flat.dtype) else flat.to(self.reduce_dtype)
        future = dist.all_reduce(wire, group=self.group, async_op=True).get_future()

        def unpack(done):
            reduced = done.value()[0]
            if reduced is not flat:
                flat.copy_(reduced)
            return flat

        return future.then(unpack)

    def average_params(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Average the gradients of `params` in one all-reduce (a missing gradient counts as
        zeros, so that every rank reduces and steps the same set)."""
        grads = []
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        if not grads:
            return
        flat = self.average(torch.cat([g.reshape(-1) for g in grads])).wait()
        for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(part.view_as(grad))


def _average_hook(state, bucket):  # annotations left off: DDP checks them at run time
    """DDP communication hook: `GradientAverage.average` of one bucket."""
    return state.average(bucket.buffer())


def wrap(module: torch.nn.Module, average: GradientAverage) -> DistributedDataParallel:
    """torch DDP over `module`'s parameters and `average.group`, averaging through `average`
    (every data-parallel rank built the same weights from the same seed: no initial sync; a
    `ChunkStage` has no buffers to sync)."""
    ddp = DistributedDataParallel(
        module, process_group=average.group, forward_sync_buffers=False, init_sync=False
    )
    ddp.register_comm_hook(average, _average_hook)
    return ddp
