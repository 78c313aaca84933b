"""Full (unsharded, single-device) parameters of a tensor/pipeline-parallel model and back.

A stride-s parameter (SwiGLU's fc1: s=2, gate|up) is the full tensor cut along
`partition_dim` into s*tp equal pieces, rank r holding pieces r, r+tp, ... in order; stride 1
is a plain contiguous split. Layer names are made global with each layer's `layer_number`, so
a pipeline stage's `decoder.layers.0` is `decoder.layers.{offset}`. The caller passes the
tensor-parallel group (`ProcessGroups.tp`; None: whole tensors, refused by a TP>1 model).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_ext.models.te_mapping import LAYER_NAME, canonical_param_name
from megatron_ext.tensor_parallel import model_tp_size_rank

__all__ = [
    "tp_layout",
    "tp_shard",
    "tp_unshard",
    "global_param_name",
    "is_tied_copy",
    "layout_free_name",
    "gather_full_state_dict",
    "load_full_state_dict",
]


def tp_layout(param: torch.Tensor) -> Optional[tuple[int, int]]:
    """(partition_dim, partition_stride) of a tensor-parallel parameter, None if replicated."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return int(param.partition_dim), int(getattr(param, "partition_stride", 1))


def tp_shard(full: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """This rank's shard of a full tensor (megatron's strided split)."""
    pieces = torch.chunk(full, stride * size, dim=dim)
    if len(pieces) != stride * size or full.size(dim) % (stride * size):
        raise ValueError(
            f"dimension {dim} of size {full.size(dim)} does not split into {stride}x{size} pieces"
        )
    return torch.cat(pieces[rank::size], dim=dim)


def tp_unshard(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of `tp_shard` given every rank's shard in rank order."""
    per_rank = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([per_rank[r][k] for k in range(stride) for r in range(len(shards))], dim=dim)


def global_param_name(model: torch.nn.Module, local_name: str) -> str:
    """Map a pipeline stage's local parameter name to the single-stage model's name.

    Transformer Engine spec names become local-spec names (`te_mapping`), so checkpoints and
    full state dicts are the same for both specs.
    """
    match = LAYER_NAME.match(local_name)
    if match is None:
        return canonical_param_name(local_name)
    prefix, index, rest = match.groups()
    layers = model.get_submodule(prefix.rstrip("."))
    global_index = layers[int(index)].layer_number - 1
    return canonical_param_name(f"{prefix}{global_index}.{rest}")


def is_tied_copy(model: torch.nn.Module, name: str) -> bool:
    """The last stage's copy of a tied embedding, which the full model does not have."""
    return (
        name == "output_layer.weight"
        and getattr(model, "share_embeddings_and_output_weights", False)
        and not getattr(model, "pre_process", True)
    )


def layout_free_name(model: torch.nn.Module, local_name: str) -> str:
    """The single-stage name of a parameter; a tied head copy maps to the input table."""
    if is_tied_copy(model, local_name):
        return "embedding.word_embeddings.weight"
    return global_param_name(model, local_name)


def gather_full_state_dict(
    model: torch.nn.Module, tp_group: Optional[dist.ProcessGroup], grads: bool = False
) -> dict[str, torch.Tensor]:
    """This pipeline stage's parameters (or their `.grad` with grads=True), unsharded across
    TP, under global names, on CPU. Every rank of the TP group gets the same dict. A tensor
    that needed no gather (TP=1, or a replicated parameter) on CPU shares its storage with the
    parameter: read it, do not modify it in place.
    """
    tp_size, _ = model_tp_size_rank(model, tp_group)
    full: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if is_tied_copy(model, name):
            continue
        tensor = param.grad if grads else param.detach()
        if tensor is None:
            continue
        layout = tp_layout(param)
        if layout is not None and tp_size > 1:
            shards = [torch.empty_like(tensor) for _ in range(tp_size)]
            dist.all_gather(shards, tensor.contiguous(), group=tp_group)
            tensor = tp_unshard(shards, *layout)
        # Not copied: a second copy of every weight would double an export's memory at 1.2B.
        full[global_param_name(model, name)] = tensor.cpu()
    return full


def load_full_state_dict(
    model: torch.nn.Module,
    full: dict[str, torch.Tensor],
    tp_group: Optional[dist.ProcessGroup],
    strict: bool = True,
) -> None:
    """Copy full parameters into this rank's shards (the inverse of `gather_full_state_dict`);
    `tp_group` as there."""
    tp_size, tp_rank = model_tp_size_rank(model, tp_group)
    for name, param in model.named_parameters():
        key = layout_free_name(model, name)
        if key not in full:
            if strict:
                raise KeyError(f"parameter {key} is missing from the full state dict")
            continue
        value = full[key]
        layout = tp_layout(param)
        if layout is not None and tp_size > 1:
            value = tp_shard(value, *layout, rank=tp_rank, size=tp_size)
        if value.shape != param.shape:
            raise ValueError(
                f"{key}: full shape gives {tuple(value.shape)}, model has {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(value)
