"""Counting each parameter once over the model-parallel group (TP x PP).

Under tensor parallelism a parameter is either sharded (tagged `tensor_model_parallel` by
megatron: each TP rank holds a different slice) or replicated on every TP rank; under pipeline
parallelism with tied embeddings the last stage holds a copy of the first stage's table (tagged
`shared`). Sums over parameters (grad norm, params norm, zeros in grads, parameter counts)
count a parameter on a rank when `counted_once` says so, then sum over `ProcessGroups.mp`.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["counted_once", "counted_params", "unique_numel"]


def counted_once(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank counts `param`: TP shards on every rank, replicated parameters on TP
    rank 0 only, and never the last stage's copy of a tied embedding (the first stage counts
    it)."""
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def counted_params(params: Iterable[torch.Tensor], tp_rank: int) -> list[torch.Tensor]:
    """The parameters of `params` that this rank counts (see `counted_once`)."""
    return [p for p in params if counted_once(p, tp_rank)]


def unique_numel(model: torch.nn.Module, pg) -> int:
    """Parameters of the whole model (TP shards summed, replicas and the tied copy once);
    collective over `pg.mp`."""
    total = sum(p.numel() for p in counted_params(model.parameters(), pg.tp_rank))
    count = torch.tensor([float(total)], dtype=torch.float64)
    if torch.cuda.is_available():
        count = count.cuda()
    dist.all_reduce(count, group=pg.mp)
    return int(count.item())
