"""Megatron's gradient sums after backward, before the optimizer step (data-parallel averaging
is the data-parallel wrapper's): sequence-parallel replicated parameters (tagged
`sequence_parallel`: each TP rank saw another slice of the sequence) over TP, and a tied
embedding split across pipeline stages (`shared_embedding`: the first stage's input table and
the last stage's head are one weight) over megatron's embedding group.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["allreduce_sequence_parallel_grads", "allreduce_tied_embedding_grads"]


def _allreduce_tagged(modules: Iterable[torch.nn.Module], tag: str, group) -> None:
    """Sum over `group`, in one all-reduce, the gradients of the parameters tagged `tag`."""
    grads = [
        p.grad
        for module in modules
        for p in module.parameters()
        if getattr(p, tag, False) and p.grad is not None
    ]
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
    if dist.get_world_size(tp_group) > 1:
        _allreduce_tagged(modules, "sequence_parallel", tp_group)


def allreduce_tied_embedding_grads(
    modules: Iterable[torch.nn.Module], embd_group: Optional[dist.ProcessGroup]
) -> None:
    """Sum the gradient of a tied embedding held by both the first and last pipeline stage
    over `embd_group` (`ProcessGroups.embd`: None on the ranks that hold no copy)."""
    if embd_group is not None:
        _allreduce_tagged(modules, "shared_embedding", embd_group)
