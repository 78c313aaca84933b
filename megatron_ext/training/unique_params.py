"""Sums over parameters that count each parameter once over the model-parallel group (TP x PP):
the parameter count, params norm and zeros in gradients here, the grad norm in `optimizer`. A
parameter is a TP shard (tagged `tensor_model_parallel` by megatron), replicated on every TP
rank, or the last stage's copy of a tied embedding (tagged `shared`).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist

__all__ = [
    "counted_once",
    "counted_params",
    "model_parallel_sum",
    "num_zeros_in_grad",
    "params_norm",
    "unique_numel",
]


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


def model_parallel_sum(value: float, pg) -> float:
    """`value` summed over `pg.mp` in float64 (collective)."""
    total = torch.tensor([value], dtype=torch.float64)
    if torch.cuda.is_available():
        total = total.cuda()
    dist.all_reduce(total, group=pg.mp)
    return float(total.item())


def unique_numel(model: torch.nn.Module, pg) -> int:
    """Parameters of the whole model (TP shards summed, replicas and the tied copy once)."""
    count = sum(p.numel() for p in counted_params(model.parameters(), pg.tp_rank))
    return int(model_parallel_sum(count, pg))


def params_norm(params, pg, main_of: Optional[dict[int, torch.Tensor]] = None) -> float:
    """L2 norm of the model's parameters (DP replicas are identical); a parameter with a float32
    master copy in `main_of` (id(param) -> copy) counts the copy."""
    main_of = main_of or {}
    counted = counted_params(params, pg.tp_rank)
    local = sum(float(main_of.get(id(p), p).detach().double().square().sum()) for p in counted)
    return math.sqrt(model_parallel_sum(local, pg))


def num_zeros_in_grad(params, pg) -> int:
    """Gradient entries equal to zero (after the data-parallel reduction and clipping)."""
    grads = [p.grad for p in counted_params(params, pg.tp_rank) if p.grad is not None]
    return int(model_parallel_sum(sum(int(g.numel() - torch.count_nonzero(g)) for g in grads), pg))
