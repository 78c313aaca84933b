"""The training loop: `pretrain(cfg, model_provider=..., forward_step=..., datasets_provider=...)`,
Megatron-LM's entry contract.

`pretrain` initialises the process groups (`parallel.initialize_parallel` returns them as one
`ProcessGroups`, passed to everything that communicates) and runs three steps: `setup` (seeds,
model, engine, checkpoint load), `train` (datasets, the iterations, final evaluation) and
`close` (logs, profiler, process groups), which runs whatever happened.

The loop composes four collaborators, each in its own module: the engine (`engine.Engine`:
`engine_portable.PortableEngine`, or `megatron_engine.MegatronEngine` with --ddp-impl
megatron) runs one global batch per `step`; the metrics logger (`metrics_logger.py`) writes
the iteration line, TensorBoard, W&B and --log-jsonl; the checkpoint manager
(`checkpoint_manager.py`) saves and loads the engine's parts; `megatron_features.RunExtras`
runs the feature hooks (batch ramp-up, profiler, manual GC). The loop itself owns the
iteration counters and the exit conditions (--exit-signal-handler, --exit-duration-in-mins,
--exit-interval), each of which saves before leaving.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext.elastic import restart_round
from megatron_ext.parallel import (
    ProcessGroups,
    destroy_parallel,
    group_description,
    initialize_parallel,
    is_collective_timeout,
    set_random_seed,
)
from megatron_ext.training.checkpoint_manager import CheckpointManager, check_save_directory
from megatron_ext.training.checkpointing import TrainState, read_latest_iteration
from megatron_ext.training.config import TrainingConfig
from megatron_ext.training.data import build_data_loader
from megatron_ext.training.engine import Engine, NonFiniteError, Phase, StepResult
from megatron_ext.training.engine_portable import PortableEngine
from megatron_ext.training.initialization import initialize_like_single_stage
from megatron_ext.training.megatron_engine import MegatronEngine
from megatron_ext.training.megatron_features import RunExtras, memory_stats
from megatron_ext.training.metrics import flops_per_iteration, peak_tflops, run_info
from megatron_ext.training.metrics_logger import MetricsLogger, Timers
from megatron_ext.training.schedules import ForwardStep
from megatron_ext.training.unique_params import unique_numel

logger = logging.getLogger(__name__)

__all__ = ["pretrain", "setup", "train", "close", "Trainer", "NonFiniteError"]

ModelProvider = Callable[[bool, bool], torch.nn.Module]
DatasetsProvider = Callable[[Sequence[int]], tuple]
EngineBuilder = Callable[..., Engine]


EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""--exit-signal-handler: SIGTERM (preemption, the time limit) and SIGUSR1 (Slurm's
`--signal=USR1@120` warning before the time limit) both mean save and exit."""


class _SignalHandler:
    """Remembers that an exit signal arrived; the loop acts on it at the end of the iteration."""

    def __init__(self, sigs: Sequence[int] = EXIT_SIGNALS) -> None:
        self.received = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in sigs}

    def _handle(self, signum, frame) -> None:
        self.received = True

    def release(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


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


class Trainer:
    """The loop of one run around its engine, metrics logger and checkpoint manager (built by
    `setup`).

    Args:
        cfg: the run's settings.
        engine: runs one global batch per `step`.
        pg: the run's process groups.
        phase: shared with the engine and the checkpoint manager.
        timers: shared with the engine (--timing-log-level).
        metrics: the metrics logger.
        checkpoints: the checkpoint manager over `engine`.
        extras: the feature hooks (batch ramp-up, profiler, manual GC, W&B).
        flops_per_batch: model FLOPs of one iteration at the full --global-batch-size (None
            when the model does not say its ModelConfig).
    """

    def __init__(
        self,
        cfg: TrainingConfig,
        engine: Engine,
        pg: ProcessGroups,
        *,
        phase: Phase,
        timers: Timers,
        metrics: MetricsLogger,
        checkpoints: CheckpointManager,
        extras: RunExtras,
        flops_per_batch: Optional[float],
    ) -> None:
        self.cfg, self.engine, self.pg = cfg, engine, pg
        self.phase, self.timers, self.metrics = phase, timers, metrics
        self.checkpoints, self.extras = checkpoints, extras
        self.flops_per_batch = flops_per_batch
        self.state = TrainState()
        self.is_rank0 = dist.get_rank() == 0
        self.start_time = time.time()
        """Job start for --exit-duration-in-mins (`pretrain` sets the process's start time)."""
        self.step_seconds = 0.0
        """Wall time of the slowest iteration (the exit-duration check's look-ahead)."""
        self.signal = _SignalHandler() if cfg.exit.exit_signal_handler else None
        self.global_batch = cfg.batch.global_batch_size
        """This iteration's global batch size (below the flag's during --rampup-batch-size)."""

    def _duration_exhausted(self) -> bool:
        """--exit-duration-in-mins: would one more iteration plus the final save end past the
        limit (from the job start)? Then this iteration is the last one, and the save after it
        ends before the limit as long as the next iteration and save take no longer than the
        slowest seen so far. Before any save or load was timed, a save is reserved
        max(2 iterations, 5% of the limit up to 60 s)."""
        limit = self.cfg.exit.exit_duration_in_mins
        if not limit:
            return False
        save = self.checkpoints.save_seconds
        if save <= 0:
            save = max(2 * self.step_seconds, min(3.0 * limit, 60.0))
        ahead = time.time() - self.start_time + self.step_seconds + save
        return ahead > 60.0 * limit

    def load(self) -> None:
        """Load --load (if any) into the engine and take its train state."""
        state = self.checkpoints.load()
        if state is not None:
            self.state = state

    def save(self) -> None:
        """Save this iteration into --save (if any; collective)."""
        self.checkpoints.save(self.state)

    def evaluate(self, dataset, name: str = "validation") -> Optional[float]:
        """Mean loss over the first --eval-iters global batches of `dataset` (the same samples
        at every evaluation, so that validation curves compare like with like)."""
        b, ev = self.cfg.batch, self.cfg.eval
        if dataset is None or ev.eval_iters == 0:
            return None
        loader = build_data_loader(
            dataset, 0, b.micro_batch_size, self.pg.dp_rank, self.pg.dp_size, b.num_workers
        )
        if loader is None or len(loader.batch_sampler) < ev.eval_iters * self.cfg.num_microbatches:
            if self.is_rank0:
                logger.warning("%s set is smaller than --eval-iters global batches", name)
            return None
        self.extras.around_eval()
        self.phase.set(f"{name} evaluation (world group)")
        try:
            return self.engine.evaluate(iter(loader), ev.eval_iters)
        finally:
            self.extras.around_eval()
            self.phase.set("training loop (world group)")

    def log_evaluation(self, loss: Optional[float], name: str) -> None:
        """The boxed evaluation line and its scalars (rank 0; nothing when `loss` is None)."""
        self.metrics.evaluation(loss, name, self.state)

    def _step(self, iterator) -> StepResult:
        """One iteration of the engine; a non-finite stop or skip names the iteration."""
        it = self.state.iteration + 1
        local = (
            self.signal is not None and self.signal.received,
            self._duration_exhausted(),
        )
        try:
            result = self.engine.step(iterator, self.global_batch, local)
        except NonFiniteError as error:
            raise NonFiniteError(f"iteration {it}: {error}") from None
        if result.nonfinite and self.is_rank0:
            logger.warning("iteration %d: %s; skipping the optimizer step", it, result.note)
        return result

    def train(self, train_ds, valid_ds) -> str:
        """Train to --train-iters or an exit condition; return why it stopped."""
        b, lg = self.cfg.batch, self.cfg.log
        loader = build_data_loader(
            train_ds,
            self.state.consumed_train_samples,
            b.micro_batch_size,
            self.pg.dp_rank,
            self.pg.dp_size,
            b.num_workers,
        )
        if loader is None:
            raise RuntimeError("no training data (the train split is empty)")
        needed, consumed = 0, self.state.consumed_train_samples
        for _ in range(b.train_iters - self.state.iteration):
            gbs = self.extras.global_batch(consumed)
            needed += gbs // (b.micro_batch_size * self.cfg.parallel.data_parallel_size)
            consumed += gbs
        if len(loader.batch_sampler) < needed:
            raise RuntimeError(
                f"the training set has {len(loader.batch_sampler)} micro-batches left for this "
                f"rank but {needed} are needed; check --train-iters and the data split"
            )
        self.metrics.start(self.state.iteration)
        iterator = iter(loader)
        self.engine.train()
        reason = "finished"
        while self.state.iteration < b.train_iters:
            step_start, step_cpu_start = time.time(), time.process_time()
            self.global_batch = self.extras.global_batch(self.state.consumed_train_samples)
            self.extras.before_step(self.state.iteration + 1)
            result = self._step(iterator)
            state = self.state
            state.iteration += 1
            state.consumed_train_samples += self.global_batch
            state.skipped_iterations += int(result.skipped)
            state.nonfinite_iterations += int(result.nonfinite)
            if self.flops_per_batch:
                state.floating_point_operations_so_far += (
                    self.flops_per_batch * self.global_batch / b.global_batch_size
                )
            self.extras.after_step(state.iteration)
            self.step_seconds = max(self.step_seconds, time.time() - step_start)
            it = state.iteration
            if it % lg.tensorboard_log_interval == 0 or it % lg.log_interval == 0:
                extras = self.engine.log_stats()  # collective
                if self.cfg.log.log_memory_to_tensorboard:
                    extras.update(memory_stats())
                self.metrics.extras = extras
            loss_scale = self.engine.scaler.scale if self.engine.scaler is not None else None
            self.metrics.iteration(
                result,
                state,
                global_batch=self.global_batch,
                seconds=time.time() - step_start,
                cpu_seconds=time.process_time() - step_cpu_start,
                loss_scale=loss_scale,
            )
            if it % lg.log_interval == 0:
                self.metrics.line(
                    state,
                    global_batch=self.global_batch,
                    lr=result.lr,
                    loss_scale=loss_scale,
                    elapsed_since_start=time.time() - self.start_time,
                    timers=self.timers.take(),
                )
            ev = self.cfg.eval
            if ev.eval_iters and valid_ds is not None and it % ev.eval_interval == 0:
                self.log_evaluation(self.evaluate(valid_ds), "validation")
            ck = self.cfg.ckpt
            self.checkpoints.poll()
            if ck.save_interval and it % ck.save_interval == 0:
                self.save()
            signal_received, timeout = result.flags
            if signal_received:
                reason = "signal"
            elif timeout:
                reason = "exit-duration"
            elif self.cfg.exit.exit_interval and it % self.cfg.exit.exit_interval == 0:
                reason = "exit-interval"
            if reason != "finished":
                if self.is_rank0:
                    logger.info("exiting at iteration %d (%s)", it, reason)
                self.save()
                self.checkpoints.wait()
                if reason == "exit-duration" and self.is_rank0:
                    logger.info(
                        "exit-duration: saved iteration %d %.1f s after the job start "
                        "(--exit-duration-in-mins %g = %.1f s)",
                        it,
                        time.time() - self.start_time,
                        self.cfg.exit.exit_duration_in_mins,
                        60.0 * self.cfg.exit.exit_duration_in_mins,
                    )
                return reason
        self.save()
        return reason


def build_engine(cfg: TrainingConfig, model, forward_step, pg, phase, timers) -> Engine:
    """The engine --ddp-impl names: the portable one, or megatron-core's (CUDA)."""
    if cfg.engine.ddp_impl == "megatron":
        return MegatronEngine(cfg, model, forward_step, pg, phase, timers)
    return PortableEngine(cfg, model, forward_step, pg, phase, timers)


def _build_chunks(
    cfg: TrainingConfig, pg: ProcessGroups, model_provider: ModelProvider
) -> list[torch.nn.Module]:
    """This pipeline rank's model: one module, or with --num-layers-per-virtual-pipeline-stage
    its V model chunks in order (chunk c holds virtual stage c x PP + pp_rank; the embedding on
    the first rank's chunk 0, the head on the last rank's chunk V-1).

    Megatron-LM's contract: the provider builds its stage on the groups it is given, and a
    chunk when given `vp_stage` (here also `vp_size`, the chunks per rank).
    """
    collection = pg.megatron_collection()
    p = cfg.parallel
    if p.num_layers_per_virtual_pipeline_stage is None:
        return [
            model_provider(
                pre_process=pg.is_first_stage,
                post_process=pg.is_last_stage,
                pg_collection=collection,
            )
        ]
    vp_size = p.virtual_pipeline_model_parallel_size
    if vp_size is None:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage: derive the chunks per rank first "
            "(ParallelConfig.with_num_layers(num_layers))"
        )
    return [
        model_provider(
            pre_process=pg.is_first_stage and c == 0,
            post_process=pg.is_last_stage and c == vp_size - 1,
            pg_collection=collection,
            vp_stage=c,
            vp_size=vp_size,
        )
        for c in range(vp_size)
    ]


def setup(
    cfg: TrainingConfig,
    pg: ProcessGroups,
    *,
    model_provider: ModelProvider,
    forward_step: ForwardStep,
    full_model_provider: Optional[Callable[[], torch.nn.Module]] = None,
    engine_builder: Optional[EngineBuilder] = None,
) -> Trainer:
    """Seed, build this stage's model, its engine and the rest of the run, and load --load.

    `engine_builder` (default: the engine --ddp-impl names) is
    `(cfg, model, forward_step, pg, phase, timers) -> Engine`; tests pass one that builds the
    megatron-core engine on CPU doubles (`megatron_ext.testing.megatron_doubles`).

    Returns:
        the trainer (its `state` at the loaded iteration), ready for `train`.
    """
    p, ck = cfg.parallel, cfg.ckpt
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    set_random_seed(cfg.seed, pg.pp_rank)
    rank0 = dist.get_rank() == 0
    if rank0:
        info = run_info()
        logger.info("run: %s", ", ".join(f"{k}={v}" for k, v in info.items()))
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
        for key, value in sorted(ck.args_json.items()):
            logger.info("  %s %s %s", key, "." * max(2, 40 - len(key)), value)
    chunks = _build_chunks(cfg, pg, model_provider)
    resuming = bool(ck.load) and (
        ck.ckpt_step is not None or read_latest_iteration(ck.load) is not None
    )
    if p.pipeline_model_parallel_size > 1 and full_model_provider and not resuming:
        for chunk in chunks:
            initialize_like_single_stage(chunk, full_model_provider, cfg.seed)
    if torch.cuda.is_available():
        chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
    model = chunks[0] if len(chunks) == 1 else chunks
    num_params = unique_numel(torch.nn.ModuleList(chunks), pg)
    phase, timers = Phase(), Timers(cfg.log.timing_log_level > 0)
    engine = (engine_builder or build_engine)(cfg, model, forward_step, pg, phase, timers)
    extras = RunExtras(cfg, pg)
    model_config = getattr(chunks[0], "model_config", None)  # a LeviathanModel's ModelConfig
    flops = (
        flops_per_iteration(model_config, cfg.batch.global_batch_size)
        if model_config is not None
        else None
    )
    metrics = MetricsLogger(
        cfg,
        is_rank0=rank0,
        flops_per_batch=flops,
        peak=peak_tflops(cfg.log.peak_tflops),
        world_size=dist.get_world_size(),
        wandb=extras.wandb,
    )
    trainer = Trainer(
        cfg,
        engine,
        pg,
        phase=phase,
        timers=timers,
        metrics=metrics,
        checkpoints=CheckpointManager(cfg, engine, pg, phase),
        extras=extras,
        flops_per_batch=flops,
    )
    if rank0:
        logger.info("model parameters: %d (%.1fM)", num_params, num_params / 1e6)
        metrics.text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(ck.args_json.items())))
    trainer.load()
    if ck.save:
        check_save_directory(ck.save, num_params, with_optimizer=not ck.no_save_optim)
    return trainer


def train(trainer: Trainer, datasets_provider: DatasetsProvider) -> str:
    """Build the datasets, train to --train-iters (or an exit condition), then validate and
    test; with --skip-train only evaluate.

    Returns:
        why training stopped: "finished", "signal", "exit-duration", "exit-interval" or
        "skip-train".
    """
    cfg = trainer.cfg
    b, ev = cfg.batch, cfg.eval
    rank0 = trainer.is_rank0
    num_samples = [
        b.train_iters * b.global_batch_size,
        ev.eval_iters * b.global_batch_size,
        ev.eval_iters * b.global_batch_size,
    ]
    train_ds, valid_ds, test_ds = datasets_provider(num_samples)
    if cfg.exit.skip_train:  # Megatron-LM's --skip-train: evaluate and exit
        if rank0:
            logger.info("--skip-train: evaluating iteration %d", trainer.state.iteration)
        trainer.log_evaluation(trainer.evaluate(valid_ds), "validation")
        trainer.log_evaluation(trainer.evaluate(test_ds, "test"), "test")
        return "skip-train"
    if trainer.state.iteration >= b.train_iters:
        if rank0:
            logger.info("already trained %d iterations: nothing to do", trainer.state.iteration)
        return "finished"
    reason = trainer.train(train_ds, valid_ds)
    trainer.checkpoints.wait()  # the latest marker moves once the last write completed
    if reason == "finished" and ev.eval_iters:
        if trainer.state.iteration % ev.eval_interval:  # not just evaluated
            trainer.log_evaluation(trainer.evaluate(valid_ds), "validation")
        trainer.log_evaluation(trainer.evaluate(test_ds, "test"), "test")
    return reason


def close(trainer: Optional[Trainer]) -> None:
    """End the run, whatever happened: profiler, signal handler, loss curve and TensorBoard,
    then the process groups (megatron's and torch.distributed's)."""
    try:
        if trainer is not None:
            cfg = trainer.cfg
            trainer.extras.close()
            if trainer.signal is not None:
                trainer.signal.release()
            trainer.metrics.close(cfg.log.tensorboard_dir or cfg.ckpt.save)
    finally:
        destroy_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def pretrain(
    cfg: TrainingConfig,
    *,
    model_provider: ModelProvider,
    forward_step: ForwardStep,
    datasets_provider: DatasetsProvider,
    full_model_provider: Optional[Callable[[], torch.nn.Module]] = None,
    engine_builder: Optional[EngineBuilder] = None,
) -> str:
    """Initialise the process groups, then `setup`, `train` and `close`.

    Args:
        cfg: the run's settings (`arguments.training_config_from_args` fills them from flags).
        model_provider: `(pre_process, post_process) -> module` of this pipeline stage.
        forward_step: Megatron's `(data_iterator, model) -> (output, loss_func)`.
        datasets_provider: `[train, valid, test] sample counts -> (train, valid, test)`.
        full_model_provider: builds the whole model as a single pipeline stage; under pipeline
            parallelism a fresh run copies its initial weights from it, so that PP>1 starts
            from the same weights as PP=1 (see `initialization.py`).
        engine_builder: builds the training engine (see `setup`; default: --ddp-impl's).

    Returns:
        why training stopped: "finished", "signal", "exit-duration", "exit-interval" or
        "skip-train".

    Raises:
        NonFiniteError: a NaN/inf loss or grad norm stopped the run (nothing was saved).
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
    trainer = None
    try:
        cfg = cfg.resolve(dist.get_world_size())  # the data-parallel size of this world
        trainer = setup(
            cfg,
            pg,
            model_provider=model_provider,
            forward_step=forward_step,
            full_model_provider=full_model_provider,
            engine_builder=engine_builder,
        )
        trainer.start_time = job_start
        _log_restart(trainer)
        return train(trainer, datasets_provider)
    except RuntimeError as error:
        if trainer is None or not is_collective_timeout(error):
            raise
        what, group = trainer.phase.what, trainer.phase.group
        ck = trainer.cfg.ckpt
        latest = read_latest_iteration(ck.save) if ck.save else None
        raise CollectiveTimeoutError(
            f"rank {dist.get_rank()}: {what} over {group_description(group)} did not complete "
            f"within --distributed-timeout-minutes {p.distributed_timeout_minutes:g} "
            f"({60 * p.distributed_timeout_minutes:g} s) after iteration "
            f"{trainer.state.iteration}: a rank of that group stopped, hung or died; "
            + (
                f"the last complete checkpoint is iteration {latest} in --save {ck.save}"
                if latest is not None
                else "no checkpoint was saved"
            )
        ) from None
    finally:
        close(trainer)


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
