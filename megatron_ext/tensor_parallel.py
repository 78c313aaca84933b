"""Portable sequence-parallel communication and the parallel layers that use it.

megatron-core's sequence-parallel mappings and linear autograd function allocate their outputs
on `torch.cuda.current_device()`, so sequence parallelism fails on CPU. The functions here do
the same collectives on the input's device, and the `Portable*` layers route through them on
CPU while keeping megatron's own path on CUDA.

Layouts: "sequence parallel" tensors are [s/tp, b, h]; "tensor parallel" ones [s, b, h/tp].
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import megatron_ext.megatron_import  # noqa: F401

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel as mcore_tp
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.utils import VocabUtility

from megatron_ext import cpu_accel

logger = logging.getLogger(__name__)

__all__ = [
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "PortableColumnParallelLinear",
    "PortableRowParallelLinear",
    "PortableVocabParallelEmbedding",
    "adopt",
    "check_sequence_split",
    "vocab_parallel_cross_entropy",
    "chunked_head_cross_entropy",
    "model_tp_size_rank",
]


def model_tp_size_rank(
    model: torch.nn.Module, tp_group: Optional[dist.ProcessGroup]
) -> tuple[int, int]:
    """(size, rank) of `model`'s tensor-parallel group `tp_group` (`ProcessGroups.tp`); None
    means (1, 0), refused when the model's config says it is split (a shard is not the whole)."""
    if tp_group is not None:
        return dist.get_world_size(tp_group), dist.get_rank(tp_group)
    model_tp = getattr(getattr(model, "config", None), "tensor_model_parallel_size", 1) or 1
    if model_tp > 1:
        raise ValueError(
            f"the model is split over {model_tp} tensor-parallel ranks; pass its tp_group "
            "(ProcessGroups.tp)"
        )
    return 1, 0


def check_sequence_split(length: int, tp_size: int) -> None:
    """Raise ValueError unless a sequence of `length` splits into `tp_size` equal parts (the
    [s/tp, b, h] layout of sequence parallelism)."""
    if length % tp_size:
        raise ValueError(
            f"sequence length {length} is not divisible by the tensor-parallel size {tp_size}"
            " under sequence parallelism; change --seq-length"
        )


# torch 2.13 renamed the tensor collectives and warns on every call of the old names; NGC's
# torch may predate the new ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_first(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = torch.empty((x.size(0) * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    check_sequence_split(x.size(0), size)
    out = torch.empty((x.size(0) // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def _all_gather_last(x: torch.Tensor, group) -> torch.Tensor:
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, x.contiguous(), group=group)
    return torch.cat(shards, dim=-1)


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return torch.chunk(x, size, dim=-1)[rank].contiguous()


class _Collective(torch.autograd.Function):
    """One collective forward, its adjoint backward (e.g. all-gather <-> reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, forward_fn, backward_fn):
        ctx.group, ctx.backward_fn = group, backward_fn
        return forward_fn(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad, ctx.group), None, None, None


def _communicate(x: torch.Tensor, group, forward_fn, backward_fn) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _Collective.apply(x, group, forward_fn, backward_fn)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """[s/tp, b, h] -> [s, b, h]; backward reduce-scatters the gradient."""
    return _communicate(x, group, _all_gather_first, _reduce_scatter_first)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums [s, b, h] -> summed slice [s/tp, b, h]; backward all-gathers."""
    return _communicate(x, group, _reduce_scatter_first, _all_gather_first)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """[..., h/tp] -> [..., h]; backward keeps this rank's slice of the gradient."""
    return _communicate(x, group, _all_gather_last, _split_last)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """megatron's `_VocabParallelCrossEntropy` (no label smoothing) with its own helpers, bit
    for bit, less three passes over the [s, b, V/tp] float32 logits: the row maximum by `amax`
    (not the arg-max too), no all-reduce on a one-rank group, and no softmax without autograd.
    """

    @staticmethod
    def forward(ctx, logits, target, group):
        logits = logits.float()
        logits_max = logits.amax(dim=-1)
        size, rank = (1, 0) if group is None else (group.size(), group.rank())
        if size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.size(-1), rank, size
        )
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(
                logits, target, logits_max, start, end
            )
        )
        if size > 1:
            dist.all_reduce(predicted, group=group)
            dist.all_reduce(sum_exp, group=group)
        if not ctx.needs_input_grad[0]:
            return torch.log(sum_exp) - predicted
        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(
            exp_logits, predicted, sum_exp
        )
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, update, grad_input = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask)
        )
        grad_input = VocabParallelCrossEntropy.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, update, grad_input, grad_output
        )
        return grad_input, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """Per-token cross entropy [s, b] of logits [s, b, V/tp] split over the vocabulary across
    `group` (None: not split) against target ids [s, b]; megatron's
    `tensor_parallel.vocab_parallel_cross_entropy` with fewer passes over the logits (see
    `_VocabParallelCrossEntropy`)."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)


def chunked_head_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, rows: int = 256
) -> torch.Tensor:
    """Per-token cross entropy [s, b] of the output head `hidden @ weight.T` (hidden
    [s, b, h], weight [V, h], target ids [s, b]) without autograd and without the [s, b, V]
    logits: `rows` rows at a time, each chunk's loss taken while it is in cache (by
    `cpu_accel.cross_entropy` for float32 CPU logits, else `vocab_parallel_cross_entropy`).

    Raises:
        IndexError: a target id outside [0, V).
    """
    if torch.is_grad_enabled():
        raise RuntimeError("chunked_head_cross_entropy is forward-only; run it under no_grad")
    s, b, h = hidden.shape
    flat = hidden.reshape(s * b, h)
    flat_target = target.reshape(s * b)
    vocab = weight.size(0)
    if flat_target.numel() and (int(flat_target.min()) < 0 or int(flat_target.max()) >= vocab):
        bad = flat_target[(flat_target < 0) | (flat_target >= vocab)][0]
        raise IndexError(f"target id {int(bad)} is out of range for a vocabulary of {vocab}")
    loss = torch.empty(s * b, dtype=torch.float32, device=hidden.device)
    kernel = cpu_accel.cross_entropy_kernel()
    for start in range(0, s * b, rows):
        end = min(start + rows, s * b)
        logits = F.linear(flat[start:end], weight)  # its dtype follows autocast, if enabled
        if kernel is not None and _chunk_kernel_error(logits.device.type, logits.dtype) is None:
            kernel.cross_entropy(logits, flat_target[start:end], out=loss[start:end])
        else:
            loss[start:end] = vocab_parallel_cross_entropy(logits, flat_target[start:end], None)
    return loss.view(s, b)


@functools.lru_cache(maxsize=None)
def _chunk_kernel_error(device: str, dtype: torch.dtype) -> Optional[str]:
    """None when `chunked_head_cross_entropy` can use the compiled kernel for logits of this
    device and dtype, else the reason, logged once per (device, dtype) and process."""
    kernel = cpu_accel.cross_entropy_kernel()
    level = logging.WARNING  # a kernel that does not build
    if device != "cpu" or dtype != torch.float32:
        # the run's own choice (--bf16 autocast, CUDA): nothing to act on, not shown
        reason, level = f"it takes float32 CPU logits, not {dtype} on {device}", logging.DEBUG
    elif kernel is None:
        reason, level = cpu_accel.OFF, logging.INFO  # turned off on purpose: a note
    else:
        reason = kernel.kernel_error()
    if reason is not None:
        logger.log(
            level,
            "the scoring loss uses vocab_parallel_cross_entropy per chunk instead of the "
            "compiled CPU cross-entropy kernel: %s",
            reason,
        )
    return reason


def adopt(cls: type, module: torch.nn.Module) -> torch.nn.Module:
    """Re-wrap an already built megatron layer as its portable subclass `cls`, sharing every
    parameter and attribute (no copy, no re-initialisation)."""
    if not isinstance(module, cls.__mro__[1]):
        raise TypeError(f"{cls.__name__} can only adopt a {cls.__mro__[1].__name__}")
    twin = cls.__new__(cls)
    twin.__dict__.update(module.__dict__)
    if isinstance(twin, _MarksLayoutWithoutInit):
        twin.mark_layout_without_init()
    return twin


class _MarksLayoutWithoutInit:
    """megatron's layers set their weight's layout attributes (partition dim, stride) only while
    drawing its initial values; a model built to be loaded (no draw) still needs them."""

    partition_dim = 0
    stride = 1

    def mark_layout_without_init(self) -> None:
        weight = getattr(self, "weight", None)
        if weight is not None and not hasattr(weight, "tensor_model_parallel"):
            mcore_tp.set_tensor_model_parallel_attributes(
                weight, True, self.partition_dim, self.stride
            )


def _forward_only_single_rank(layer) -> bool:
    """True when a CPU linear may skip megatron's communication wrappers (identities here, but
    autograd-Function calls that dominate a CPU decoding step): no autograd, one TP rank."""
    if torch.is_grad_enabled() or layer.sequence_parallel:
        return False
    single = layer.__dict__.get("_tp_single_rank")
    if single is None:
        single = layer.__dict__["_tp_single_rank"] = layer.tp_group.size() == 1
    return single


class PortableColumnParallelLinear(mcore_tp.ColumnParallelLinear, _MarksLayoutWithoutInit):
    """megatron's ColumnParallelLinear; on CPU its matmul and communication avoid CUDA."""

    def __init__(self, *args, stride: int = 1, **kwargs) -> None:
        super().__init__(*args, stride=stride, **kwargs)
        self.stride = stride  # SwiGLU's fc1 (2): its shards interleave gate and up
        self.mark_layout_without_init()

    def _forward_impl(self, input, weight, bias=None, **kwargs):
        if input.is_cuda:
            return super()._forward_impl(input, weight, bias=bias, **kwargs)
        tp_group = kwargs.get("tp_group")
        tp_group = self.tp_group if tp_group is None else tp_group
        if kwargs.get("sequence_parallel"):
            input = gather_from_sequence_parallel_region(input, tp_group)
        elif kwargs.get("allreduce_dgrad"):
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        return F.linear(input, weight, bias)

    def forward(self, input_, weight=None, runtime_gather_output: Optional[bool] = None):
        """megatron's forward on CUDA; on CPU the same math with portable collectives."""
        if input_.is_cuda:
            return super().forward(input_, weight, runtime_gather_output)
        if (
            _forward_only_single_rank(self)
            and not self.config.defer_embedding_wgrad_compute
            and (
                weight is None or weight.shape == (self.output_size_per_partition, self.input_size)
            )
        ):
            weight = self.weight if weight is None else weight
            output = F.linear(input_, weight, None if self.skip_bias_add else self.bias)
            return output, self.bias if self.skip_bias_add else None
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        output, output_bias = super().forward(input_, weight, runtime_gather_output=False)
        if gather:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
        return output, output_bias


class PortableRowParallelLinear(mcore_tp.RowParallelLinear, _MarksLayoutWithoutInit):
    """megatron's RowParallelLinear; on CPU the sequence-parallel reduce-scatter avoids CUDA."""

    partition_dim = 1

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mark_layout_without_init()

    def forward(self, input_):
        """On CUDA megatron's forward; on CPU matmul + portable all-reduce/reduce-scatter."""
        if input_.is_cuda:
            return super().forward(input_)
        if not self.input_is_parallel:
            raise ValueError("the portable RowParallelLinear expects input_is_parallel=True")
        output = F.linear(input_, self.weight)
        if _forward_only_single_rank(self):
            pass
        elif self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output, self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(output, group=self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


class PortableVocabParallelEmbedding(mcore_tp.VocabParallelEmbedding, _MarksLayoutWithoutInit):
    """megatron's VocabParallelEmbedding; on CPU the sequence-parallel reduce-scatter avoids
    CUDA. Out-of-range ids are an error here rather than a silent zero row."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mark_layout_without_init()

    def forward(self, input_):
        """Look ids up after a range check; on CPU under SP a portable reduce-scatter."""
        if input_.numel() and (input_.min() < 0 or input_.max() >= self.num_embeddings):
            bad = input_[(input_ < 0) | (input_ >= self.num_embeddings)][0].item()
            raise IndexError(
                f"token id {bad} is outside the vocabulary [0, {self.num_embeddings}); check "
                "the tokenizer and --vocab-size"
            )
        if input_.is_cuda or not self.reduce_scatter_embeddings:
            return super().forward(input_)
        sharded = self.tp_group.size() > 1
        if sharded:
            mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            masked = (input_ - self.vocab_start_index).masked_fill(mask, 0)
        else:
            masked = input_
        output = F.embedding(masked, self.weight)
        if sharded:
            output = output.masked_fill(mask.unsqueeze(-1), 0.0)
        # [b, s, h] -> [s, b, h], then sum the vocabulary shards into this rank's sequence slice.
        output = output.transpose(0, 1).contiguous()
        return reduce_scatter_to_sequence_parallel_region(output, self.tp_group)
