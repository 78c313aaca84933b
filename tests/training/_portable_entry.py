"""torchrun entry of test_portable_engine.py: a few portable-engine steps of a 4-layer
tiny GPT, on one rank or over P pipeline ranks with V model chunks each (interleaved 1F1B).

    python -m torch.distributed.run --nproc-per-node P _portable_entry.py OUT CASE [CASE ...]

Each CASE runs in turn in the same processes (megatron's groups built and torn down per case,
so that one launch's start-up serves several runs) and writes into OUT/CASE/:

- `[lev_]v<V>[_dp<D>]_gb<GLOBAL_BATCH>`: P = world size / D pipeline ranks (D data-parallel
  replicas, default 1) with V model chunks each; GLOBAL_BATCH micro-batches of one sample each
  make one iteration (data-parallel rank r takes every D-th from the r-th). `lev_`: the LEV
  arm (LEV's global-batch backward), else untied. Every stage starts from the single-stage
  model's weights (`initialize_like_single_stage`); rank 0 writes losses.json: the training
  losses, grad norms, one evaluation loss, each rank's chunk layers and the stage wrappers
  (torch DDP or none).
- `nan<R>`: the ranks are data-parallel instead (PP=1, torch DDP, GLOBAL_BATCH 4), rank R's loss
  of the second iteration is NaN, and each rank writes the engine's error to error<rank>.txt.
"""

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support.tiny_gpt import RandomSamples, forward_step, model_config, pipeline_chunks

LAYERS, MICRO_BATCH, ITERS, SEED = 4, 1, 4, 1234


def main(
    out: Path,
    chunks_per_rank: int,
    global_batch: int,
    nan_rank: int | None,
    dp: int = 1,
    embedding_type: str = "untied",
) -> None:
    from megatron_ext.config.run import (
        BatchConfig,
        OptimizerConfig,
        ParallelConfig,
        RunConfig,
    )
    from megatron_ext.parallel import destroy_parallel, initialize_parallel, set_random_seed
    from megatron_ext.training.engine import NonFiniteError, Phase
    from megatron_ext.training.engine_portable import PortableEngine
    from megatron_ext.training.metrics_logger import Timers

    pp = 1 if nan_rank is not None else int(os.environ.get("WORLD_SIZE", "1")) // dp
    pg = initialize_parallel(pipeline_model_parallel_size=pp, backend="gloo")
    set_random_seed(SEED, pg.pp_rank)
    chunks = pipeline_chunks(
        pg,
        num_layers=LAYERS,
        hidden_size=32,
        chunks_per_rank=chunks_per_rank,
        seed=SEED,
        embedding_type=embedding_type,
    )
    layers = [[layer.layer_number for layer in c.decoder.layers] for c in chunks]
    cfg = RunConfig(
        batch=BatchConfig(
            micro_batch_size=MICRO_BATCH, global_batch_size=global_batch, train_iters=ITERS
        ),
        optim=OptimizerConfig(lr=1e-2, lr_decay_steps=ITERS, clip_grad=1.0),
        model=model_config(embedding_type, LAYERS, hidden_size=32),
        parallel=ParallelConfig(pipeline_model_parallel_size=pp),
    ).resolve(dist.get_world_size())
    step_fn, iteration = forward_step, [0]
    if nan_rank is not None:

        def step_fn(data_iterator, model):  # NaN losses on one data-parallel rank only
            output, loss_func = forward_step(data_iterator, model)
            if dist.get_rank() == nan_rank and iteration[0] == 1:
                output = output * float("nan")
            return output, loss_func

    engine = PortableEngine(
        cfg, chunks if chunks_per_rank > 1 else chunks[0], step_fn, pg, Phase(), Timers(0)
    )
    samples = RandomSamples(global_batch * (ITERS + 1))

    def micro_batches(iteration: int):
        start = iteration * global_batch + pg.dp_rank * MICRO_BATCH
        for i in range(start, (iteration + 1) * global_batch, MICRO_BATCH * pg.dp_size):
            yield torch.utils.data.default_collate([samples[j] for j in range(i, i + MICRO_BATCH)])

    if nan_rank is not None:
        wrappers = ",".join(type(m).__name__ for m in engine.ddp)  # one per model chunk
        (out / f"ddp{dist.get_rank()}.txt").write_text(wrappers)
        try:
            for iteration[0] in range(ITERS):
                engine.step(micro_batches(iteration[0]), global_batch)
        except NonFiniteError as error:
            (out / f"error{dist.get_rank()}.txt").write_text(f"{iteration[0] + 1}: {error}")
        destroy_parallel()
        return
    results = [engine.step(micro_batches(i), global_batch) for i in range(ITERS)]
    eval_loss = engine.evaluate(micro_batches(ITERS), 1)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, layers)
    wrappers = [None] * dist.get_world_size()
    dist.all_gather_object(wrappers, [type(m).__name__ for m in engine.pipeline.modules])
    if dist.get_rank() == 0:
        record = dict(
            losses=[r.loss for r in results],
            grad_norms=[r.grad_norm for r in results],
            stepped=[r.stepped for r in results],
            eval_loss=eval_loss,
            layers=gathered,
            wrappers=wrappers,
            lev_deferred=bool(engine.deferred),
        )
        (out / "losses.json").write_text(json.dumps(record))
    destroy_parallel()


def run_case(out: Path, case: str) -> None:
    """Run CASE (see the module docstring) into out/CASE."""
    (out / case).mkdir(parents=True, exist_ok=True)
    if match := re.fullmatch(r"(lev_)?v(\d+)(?:_dp(\d+))?_gb(\d+)", case):
        embedding = "lev" if match[1] else "untied"
        main(out / case, int(match[2]), int(match[4]), None, int(match[3] or 1), embedding)
    elif match := re.fullmatch(r"nan(\d+)", case):
        main(out / case, 1, 4, int(match[1]))
    else:
        raise SystemExit(
            f"unknown case {case!r}: expected [lev_]v<V>[_dp<D>]_gb<GLOBAL_BATCH> or nan<RANK>"
        )


if __name__ == "__main__":
    for name in sys.argv[2:]:
        run_case(Path(sys.argv[1]), name)
    # As the training loop's close does: the default group is destroyed before the interpreter
    # exits, not torn down with it (CI once saw a 4-rank run abort at exit with "terminate called
    # without an active exception" after its cases; not reproduced in 64 runs since).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
