"""The portable engine's data-parallel average (`training/data_parallel.py`) on two spawned gloo
ranks: --grad-reduce-in-bf16 and the NaN-rank note through both paths (the DDP communication
hook and the explicit average of LEV's deferred gradients), and why LEV's gradients cannot go
through DDP: a minimal case of a gradient that arrives after DDP's backward, which DDP refuses
at the next iteration, and the same module as a `ChunkStage` that leaves it to the explicit
call."""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed

pytestmark = pytest.mark.integration


def _gradients_of_both_ranks(rank: int):
    """Three gradients of this rank (magnitudes 0.1, 1, 10) and, for both ranks, float64."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(100 + rank)
    local = [torch.randn(257, generator=gen) * 10 ** (i - 1) for i in range(3)]
    everyone = []
    for grad in local:
        gathered = [torch.zeros(257) for _ in range(2)]
        dist.all_gather(gathered, grad)
        everyone.append(torch.stack(gathered).double())
    return local, everyone


def _check_bf16_average():
    """--grad-reduce-in-bf16: each rank's half goes on the wire in BF16, the sum comes back to
    float32; the DDP hook and the explicit call give the same gradients; a NaN is noted on the
    rank whose own gradients held it."""
    import torch.distributed as dist

    from megatron_ext.parallel import ProcessGroups
    from megatron_ext.training.data_parallel import GradientAverage, wrap

    rank = dist.get_rank()
    local, everyone = _gradients_of_both_ranks(rank)
    params = [torch.nn.Parameter(torch.zeros(257)) for _ in range(3)]
    for param, grad in zip(params, local):
        param.grad = grad.clone()
    average = GradientAverage(ProcessGroups.from_megatron().dp_cp, torch.bfloat16)
    average.average_params(params)
    assert average.finite
    for param, table in zip(params, everyone):
        halves = (table / 2).to(torch.bfloat16).double()  # what each rank puts on the wire
        expected = halves.sum(0)
        grad = param.grad.double()
        assert param.grad.dtype == torch.float32
        assert torch.equal(grad, grad.to(torch.bfloat16).double()), "not reduced in bf16"
        # one bf16 rounding of the sum: relative 2^-8
        assert torch.all((grad - expected).abs() <= expected.abs() * 2.0**-8)
        assert not torch.equal(grad, table.mean(0).float().double()), "looks like fp32 reduce"

    class Dot(torch.nn.Module):  # d/dw sum(w * x) = x: the local gradients from a backward
        def __init__(self):
            super().__init__()
            self.weights = torch.nn.ParameterList([torch.zeros(257) for _ in range(3)])

        def forward(self, xs):
            return sum((w * x).sum() for w, x in zip(self.weights, xs))

    ddp = wrap(Dot(), average)
    ddp(local).backward()
    for param, weight in zip(params, ddp.module.weights):
        assert torch.equal(weight.grad, param.grad)  # the hook averages as the explicit call
    for i, (param, grad) in enumerate(zip(params, local)):
        param.grad = grad.clone()
        if i == 1 and rank == 1:
            param.grad[3] = float("nan")
    average.average_params(params)
    assert average.finite == (rank != 1)  # each rank notes its own gradients before the sum
    assert [bool(torch.isnan(p.grad).any()) for p in params] == [False, True, False]


class _Embedded(torch.nn.Module):
    """A layer whose `late` parameter gets its gradient after the backward, by a second
    autograd call, as LEV's parameters do in `LEVEmbedding.end_global_batch`."""

    def __init__(self):
        super().__init__()
        self.early = torch.nn.Parameter(torch.ones(4))
        self.late = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return (self.early * x).sum()

    def deferred_backward(self, x):
        torch.autograd.backward((self.late * x).sum())


def _check_late_gradients():
    """Why LEV's parameters stay out of DDP. DDP over a parameter whose gradient arrives after
    the backward that DDP prepared, from a second autograd call: DDP keeps that gradient's
    bucket open past the backward and reduces it from the second call's hooks (torch does not
    document this); in an iteration where the late gradient does not come (a rank whose LEV
    got no gradient), the reduction stays unfinished and the next iteration fails. The engine's
    way instead: the late parameter is not the `ChunkStage`'s, DDP reduces the rest within the
    backward, and one explicit call averages the late one (a missing gradient as zeros)."""
    import torch.distributed as dist

    from megatron_ext.parallel import ProcessGroups
    from megatron_ext.training.data_parallel import GradientAverage, wrap
    from megatron_ext.training.pipeline import Pipeline, PipelineShape

    rank, group = dist.get_rank(), ProcessGroups.from_megatron().dp_cp
    x = torch.full((4,), float(rank + 1))  # rank 0 sees 1s, rank 1 sees 2s: the average is 1.5
    model = _Embedded()
    ddp = wrap(model, GradientAverage(group, None))
    ddp(x).backward()
    assert model.late.grad is None  # its bucket is still open
    model.deferred_backward(x)
    assert torch.equal(model.late.grad, torch.full((4,), 1.5))  # reduced by the late hook
    model.zero_grad(set_to_none=True)
    ddp(x).backward()  # no deferred backward in this iteration
    message = ""
    try:
        ddp(x).backward()
    except RuntimeError as error:
        message = str(error)
    assert "Expected to have finished reduction in the prior iteration" in message, message

    # The engine's way: the layer as one pipeline stage (torch's PipelineStage and schedule,
    # here a single stage over two micro-batches) whose module, a ChunkStage without the late
    # parameter, is a DDP.
    model = _Embedded()
    shape = PipelineShape((4,), torch.float32, torch.device("cpu"), loss_output=())
    average = GradientAverage(group, None)
    pipeline = Pipeline(
        [model],
        _forward_step,
        ProcessGroups.from_megatron(),
        shape,
        deferred=[model.late],
        wrap=lambda module: wrap(module, average),
    )
    assert [p is model.early for p in pipeline.modules[0].module.parameters()] == [True]
    for _ in range(2):  # DDP is left ready for the next iteration
        model.zero_grad(set_to_none=True)
        totals = pipeline.run(iter([x, x]), 2)  # each micro-batch's loss divided by 2
        model.deferred_backward(x)
        average.average_params([model.late])
        assert torch.equal(model.early.grad, torch.full((4,), 1.5))
        assert torch.equal(model.late.grad, torch.full((4,), 1.5))
        assert totals["lm loss"].tolist() == [8.0 * (rank + 1), 2.0]


def _forward_step(data_iterator, model):
    """Megatron's contract for `_Embedded`: its output, and the loss of it."""
    output = model(next(data_iterator))
    return output, lambda out: (out, {"lm loss": torch.stack([out.detach(), torch.tensor(1.0)])})


def _checks():
    _check_bf16_average()
    _check_late_gradients()
    return True


def test_the_average_on_two_gloo_ranks():
    assert run_distributed(_checks, world_size=2) == [True, True]
