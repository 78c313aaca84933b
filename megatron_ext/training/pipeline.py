"""Forward and backward over one iteration's micro-batches, on torch.distributed.pipelining.

Each model chunk of this pipeline rank is one `PipelineStage` of the P x V stages (rank r's
chunk c is stage c * P + r, Megatron-LM's virtual stages), driven by `Schedule1F1B`
(`ScheduleGPipe` with fewer micro-batches than stages) or `ScheduleInterleaved1F1B`; stages
exchange [s, b, h] activations. `ChunkStage` adapts Megatron's contract, `forward_step(
data_iterator, model) -> (output, loss_func)`, `loss_func(output) -> (loss, reports)` (name ->
detached [sum, count]).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Iterator, Optional, Sequence

import torch

from megatron_ext.parallel import ProcessGroups
from megatron_ext.rng import device_rng
from megatron_ext.training.engine import add_reports

__all__ = ["ForwardStep", "PipelineShape", "ChunkStage", "Pipeline"]

ForwardStep = Callable[[Iterator, torch.nn.Module], tuple[torch.Tensor, Callable]]


@dataclass(frozen=True)
class PipelineShape:
    """What stages exchange: the activation's shape ([s, b, h]), dtype and device, and the loss
    stage's output shape ([b, s]: the forward step's per-token losses)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    loss_output: tuple[int, ...]


class _Iteration:
    """One `Pipeline.run`: the micro-batches (read in order as a stage first asks for one,
    dropped once each of the rank's `readers` chunks has had it), the loss stage's loss
    functions and the reports summed so far."""

    def __init__(
        self,
        source: Iterator,
        readers: int,
        loss_factor: float,
        autocast: Callable[[], ContextManager],
    ) -> None:
        self.source, self.readers = source, readers
        self.loss_factor, self.autocast = loss_factor, autocast
        self.read = 0
        self.batches: dict[int, tuple[object, int]] = {}  # index -> (micro-batch, reads left)
        self.loss_funcs: dict[int, Callable] = {}
        self.totals: dict[str, torch.Tensor] = {}
        self.error: Optional[Exception] = None  # what a stage's forward raised

    def batch(self, index: int):
        """Micro-batch `index` of the iteration, for one of this rank's chunks."""
        while self.read <= index:
            self.batches[self.read] = (next(self.source), self.readers)
            self.read += 1
        batch, left = self.batches.pop(index)
        if left > 1:
            self.batches[index] = (batch, left - 1)
        return batch

    def add(self, reports: dict[str, torch.Tensor]) -> None:
        add_reports(self.totals, reports)


class ChunkStage(torch.nn.Module):
    """One model chunk as torch's schedules call a stage's module: `forward(*received,
    microbatch)`, `received` the previous stage's activation [s, b, h] (nothing on the first
    stage), `microbatch` the micro-batch's index (a one-element tensor). The chunk is held, not
    registered as a submodule: this module's parameters are the chunk's less `deferred`, the
    ones a `DistributedDataParallel` around it reduces.
    """

    def __init__(
        self,
        chunk: torch.nn.Module,
        forward_step: ForwardStep,
        *,
        first: bool,
        last: bool,
        dtype: torch.dtype,
        deferred: Iterable[torch.nn.Parameter] = (),
    ) -> None:
        super().__init__()
        self._chunk = (chunk,)  # a tuple: not a submodule
        self.forward_step, self.first, self.last, self.dtype = forward_step, first, last, dtype
        skip = {id(p) for p in deferred}
        self.owned = torch.nn.ParameterList(
            [p for p in chunk.parameters() if p.requires_grad and id(p) not in skip]
        )
        self.iteration: Optional[_Iteration] = None

    @property
    def chunk(self) -> torch.nn.Module:
        """The model chunk."""
        return self._chunk[0]

    def forward(self, *received: torch.Tensor, microbatch: torch.Tensor) -> torch.Tensor:
        """The chunk's forward on micro-batch `microbatch` (see the class doc)."""
        iteration, index = self.iteration, int(microbatch)
        if not self.first:
            self.chunk.set_input_tensor(received[0])
        try:
            batch = iteration.batch(index)
            with iteration.autocast(), device_rng():
                output, loss_func = self.forward_step(iter((batch,)), self.chunk)
        except Exception as error:
            iteration.error = error
            raise
        if self.last:
            iteration.loss_funcs[index] = loss_func
            return output
        return output.to(self.dtype).contiguous()


class Pipeline:
    """This rank's model chunks as stages of torch's pipeline schedules (see the module doc).

    `chunks`: this rank's model chunks in order (more than one: interleaved 1F1B); `deferred`:
    parameters the stages do not own (`engine.ModuleHooks`); `wrap`: the module each stage runs,
    made from its `ChunkStage` (the engine's DDP; by default the `ChunkStage` itself).
    """

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        forward_step: ForwardStep,
        pg: ProcessGroups,
        shape: PipelineShape,
        *,
        autocast: Callable[[], ContextManager] = contextlib.nullcontext,
        deferred: Iterable[torch.nn.Parameter] = (),
        wrap: Callable[[ChunkStage], torch.nn.Module] = lambda module: module,
    ) -> None:
        self.pg, self.shape, self.autocast = pg, shape, autocast
        V, deferred = len(chunks), list(deferred)
        self.chunk_stages = [
            ChunkStage(
                chunk,
                forward_step,
                first=pg.is_first_stage and c == 0,
                last=pg.is_last_stage and c == V - 1,
                dtype=shape.dtype,
                deferred=deferred,
            )
            for c, chunk in enumerate(chunks)
        ]
        self.modules = [wrap(stage) for stage in self.chunk_stages]  # or DDP around each
        self._schedules: dict[int, object] = {}

    def _schedule(self, num_microbatches: int):
        """torch's schedule over fresh stages for `num_microbatches` (kept for the next
        iteration; a stage allocates receive buffers per micro-batch, so only the two latest
        sizes are kept: the training and the evaluation batch during a batch ramp-up)."""
        M = num_microbatches
        if M in self._schedules:
            self._schedules[M] = self._schedules.pop(M)  # the latest used last
            return self._schedules[M]
        # deferred: torch.distributed.pipelining imports torch._dynamo (about 0.45 CPU-s),
        # which the training code's own imports stay free of (tests/test_megatron_import.py)
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        P, V, shape = self.pg.pp_size, len(self.modules), self.shape
        activation = torch.empty(shape.shape, dtype=shape.dtype, device="meta", requires_grad=True)
        loss_output = torch.empty(shape.loss_output, device="meta", requires_grad=True)
        stages = [
            PipelineStage(
                module,
                stage_index=c * P + self.pg.pp_rank,
                num_stages=P * V,
                device=shape.device,
                input_args=() if stage.first else (activation,),
                output_args=(loss_output if stage.last else activation,),
                group=self.pg.pp,
            )
            for c, (stage, module) in enumerate(zip(self.chunk_stages, self.modules))
        ]
        if V > 1:
            schedule = ScheduleInterleaved1F1B(stages, M, loss_fn=self._loss, scale_grads=False)
        else:
            kind = Schedule1F1B if M >= P else ScheduleGPipe
            schedule = kind(stages[0], M, loss_fn=self._loss, scale_grads=False)
        self._schedules[M] = schedule
        while len(self._schedules) > 2:
            self._schedules.pop(next(iter(self._schedules)))
        return schedule

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """torch's `loss_fn`: micro-batch `target`'s loss function on the loss stage's output; its
        reports summed, the loss scaled for backward (1 / M unless --calculate-per-token-loss,
        times the FP16 loss scale)."""
        iteration = self.chunk_stages[-1].iteration
        loss, reports = iteration.loss_funcs.pop(int(target))(output)
        iteration.add(reports)
        return loss * iteration.loss_factor

    def run(
        self,
        data_iterator: Iterator,
        num_microbatches: int,
        *,
        forward_only: bool = False,
        loss_scale: float = 1.0,
        per_token_loss: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Run one iteration's `num_microbatches` micro-batches through this rank's stages
        (forward, and backward unless `forward_only`); gradients accumulate in `param.grad`.
        `loss_scale` multiplies the loss before backward (FP16); with `per_token_loss` the
        losses are not divided by the number of micro-batches.

        Returns the reports summed over micro-batches (float64) on the last stage, else {}.
        """
        M, P, V = num_microbatches, self.pg.pp_size, len(self.modules)
        if V > 1 and M % P:
            raise ValueError(
                f"the interleaved pipeline schedule needs the number of micro-batches ({M}) to "
                f"be a multiple of the pipeline size ({P}); change --global-batch-size"
            )
        factor = loss_scale / (1 if per_token_loss else M)
        iteration = _Iteration(data_iterator, V, factor, self.autocast)
        schedule = self._schedule(M)
        index = torch.arange(M, device=self.shape.device)
        for stage in self.chunk_stages:
            stage.iteration = iteration
        try:
            if forward_only:
                with torch.no_grad():
                    schedule.eval(target=index, microbatch=index)
            else:
                schedule.step(target=index, microbatch=index, return_outputs=False)
        except BaseException as error:
            # A schedule stopped half-way keeps that iteration's losses: the next run of M
            # micro-batches builds a fresh one.
            self._schedules.pop(M, None)
            if isinstance(error, RuntimeError) and iteration.error is not None:
                # As the forward step raised it (a DataError, a bad token id), not torch's
                # wrapper of it.
                raise iteration.error from None
            raise
        finally:
            for stage in self.chunk_stages:
                stage.iteration = None  # no reference to the data iterator outlives the run
        return iteration.totals
