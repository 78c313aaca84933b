"""Forward/backward over the micro-batches of one iteration: gradient accumulation, and a
compact 1F1B pipeline schedule on torch.distributed point-to-point ops (gloo and NCCL alike).

With one pipeline stage the schedule is plain gradient accumulation (forward and backward of
each micro-batch in turn). With P stages, stage r runs min(P - r - 1, M) warm-up forwards,
then alternates one forward and one backward, then drains the remaining backwards (Megatron's
non-interleaved 1F1B). Activations travel as [s, b, h] tensors ([s/tp, b, h] under sequence
parallelism, s/cp under context parallelism) in float32; a send is always posted together with
the matching receive of the step (`_exchange`), which keeps neighbouring stages deadlock-free.

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


def _accumulate(totals: dict[str, torch.Tensor], reports: dict[str, torch.Tensor]) -> None:
    for name, value in reports.items():
        value = value.detach().to(torch.float64)
        totals[name] = totals[name] + value if name in totals else value


def forward_backward(
    *,
    forward_step: ForwardStep,
    data_iterator: Iterator,
    model: torch.nn.Module,
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

    `no_sync` (one pipeline stage only: torch DDP's `no_sync`) wraps the forward and backward
    of every micro-batch but the last, so that DDP reduces the accumulated gradients once,
    overlapped with the last backward.

    With `per_token_loss` (--calculate-per-token-loss) the losses are token sums and are not
    divided by the number of micro-batches; the caller divides the gradients by the token count.

    Returns:
        on the last pipeline stage, `reports` summed over micro-batches (float64); elsewhere {}.
    """
    divisor = 1 if per_token_loss else num_microbatches
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
