"""Gradient reductions Megatron performs after backward, before the optimizer step.

- Sequence-parallel replicated parameters (norm weights tagged `sequence_parallel`): each TP
  rank saw a different slice of the sequence, so their gradients are summed across TP.
- Tied embeddings split across pipeline stages (`shared_embedding`): the first stage's input
  table and the last stage's output head are one weight, so their gradients are summed over
  megatron's embedding group.
Data-parallel averaging is done by the data-parallel wrapper, not here.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["allreduce_sequence_parallel_grads", "allreduce_tied_embedding_grads"]


def _allreduce_coalesced(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def allreduce_sequence_parallel_grads(
    modules: Iterable[torch.nn.Module], tp_group: dist.ProcessGroup
) -> None:
    """Sum the gradients of parameters tagged `sequence_parallel` across `tp_group`."""
    if dist.get_world_size(tp_group) == 1:
        return
    grads = [
        p.grad
        for module in modules
        for p in module.parameters()
        if getattr(p, "sequence_parallel", False) and p.grad is not None
    ]
    _allreduce_coalesced(grads, tp_group)


def allreduce_tied_embedding_grads(
    modules: Iterable[torch.nn.Module], embd_group: Optional[dist.ProcessGroup]
) -> None:
    """Sum the gradient of a tied embedding held by both the first and last pipeline stage
    over `embd_group` (`ProcessGroups.embd`: None on the ranks that hold no copy)."""
    group = embd_group
    if group is None:
        return
    for module in modules:
        for param in module.parameters():
            if getattr(param, "shared_embedding", False) and param.grad is not None:
                dist.all_reduce(param.grad, group=group)
