#!/usr/bin/env python
"""Can torch.distributed.pipelining drive megatron-core model chunks, and at what cost?

Runs on 2 gloo ranks (this script launches itself with torch.distributed.run). A 4-layer tiny
GPT (megatron-core layers, the LeviathanModel of training) is split as 2 pipeline ranks x
--chunks model chunks. Every chunk starts from the single-stage model's weights. One global
batch (--micro-batches of one sample) goes through forward and backward with:

  ours   the portable engine's hand-written schedule (`schedules.forward_backward`: 1F1B, or
         interleaved 1F1B over chunks), the chunk fed through `set_input_tensor`;
  torch  torch.distributed.pipelining: each chunk in a `PipelineStage` behind a small adapter
         (the received activation as a positional argument; the loss stage returns logits and
         the schedule's `loss_fn` is the token-mean cross entropy), driven by Schedule1F1B or
         ScheduleInterleaved1F1B.

It prints whether the two give the same loss and gradients (max relative difference over
every parameter), then --rounds interleaved timings of each (CPU seconds of the process, min
and median over rounds) and the ratio torch / ours.

    python benchmarks/bench_torch_pipelining.py --chunks 2
    python benchmarks/bench_torch_pipelining.py --chunks 1 --micro-batches 8 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LAYERS, SEED = 4, 1234


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=2, help="model chunks per rank (1: plain 1F1B)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hidden-size", type=int, default=64)
    return p.parse_args(argv)


def _chunks(pg, V: int, hidden: int):
    from megatron_ext.testing.tiny_gpt import pipeline_chunks

    return pipeline_chunks(pg, num_layers=LAYERS, hidden_size=hidden, chunks_per_rank=V, seed=SEED)


class _StageAdapter(torch.nn.Module):
    """A megatron-core chunk as torch pipelining wants a stage: inputs as positional
    arguments, one output tensor. tokens [b, s] on the first virtual stage, else the
    received activation [s, b, h]; the loss stage returns logits [b, s, V]."""

    def __init__(self, chunk: torch.nn.Module, first: bool) -> None:
        super().__init__()
        self.chunk, self.first = chunk, first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron_ext.testing.tiny_gpt import SEQ

        positions = torch.arange(SEQ).unsqueeze(0)
        if self.first:
            return self.chunk(x, positions, None)
        self.chunk.set_input_tensor(x)
        return self.chunk(None, positions, None)


def _grads(chunks) -> dict[str, torch.Tensor]:
    from megatron_ext.models.full_state_dict import layout_free_name

    return {
        layout_free_name(c, n): p.grad.detach().clone()
        for c in chunks
        for n, p in c.named_parameters()
        if p.grad is not None
    }


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
    )

    from megatron_ext.parallel import initialize_parallel
    from megatron_ext.testing.tiny_gpt import SEQ, RandomSamples, forward_step
    from megatron_ext.training.schedules import PipelineShape, forward_backward

    torch.set_num_threads(1)
    pg = initialize_parallel(pipeline_model_parallel_size=2, backend="gloo")
    P, V, M = pg.pp_size, args.chunks, args.micro_batches
    rank0 = dist.get_rank() == 0
    samples = RandomSamples(M)
    batch = torch.utils.data.default_collate([samples[i] for i in range(M)])

    def micro_batches():
        for i in range(M):
            yield torch.utils.data.default_collate([samples[i]])

    ours_chunks = _chunks(pg, V, args.hidden_size)
    torch_chunks = _chunks(pg, V, args.hidden_size)
    shape = PipelineShape((SEQ, 1, args.hidden_size), torch.float32, torch.device("cpu"))

    def run_ours() -> float:
        for c in ours_chunks:
            c.zero_grad(set_to_none=True)
        totals = forward_backward(
            forward_step=forward_step,
            data_iterator=micro_batches(),
            model=ours_chunks if V > 1 else ours_chunks[0],
            num_microbatches=M,
            shape=shape,
            pg=pg,
        )
        out = torch.zeros(2, dtype=torch.float64)
        if "lm loss" in totals:
            out += totals["lm loss"]
        dist.all_reduce(out)
        return float(out[0] / out[1])

    stages = [
        PipelineStage(
            _StageAdapter(chunk, first=pg.is_first_stage and c == 0),
            stage_index=c * P + pg.pp_rank,
            num_stages=P * V,
            device=torch.device("cpu"),
            group=pg.pp,
        )
        for c, chunk in enumerate(torch_chunks)
    ]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    schedule = (
        ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn)
        if V > 1
        else Schedule1F1B(stages[0], M, loss_fn=loss_fn)
    )

    def run_torch() -> float:
        for c in torch_chunks:
            c.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        kwargs = {}
        if pg.is_first_stage:
            inputs = (batch["tokens"],)
        else:
            inputs = ()
        if pg.is_last_stage:
            kwargs = dict(target=batch["labels"], losses=losses)
        schedule.step(*inputs, **kwargs)
        out = torch.zeros(2, dtype=torch.float64)
        if losses:
            out += torch.tensor(
                [float(sum(x.detach() for x in losses)), float(len(losses))], dtype=torch.float64
            )
        dist.all_reduce(out)
        return float(out[0] / out[1])

    ours_loss = run_ours()
    try:
        torch_loss = run_torch()
    except Exception as error:  # the measured outcome: report what fails and stop
        if rank0:
            print(f"torch.distributed.pipelining failed: {type(error).__name__}: {error}")
        raise
    mine, theirs = _grads(ours_chunks), _grads(torch_chunks)
    worst = max(
        float((mine[k] - theirs[k]).abs().max() / mine[k].abs().max().clamp_min(1e-30))
        for k in mine
    )
    worst_t = torch.tensor([worst, float(set(mine) != set(theirs))])
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    if rank0:
        print(f"PP=2 x {V} chunk(s), {M} micro-batches, hidden {args.hidden_size}")
        print(f"loss: ours {ours_loss:.10f}  torch {torch_loss:.10f}")
        print(
            f"gradients: max relative difference {float(worst_t[0]):.3g}"
            f"{'; parameter sets differ' if worst_t[1] else ''}"
        )
    seconds: dict[str, list[float]] = {"ours": [], "torch": []}
    for _ in range(args.rounds):
        for name, fn in (("ours", run_ours), ("torch", run_torch)):
            dist.barrier()
            start = time.process_time()
            fn()
            spent = torch.tensor([time.process_time() - start])
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)
            seconds[name].append(float(spent))
    if rank0:
        print("forward+backward of one global batch, CPU seconds (max over ranks):")
        for name, values in seconds.items():
            print(f"  {name:6s} min {min(values):.4f}  median {statistics.median(values):.4f}")
        ratio = statistics.median(seconds["torch"]) / statistics.median(seconds["ours"])
        best = min(seconds["torch"]) / min(seconds["ours"])
        print(f"torch / ours: median {ratio:.2f}, min {best:.2f}")
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = _parse(argv)
    if "LOCAL_RANK" in os.environ:
        _worker(args)
        return 0
    if args.chunks < 1 or args.micro_batches % 2 or LAYERS % (2 * args.chunks):
        print(
            "error: --micro-batches must be even and --chunks divide 2 (4 layers over 2 ranks)",
            file=sys.stderr,
        )
        return 2
    from megatron_ext.testing.distributed import find_free_port

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(find_free_port()), __file__, *(argv or sys.argv[1:]),
    ]  # fmt: skip
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
