"""One training run end to end: `pretrain(cfg, model_provider=..., forward_step=...,
datasets_provider=...)`, Megatron-LM's entry contract: the process groups, `setup` (seeds, model
chunks, engine, metrics logger, checkpoint load), `loop.train` and, whatever happened,
`loop.close`."""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext import cpu_accel
from megatron_ext.checkpoint.format import read_latest_iteration
from megatron_ext.checkpoint.lock import SaveLock, remove_partial_saves
from megatron_ext.config.run import RunConfig
from megatron_ext.elastic import restart_round
from megatron_ext.parallel import (
    ProcessGroups,
    group_description,
    initialize_parallel,
    is_collective_timeout,
    set_random_seed,
)
from megatron_ext.training.checkpoint_manager import CheckpointManager
from megatron_ext.training.engine import Engine, Phase
from megatron_ext.training.engine_portable import PortableEngine
from megatron_ext.training.initialization import initialize_like_single_stage
from megatron_ext.training.interrupt import SignalWatch, TrainingInterrupted, interrupted_line
from megatron_ext.training.loop import DatasetsProvider, Trainer, close, train
from megatron_ext.training.megatron_engine import MegatronEngine
from megatron_ext.training.metrics import flops_per_iteration, run_info
from megatron_ext.training.metrics_logger import MetricsLogger, Timers
from megatron_ext.training.pipeline import ForwardStep
from megatron_ext.training.run_extras import RunExtras
from megatron_ext.training.unique_params import unique_numel

logger = logging.getLogger(__name__)

__all__ = ["pretrain", "setup", "CollectiveTimeoutError"]

ModelProvider = Callable[[bool, bool], torch.nn.Module]
EngineBuilder = Callable[..., Engine]


class CollectiveTimeoutError(RuntimeError):
    """A collective waited past --distributed-timeout-minutes (a peer stopped, hung or died)."""


def process_start_time() -> float:
    """When this process started (epoch seconds): --exit-duration-in-mins counts from there,
    imports and process-group start-up included (time.time() now where /proc is missing)."""
    try:
        with open("/proc/self/stat") as handle:
            ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def setup(
    cfg: RunConfig,
    pg: ProcessGroups,
    *,
    model_provider: ModelProvider,
    forward_step: ForwardStep,
    full_model_provider: Optional[Callable[[], torch.nn.Module]] = None,
    engine_builder: Optional[EngineBuilder] = None,
    save_lock: Optional[SaveLock] = None,
) -> Trainer:
    """Seed, build this stage's model, its engine and the rest of the run, and load --load.

    `engine_builder` (default: the engine --ddp-impl names) is
    `(cfg, model, forward_step, pg, phase, timers) -> Engine`. `save_lock`: the run's lock of
    --save, checked before every save. Returns the trainer at the loaded iteration.
    """
    if not cfg.engine.cpu_accel:
        cpu_accel.disable()  # before any kernel is chosen; DataLoader workers inherit it
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    set_random_seed(cfg.seed, pg.pp_rank)
    rank0 = dist.get_rank() == 0
    if rank0:
        _log_run(cfg, pg)
    chunks = _build_model(cfg, pg, model_provider, full_model_provider)
    model = chunks[0] if len(chunks) == 1 else chunks
    num_params = unique_numel(torch.nn.ModuleList(chunks), pg)
    phase, timers = Phase(), Timers(cfg.log.timing_log_level)
    default = MegatronEngine if cfg.engine.ddp_impl == "megatron" else PortableEngine
    engine = (engine_builder or default)(cfg, model, forward_step, pg, phase, timers)
    param_bytes = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    extras = RunExtras(cfg, param_bytes)
    model_config = getattr(chunks[0], "model_config", None)  # a LeviathanModel's ModelConfig
    gbs = cfg.batch.global_batch_size
    flops = None if model_config is None else flops_per_iteration(model_config, gbs)
    metrics = MetricsLogger(cfg, flops, extras.wandb)
    trainer = Trainer(
        cfg,
        engine,
        pg,
        phase=phase,
        timers=timers,
        metrics=metrics,
        checkpoints=CheckpointManager(cfg, engine, pg, phase, save_lock),
        extras=extras,
    )
    if rank0:
        logger.info("model parameters: %d (%.1fM)", num_params, num_params / 1e6)
        metrics.text("config", "\n".join(f"    {k}: {v}" for k, v in cfg.args_json().items()))
    trainer.state = trainer.checkpoints.load() or trainer.state
    trainer.checkpoints.check_space(num_params)
    return trainer


def _log_run(cfg: RunConfig, pg: ProcessGroups) -> None:
    """Rank 0's account of the run before it builds anything: machine, layout, every setting."""
    p = cfg.parallel
    logger.info("run: %s", ", ".join(f"{k}={v}" for k, v in run_info().items()))
    if not cpu_accel.enabled():
        logger.info("%s: portable paths only", cpu_accel.OFF)
    logger.info(
        "layout: world %d = TP %d x CP %d x PP %d x DP %d; backend %s",
        dist.get_world_size(),
        p.tensor_model_parallel_size,
        p.context_parallel_size,
        p.pipeline_model_parallel_size,
        pg.dp_size,
        dist.get_backend(),
    )
    if p.virtual_pipeline_model_parallel_size:
        logger.info(
            "interleaved 1F1B: model chunks per pipeline rank: %d (%d layers each)",
            p.virtual_pipeline_model_parallel_size,
            p.num_layers_per_virtual_pipeline_stage,
        )
    for key, value in cfg.args_json().items():
        logger.info("  %s %s %s", key, "." * max(2, 40 - len(key)), value)


def _build_model(
    cfg: RunConfig,
    pg: ProcessGroups,
    model_provider: ModelProvider,
    full_model_provider: Optional[Callable[[], torch.nn.Module]],
) -> list[torch.nn.Module]:
    """This pipeline rank's model: one module, or with --num-layers-per-virtual-pipeline-stage
    its V model chunks in order (chunk c holds virtual stage c x PP + pp_rank); a fresh PP > 1
    run starts from one stage's initial weights (`full_model_provider`); on the GPU if any.
    """
    p, ck = cfg.parallel, cfg.ckpt
    interleaved, vp_size = p.num_layers_per_virtual_pipeline_stage is not None, 1
    if interleaved:
        vp_size = p.virtual_pipeline_model_parallel_size
        if vp_size is None:
            raise ValueError(
                "--num-layers-per-virtual-pipeline-stage: derive the chunks per rank first "
                "(ParallelConfig.with_num_layers(num_layers))"
            )
    collection = pg.megatron_collection()
    chunks = [
        model_provider(
            pre_process=pg.is_first_stage and c == 0,
            post_process=pg.is_last_stage and c == vp_size - 1,
            pg_collection=collection,
            **(dict(vp_stage=c, vp_size=vp_size) if interleaved else {}),
        )
        for c in range(vp_size)
    ]
    resuming = bool(ck.load) and (
        ck.ckpt_step is not None or read_latest_iteration(ck.load) is not None
    )
    if p.pipeline_model_parallel_size > 1 and full_model_provider and not resuming:
        for chunk in chunks:
            initialize_like_single_stage(chunk, full_model_provider, cfg.seed)
    if torch.cuda.is_available():
        chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
    return chunks


def pretrain(
    cfg: RunConfig,
    *,
    model_provider: ModelProvider,
    forward_step: ForwardStep,
    datasets_provider: DatasetsProvider,
    full_model_provider: Optional[Callable[[], torch.nn.Module]] = None,
    engine_builder: Optional[EngineBuilder] = None,
) -> str:
    """Initialise the process groups, then `setup`, `train` and `close`. --save is locked
    (`checkpoint.lock.SaveLock`) from before anything is built to the end of the run.

    Args:
        cfg: the run's settings (`arguments.parse_config` builds them from the flags).
        model_provider: `(pre_process, post_process) -> module` of this pipeline stage.
        forward_step: Megatron's `(data_iterator, model) -> (output, loss_func)`.
        datasets_provider: `[train, valid, test] sample counts -> (train, valid, test)`.
        full_model_provider: builds the whole model as one stage, whose initial weights a
            fresh PP>1 run copies (`initialization.py`).
        engine_builder: builds the training engine (see `setup`).

    Returns why training stopped (`loop.train`).

    Raises:
        NonFiniteError: a NaN/inf loss or grad norm stopped the run (nothing was saved).
        SaveLockError: another run holds --save (a CheckpointError, like a damaged --load).
    """
    job_start = process_start_time()
    p = cfg.parallel
    pg = initialize_parallel(
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
        backend=p.distributed_backend,
        timeout_minutes=p.distributed_timeout_minutes,
    )
    trainer = save_lock = None
    completed, rank0 = False, dist.get_rank() == 0
    made_save = _first_missing(cfg.ckpt.save)  # before the lock creates it
    interrupt, started = SignalWatch(), 0
    try:
        cfg = cfg.resolve(dist.get_world_size())  # the data-parallel size of this world
        save_lock = SaveLock.acquire(cfg.ckpt.save) if cfg.ckpt.save else None
        trainer = setup(
            cfg,
            pg,
            model_provider=model_provider,
            forward_step=forward_step,
            full_model_provider=full_model_provider,
            engine_builder=engine_builder,
            save_lock=save_lock,
        )
        trainer.start_time = job_start
        started = trainer.state.iteration
        _log_restart(trainer)
        stopped = train(trainer, datasets_provider)
        completed = True
        return stopped
    except Exception as error:
        if interrupt.received:  # a peer left on Ctrl-C first: this rank's collective failed
            raise _interrupted(cfg, trainer, started, save_lock) from None
        if trainer is None or not is_collective_timeout(error):
            raise
        raise _collective_timeout(trainer) from None
    except KeyboardInterrupt:
        raise _interrupted(cfg, trainer, started, save_lock) from None
    finally:
        try:
            close(trainer, completed)
        finally:
            interrupt.release()
            if save_lock is not None:
                save_lock.release()
            if not completed and made_save and rank0:
                _remove_if_no_files(made_save)


def _collective_timeout(trainer: Trainer) -> CollectiveTimeoutError:
    """The error of a collective that waited past --distributed-timeout-minutes: what waited,
    over which group, and the last complete checkpoint."""
    minutes, ck = trainer.cfg.parallel.distributed_timeout_minutes, trainer.cfg.ckpt
    latest = read_latest_iteration(ck.save) if ck.save else None
    return CollectiveTimeoutError(
        f"rank {dist.get_rank()}: {trainer.phase.what} over "
        f"{group_description(trainer.phase.group)} did not complete within "
        f"--distributed-timeout-minutes {minutes:g} ({60 * minutes:g} s) after iteration "
        f"{trainer.state.iteration}: a rank of that group stopped, hung or died; "
        + (
            f"the last complete checkpoint is iteration {latest} in --save {ck.save}"
            if latest is not None
            else "no checkpoint was saved"
        )
    )


def _interrupted(
    cfg: RunConfig, trainer: Optional[Trainer], started: int, save_lock: Optional[SaveLock]
) -> TrainingInterrupted:
    """The Ctrl-C line; rank 0 first removes the saves cut short while this run still holds
    --save (a rank killed mid-save cannot remove its own)."""
    if save_lock is not None and dist.get_rank() == 0:
        remove_partial_saves(cfg.ckpt.save)
    reached = None if trainer is None else trainer.state.iteration
    return TrainingInterrupted(interrupted_line(cfg.ckpt.save, started, reached))


def _first_missing(path: Optional[str]) -> Optional[str]:
    """The outermost directory that creating `path` makes (None: `path` exists already)."""
    if not path or os.path.exists(path):
        return None
    path = os.path.abspath(path)
    while not os.path.exists(os.path.dirname(path)):
        path = os.path.dirname(path)
    return path


def _remove_if_no_files(root: str) -> None:
    """Remove a --save directory this run made and the directories in it if they hold no file
    (a failed launch leaves nothing behind; rmdir never deletes a file)."""
    for directory, _, _ in sorted(os.walk(root), key=lambda entry: -len(entry[0])):
        try:
            os.rmdir(directory)
        except OSError:  # not empty: what it holds stays
            continue


def _log_restart(trainer: Trainer) -> None:
    """Under torchrun --max-restarts, say which restart this is and where it resumed."""
    restarts = restart_round()
    if restarts and trainer.is_rank0:
        logger.warning(
            "torchrun restarted the ranks (restart %d of --max-restarts %s) after a rank failed: "
            "%s",
            restarts,
            os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"),
            f"resuming from iteration {trainer.state.iteration} (--load {trainer.cfg.ckpt.load})"
            if trainer.state.iteration
            else "no checkpoint to resume from: starting again from iteration 0",
        )
