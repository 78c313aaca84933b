"""Forward/backward over the micro-batches of one iteration: gradient accumulation, and
compact 1F1B and interleaved 1F1B pipeline schedules on torch.distributed point-to-point ops
(gloo and NCCL alike).

With one pipeline stage the schedule is plain gradient accumulation (forward and backward of
each micro-batch in turn). With P stages, stage r runs min(P - r - 1, M) warm-up forwards,
then alternates one forward and one backward, then drains the remaining backwards (Megatron's
non-interleaved 1F1B). Activations travel as [s, b, h] tensors ([s/tp, b, h] under sequence
parallelism, s/cp under context parallelism) in float32; a send is always posted together with
the matching receive of the step (`_exchange`), which keeps neighbouring stages deadlock-free.

With V model chunks per rank (virtual pipeline stages, --num-layers-per-virtual-pipeline-stage)
the P ranks form a ring of P x V stages: chunk c of rank r is virtual stage c * P + r, and the
last rank's chunk c hands its activations to the first rank's chunk c + 1. The order of
forwards and backwards is Megatron-LM's interleaved 1F1B (`_interleaved`): micro-batches go
through in groups of P, each group through chunk 0, then chunk 1, ...; warm-up is
2 (P - r - 1) + (V - 1) P forwards. The number of micro-batches must be a multiple of P.

The forward step follows Megatron-LM's contract:
    forward_step(data_iterator, model) -> (output_tensor, loss_func)
    loss_func(output_tensor) -> (loss, reports)
where `loss` is the micro-batch's scalar loss and `reports` maps names to detached [sum, count]
tensors. The schedule divides the loss by the number of micro-batches (and multiplies it by the
FP16 loss scale) before backward, and returns the reports summed over micro-batches.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_ext.parallel import ProcessGroups

__all__ = ["forward_backward", "PipelineShape"]

_FORWARD_TAG, _BACKWARD_TAG = 0, 1

ForwardStep = Callable[[Iterator, torch.nn.Module], tuple[torch.Tensor, Callable]]


class PipelineShape:
    """Shape and dtype of the activation tensors exchanged between pipeline stages."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = tuple(shape), dtype, device

    def empty(self) -> torch.Tensor:
        """An uninitialised receive buffer of this shape, dtype and device."""
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


def _exchange(send: list[tuple[torch.Tensor, int]], recv: list[tuple[torch.Tensor, int]]) -> None:
    """Post every send and receive, then wait for all of them."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in send]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recv]
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()


class _P2P:
    def __init__(self, shape: Optional[PipelineShape], pg: ProcessGroups) -> None:
        self.shape = shape
        self.first, self.last = pg.is_first_stage, pg.is_last_stage
        if not (self.first and self.last):
            self.prev, self.next = pg.pp_neighbour(-1), pg.pp_neighbour(1)

    def run(
        self,
        send_next: Optional[torch.Tensor] = None,
        send_prev: Optional[torch.Tensor] = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        sends, recvs = [], []
        from_prev = from_next = None
        if send_next is not None and not self.last:
            sends.append((send_next.detach().to(self.shape.dtype), self.next))
        if send_prev is not None and not self.first:
            sends.append((send_prev.detach().to(self.shape.dtype), self.prev))
        if recv_prev and not self.first:
            from_prev = self.shape.empty()
            recvs.append((from_prev, self.prev))
        if recv_next and not self.last:
            from_next = self.shape.empty()
            recvs.append((from_next, self.next))
        _exchange(sends, recvs)
        return from_prev, from_next


class _RingP2P:
    """Point-to-point ops between ring neighbours (the last stage's next is the first stage):
    the interleaved schedule decides itself which sends and receives a step has.

    Forward-direction messages (activations) are posted before backward-direction ones
    (gradients) on every rank, and tagged apart: with two stages `prev` and `next` are one
    peer, and each channel must see its sends and receives in the same order."""

    def __init__(self, shape: PipelineShape, pg: ProcessGroups) -> None:
        self.shape = shape
        self.prev, self.next = pg.pp_neighbour(-1), pg.pp_neighbour(1)

    def run(
        self,
        send_next: Optional[torch.Tensor] = None,
        send_prev: Optional[torch.Tensor] = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        ops = []
        from_prev = self.shape.empty() if recv_prev else None
        from_next = self.shape.empty() if recv_next else None
        if send_next is not None:
            wire = send_next.detach().to(self.shape.dtype).contiguous()
            ops.append(dist.P2POp(dist.isend, wire, self.next, tag=_FORWARD_TAG))
        if from_prev is not None:
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev, tag=_FORWARD_TAG))
        if send_prev is not None:
            wire = send_prev.detach().to(self.shape.dtype).contiguous()
            ops.append(dist.P2POp(dist.isend, wire, self.prev, tag=_BACKWARD_TAG))
        if from_next is not None:
            ops.append(dist.P2POp(dist.irecv, from_next, self.next, tag=_BACKWARD_TAG))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return from_prev, from_next


class _SharedBatches:
    """One iteration's micro-batches read once from `source` and replayed to every model
    chunk in order: each chunk's forward step reads micro-batch j on its j-th call."""

    def __init__(self, source: Iterator, num_chunks: int) -> None:
        self.source, self.batches, self.read = source, [], [0] * num_chunks

    def iterator(self, chunk: int) -> Iterator:
        """The data iterator handed to `forward_step` for model chunk `chunk`."""
        return _ChunkBatches(self, chunk)


class _ChunkBatches:
    """`_SharedBatches.iterator(chunk)`. A module-level class, not one made per call: a class
    lives in a reference cycle, so a per-call class closing over the shared batches kept the
    data iterator (and its DataLoader worker processes) alive until a garbage collection, and
    at interpreter exit multiprocessing joined those workers before they were told to stop."""

    def __init__(self, shared: _SharedBatches, chunk: int) -> None:
        self.shared, self.chunk = shared, chunk

    def __iter__(self) -> "_ChunkBatches":
        return self

    def __next__(self):
        shared = self.shared
        index = shared.read[self.chunk]
        shared.read[self.chunk] += 1
        while len(shared.batches) <= index:
            shared.batches.append(next(shared.source))
        return shared.batches[index]


def _accumulate(totals: dict[str, torch.Tensor], reports: dict[str, torch.Tensor]) -> None:
    for name, value in reports.items():
        value = value.detach().to(torch.float64)
        totals[name] = totals[name] + value if name in totals else value


def forward_backward(
    *,
    forward_step: ForwardStep,
    data_iterator: Iterator,
    model: torch.nn.Module | Sequence[torch.nn.Module],
    num_microbatches: int,
    shape: Optional[PipelineShape],
    pg: ProcessGroups,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
    per_token_loss: bool = False,
    no_sync: Optional[Callable[[], ContextManager]] = None,
) -> dict[str, torch.Tensor]:
    """Run one iteration's micro-batches through this stage (forward, and backward unless
    `forward_only`); gradients accumulate in `param.grad`. `pg.pp` orders the stages.

    `model` is this stage's module, or its model chunks (virtual pipeline stages, in order):
    more than one chunk runs the interleaved 1F1B schedule.

    `no_sync` (one pipeline stage only: torch DDP's `no_sync`) wraps the forward and backward
    of every micro-batch but the last, so that DDP reduces the accumulated gradients once,
    overlapped with the last backward.

    With `per_token_loss` (--calculate-per-token-loss) the losses are token sums and are not
    divided by the number of micro-batches; the caller divides the gradients by the token count.

    Returns:
        on the last pipeline stage, `reports` summed over micro-batches (float64); elsewhere {}.
    """
    divisor = 1 if per_token_loss else num_microbatches
    if isinstance(model, Sequence):
        if len(model) > 1:
            if no_sync is not None:
                raise ValueError("forward_backward: no_sync needs a single pipeline stage")
            return _interleaved(
                forward_step=forward_step,
                data_iterator=data_iterator,
                chunks=list(model),
                num_microbatches=num_microbatches,
                shape=shape,
                pg=pg,
                forward_only=forward_only,
                loss_scale=loss_scale / divisor,
                autocast=autocast,
            )
        model = model[0]
    p2p = _P2P(shape, pg)
    totals: dict[str, torch.Tensor] = {}
    pp_size = pg.pp_size
    grad_ctx = torch.no_grad if forward_only else contextlib.nullcontext

    def forward(input_tensor: Optional[torch.Tensor]) -> Any:
        if not p2p.first:
            model.set_input_tensor(input_tensor)
        with grad_ctx(), autocast():
            output, loss_func = forward_step(data_iterator, model)
        if p2p.last:
            with grad_ctx():
                loss, reports = loss_func(output)
            _accumulate(totals, reports)
            return loss * (loss_scale / divisor)
        return output.float() if output.dtype != torch.float32 else output

    def backward(
        input_tensor: Optional[torch.Tensor],
        output: torch.Tensor,
        output_grad: Optional[torch.Tensor],
    ) -> Optional[torch.Tensor]:
        torch.autograd.backward(output, grad_tensors=output_grad)
        return None if input_tensor is None else input_tensor.grad

    def received(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if tensor is not None and not forward_only:
            tensor.requires_grad_(True)
        return tensor

    if forward_only or pp_size == 1:
        for i in range(num_microbatches):
            accumulate = no_sync is not None and not forward_only and i < num_microbatches - 1
            with no_sync() if accumulate else contextlib.nullcontext():
                input_tensor = received(p2p.run(recv_prev=True)[0])
                output = forward(input_tensor)
                if forward_only:
                    p2p.run(send_next=output)
                else:
                    backward(input_tensor, output, None)
        return totals
    if no_sync is not None:
        raise ValueError("forward_backward: no_sync needs a single pipeline stage")

    rank = pg.pp_rank
    warmup = min(pp_size - rank - 1, num_microbatches)
    steady = num_microbatches - warmup
    inputs: list[Optional[torch.Tensor]] = []
    outputs: list[torch.Tensor] = []

    for _ in range(warmup):
        input_tensor = received(p2p.run(recv_prev=True)[0])
        output = forward(input_tensor)
        p2p.run(send_next=output)
        inputs.append(input_tensor)
        outputs.append(output)

    input_tensor = received(p2p.run(recv_prev=True)[0]) if steady else None
    for i in range(steady):
        output = forward(input_tensor)
        output_grad = p2p.run(send_next=output, recv_next=True)[1]
        inputs.append(input_tensor)
        outputs.append(output)
        input_grad = backward(inputs.pop(0), outputs.pop(0), output_grad)
        if i == steady - 1:
            p2p.run(send_prev=input_grad)
            input_tensor = None
        else:
            input_tensor = received(p2p.run(send_prev=input_grad, recv_prev=True)[0])

    for _ in range(warmup):
        output_grad = p2p.run(recv_next=True)[1]
        input_grad = backward(inputs.pop(0), outputs.pop(0), output_grad)
        p2p.run(send_prev=input_grad)
    return totals


def _interleaved(
    *,
    forward_step: ForwardStep,
    data_iterator: Iterator,
    chunks: list[torch.nn.Module],
    num_microbatches: int,
    shape: PipelineShape,
    pg: ProcessGroups,
    forward_only: bool,
    loss_scale: float,
    autocast: Callable[[], ContextManager],
) -> dict[str, torch.Tensor]:
    """Megatron-LM's interleaved 1F1B over this rank's `chunks` (see the module doc).

    Virtual micro-batch k (0 <= k < M V) is micro-batch (k // (P V)) P + k % P through chunk
    (k % (P V)) // P going forward, and through the mirrored chunk going backward. Each step
    posts its sends with the receives of the next step's inputs, as Megatron-LM does.
    `loss_scale` multiplies the last virtual stage's loss before backward."""
    P, V, M = pg.pp_size, len(chunks), num_microbatches
    if M % P:
        raise ValueError(
            f"the interleaved pipeline schedule needs the number of micro-batches ({M}) to be "
            f"a multiple of the pipeline size ({P}); change --global-batch-size"
        )
    first_rank, last_rank = pg.is_first_stage, pg.is_last_stage
    ring = _RingP2P(shape, pg)
    batches = _SharedBatches(data_iterator, V)
    iterators = [batches.iterator(c) for c in range(V)]
    totals: dict[str, torch.Tensor] = {}
    grad_ctx = torch.no_grad if forward_only else contextlib.nullcontext
    inputs: list[list[Optional[torch.Tensor]]] = [[] for _ in range(V)]
    outputs: list[list[torch.Tensor]] = [[] for _ in range(V)]
    output_grads: list[list[Optional[torch.Tensor]]] = [[] for _ in range(V)]

    def chunk_of(k: int, forward: bool) -> int:
        chunk = (k % (P * V)) // P
        return chunk if forward else V - 1 - chunk

    def is_loss_stage(chunk: int) -> bool:
        return last_rank and chunk == V - 1

    def received(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if tensor is not None and not forward_only:
            tensor.requires_grad_(True)
        return tensor

    def forward(k: int) -> Optional[torch.Tensor]:
        """Forward of virtual micro-batch k; returns what to send on (None: nothing)."""
        chunk = chunk_of(k, True)
        if first_rank and chunk == 0 and len(inputs[chunk]) == len(outputs[chunk]):
            inputs[chunk].append(None)
        input_tensor = inputs[chunk][-1]
        model = chunks[chunk]
        if not (first_rank and chunk == 0):
            model.set_input_tensor(input_tensor)
        with grad_ctx(), autocast():
            output, loss_func = forward_step(iterators[chunk], model)
        if is_loss_stage(chunk):
            with grad_ctx():
                loss, reports = loss_func(output)
            _accumulate(totals, reports)
            outputs[chunk].append(loss * loss_scale)
            return None
        output = output.float() if output.dtype != torch.float32 else output
        outputs[chunk].append(output)
        return output

    def backward(k: int) -> Optional[torch.Tensor]:
        """Backward of virtual micro-batch k; returns the gradient to send back (or None)."""
        chunk = chunk_of(k, False)
        if is_loss_stage(chunk) and not output_grads[chunk]:
            output_grads[chunk].append(None)
        input_tensor = inputs[chunk].pop(0)
        torch.autograd.backward(outputs[chunk].pop(0), grad_tensors=output_grads[chunk].pop(0))
        return None if input_tensor is None else input_tensor.grad

    total = M * V
    if forward_only or M == P:
        warmup = total
    else:
        warmup = min((P - pg.pp_rank - 1) * 2 + (V - 1) * P, total)
    all_warmup = warmup == total
    remaining = total - warmup

    inputs[0].append(None if first_rank else received(ring.run(recv_prev=True)[0]))
    for k in range(warmup):
        send = forward(k)
        next_chunk = chunk_of(k + 1, True)
        recv_prev = not (first_rank and next_chunk == 0) and k != total - 1
        if k == warmup - 1 and not all_warmup:
            recv_next = not last_rank
            from_prev, from_next = ring.run(
                send_next=send, recv_prev=recv_prev, recv_next=recv_next
            )
            if recv_next:
                output_grads[V - 1].append(from_next)
        else:
            from_prev = ring.run(send_next=send, recv_prev=recv_prev)[0]
        inputs[next_chunk].append(received(from_prev))

    for k in range(remaining):
        forward_k, backward_k = k + warmup, k
        send_next = forward(forward_k)
        send_prev = backward(backward_k)
        if first_rank:  # its next forward input comes from the last rank's previous chunk
            next_forward = chunk_of(forward_k - (P - 1), True)
            recv_prev = next_forward != V - 1
            next_forward += 1
        else:
            recv_prev, next_forward = True, chunk_of(forward_k + 1, True)
        if last_rank:  # its next output gradient comes from the first rank's next chunk
            next_backward = chunk_of(backward_k - (P - 1), False)
            recv_next = next_backward != 0
            next_backward -= 1
        else:
            recv_next, next_backward = True, chunk_of(backward_k + 1, False)
        if k == remaining - 1:
            recv_prev = False
        from_prev, from_next = ring.run(
            send_next=send_next, send_prev=send_prev, recv_prev=recv_prev, recv_next=recv_next
        )
        if recv_prev:
            inputs[next_forward].append(received(from_prev))
        if recv_next:
            output_grads[next_backward].append(from_next)

    if forward_only:
        return totals
    if all_warmup:
        output_grads[V - 1].append(None if last_rank else ring.run(recv_next=True)[1])
    for k in range(remaining, total):
        send_prev = backward(k)
        next_backward = chunk_of(k + 1, False)
        recv_next = not (last_rank and next_backward == V - 1) and k != total - 1
        from_next = ring.run(send_prev=send_prev, recv_next=recv_next)[1]
        output_grads[next_backward].append(from_next)
    return totals
