"""The training loop: `Trainer` (the iterations, evaluation, the exit conditions, each of which
saves before leaving), `train` (datasets, the iterations, final evaluation) and `close` (logs,
profiler, process groups), composed around the engine, the metrics logger, the checkpoint
manager and `run_extras.RunExtras`; `run.py` builds a run and calls them.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from megatron_ext.checkpoint.format import TrainState
from megatron_ext.config.run import RunConfig
from megatron_ext.parallel import ProcessGroups, destroy_parallel
from megatron_ext.training.checkpoint_manager import CheckpointManager
from megatron_ext.training.data import build_data_loader
from megatron_ext.training.engine import Engine, NonFiniteError, Phase, StepResult
from megatron_ext.training.interrupt import SignalWatch
from megatron_ext.training.metrics_logger import MetricsLogger, Timers
from megatron_ext.training.run_extras import RunExtras, memory_stats

logger = logging.getLogger(__name__)

__all__ = ["train", "close", "Trainer"]

DatasetsProvider = Callable[[Sequence[int]], tuple]


# --exit-signal-handler: SIGTERM (preemption, the time limit) and SIGUSR1 (Slurm's
# `--signal=USR1@120` warning before the time limit) both mean save and exit.
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Trainer:
    """The loop of one run around its engine, metrics logger and checkpoint manager (built by
    `setup`; `phase` and `timers` shared with the engine)."""

    def __init__(
        self,
        cfg: RunConfig,
        engine: Engine,
        pg: ProcessGroups,
        *,
        phase: Phase,
        timers: Timers,
        metrics: MetricsLogger,
        checkpoints: CheckpointManager,
        extras: RunExtras,
    ) -> None:
        self.cfg, self.engine, self.pg = cfg, engine, pg
        self.phase, self.timers, self.metrics = phase, timers, metrics
        self.checkpoints, self.extras = checkpoints, extras
        self.state = TrainState()
        self.is_rank0 = dist.get_rank() == 0
        self.start_time = time.time()  # for --exit-duration-in-mins (`pretrain` sets it)
        self.step_seconds = 0.0  # the slowest iteration (the exit-duration look-ahead)
        self.signal = SignalWatch(EXIT_SIGNALS if cfg.exit.exit_signal_handler else (), False)
        self.global_batch = cfg.batch.global_batch_size  # lower during --rampup-batch-size

    def _duration_exhausted(self) -> bool:
        """--exit-duration-in-mins: would one more iteration plus the final save end past the
        limit (from the job start)? Before any save or load was timed, a save is reserved
        max(2 iterations, 5% of the limit up to 60 s)."""
        limit = self.cfg.exit.exit_duration_in_mins
        if not limit:
            return False
        save = self.checkpoints.save_seconds
        if save <= 0:
            save = max(2 * self.step_seconds, min(3.0 * limit, 60.0))
        ahead = time.time() - self.start_time + self.step_seconds + save
        return ahead > 60.0 * limit

    def evaluate(self, dataset, name: str = "validation") -> None:
        """Log the mean loss over the first --eval-iters global batches of `dataset` (the same
        samples at every evaluation, so that validation curves compare like with like)."""
        b, ev = self.cfg.batch, self.cfg.eval
        if dataset is None or ev.eval_iters == 0:
            return
        loader = build_data_loader(
            dataset, 0, b.micro_batch_size, self.pg.dp_rank, self.pg.dp_size, b.num_workers
        )
        if loader is None or len(loader.batch_sampler) < ev.eval_iters * self.cfg.num_microbatches:
            if self.is_rank0:
                logger.warning("%s set is smaller than --eval-iters global batches", name)
            return
        self.extras.around_eval()
        self.phase.set(f"{name} evaluation (world group)")
        try:
            loss = self.engine.evaluate(iter(loader), ev.eval_iters)
        finally:
            self.extras.around_eval()
            self.phase.set("training loop (world group)")
        self.metrics.evaluation(loss, name, self.state)

    def _step(self, iterator) -> StepResult:
        """One iteration of the engine; a non-finite stop or skip names the iteration."""
        it = self.state.iteration + 1
        local = (self.signal.received, self._duration_exhausted())
        try:
            result = self.engine.step(iterator, self.global_batch, local)
        except NonFiniteError as error:
            raise NonFiniteError(f"iteration {it}: {error}") from None
        if result.nonfinite and self.is_rank0:
            logger.warning("iteration %d: %s; skipping the optimizer step", it, result.note)
        return result

    def train(self, train_ds, valid_ds) -> str:
        """Train to --train-iters or an exit condition; return why it stopped."""
        loader = self._train_loader(train_ds)
        self.metrics.start(self.state.iteration)
        iterator = iter(loader)
        self.engine.train()
        while self.state.iteration < self.cfg.batch.train_iters:
            step_start, step_cpu_start = time.time(), time.process_time()
            self.global_batch = self.extras.global_batch(self.state.consumed_train_samples)
            self.extras.before_step(self.state.iteration + 1)
            result = self._step(iterator)
            self._count(result)
            self.extras.after_step(self.state.iteration)
            self.step_seconds = max(self.step_seconds, time.time() - step_start)
            self._log_iteration(result, step_start, step_cpu_start)
            it, ev, ck = self.state.iteration, self.cfg.eval, self.cfg.ckpt
            periodic = ev.eval_interval and it % ev.eval_interval == 0  # None: after training
            if ev.eval_iters and valid_ds is not None and periodic:
                self.evaluate(valid_ds)
            self.checkpoints.poll()
            if ck.save_interval and it % ck.save_interval == 0:
                self.checkpoints.save(self.state)
            reason = self._stop(result.flags)
            if reason is not None:
                return reason
        self.checkpoints.save(self.state)
        return "finished"

    def _train_loader(self, train_ds):
        """This rank's loader from the resumed sample on; refused when it holds fewer
        micro-batches than the iterations left need (ramp-up included)."""
        b = self.cfg.batch
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
        return loader

    def _count(self, result: StepResult) -> None:
        """The iteration's counters: iterations, samples, skipped and non-finite steps, FLOPs."""
        state = self.state
        state.iteration += 1
        state.consumed_train_samples += self.global_batch
        state.skipped_iterations += int(result.skipped)
        state.nonfinite_iterations += int(result.nonfinite)
        if self.metrics.flops_per_batch:  # at the full --global-batch-size
            state.floating_point_operations_so_far += (
                self.metrics.flops_per_batch * self.global_batch / self.cfg.batch.global_batch_size
            )

    def _log_iteration(self, result: StepResult, step_start: float, cpu_start: float) -> None:
        """The iteration's scalars, and its line every --log-interval."""
        state, lg = self.state, self.cfg.log
        it = state.iteration
        if it % lg.tensorboard_log_interval == 0 or it % lg.log_interval == 0:
            extras = self.engine.log_stats()  # collective
            if lg.log_memory_to_tensorboard:
                extras.update(memory_stats())
            self.metrics.extras = extras
        self.metrics.iteration(
            result,
            state,
            global_batch=self.global_batch,
            seconds=time.time() - step_start,
            cpu_seconds=time.process_time() - cpu_start,
            loss_scale=self.engine.scaler.scale if self.engine.scaler is not None else None,
            elapsed_since_start=time.time() - self.start_time,
            timers=self.timers,
        )

    def _stop(self, flags) -> Optional[str]:
        """Why the loop stops after this iteration, once it has saved (None: it goes on)."""
        signal_received, timeout = flags
        it, interval = self.state.iteration, self.cfg.exit.exit_interval
        if signal_received:
            reason = "signal"
        elif timeout:
            reason = "exit-duration"
        elif interval and it % interval == 0:
            reason = "exit-interval"
        else:
            return None
        if self.is_rank0:
            logger.info("exiting at iteration %d (%s)", it, reason)
        self.checkpoints.save(self.state)
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


def train(trainer: Trainer, datasets_provider: DatasetsProvider) -> str:
    """Build the datasets, train to --train-iters (or an exit condition), then validate and
    test; with --skip-train only evaluate. Returns why training stopped: "finished", "signal",
    "exit-duration", "exit-interval" or "skip-train"."""
    cfg = trainer.cfg
    b, ev = cfg.batch, cfg.eval
    rank0 = trainer.is_rank0
    eval_samples = ev.eval_iters * b.global_batch_size
    num_samples = [b.train_iters * b.global_batch_size, eval_samples, eval_samples]
    train_ds, valid_ds, test_ds = datasets_provider(num_samples)
    if cfg.exit.skip_train:  # Megatron-LM's --skip-train: evaluate and exit
        if rank0:
            logger.info("--skip-train: evaluating iteration %d", trainer.state.iteration)
        trainer.evaluate(valid_ds)
        trainer.evaluate(test_ds, "test")
        return "skip-train"
    if trainer.state.iteration >= b.train_iters:
        if rank0:
            logger.info("already trained %d iterations: nothing to do", trainer.state.iteration)
        return "finished"
    reason = trainer.train(train_ds, valid_ds)
    trainer.checkpoints.wait()  # the latest marker moves once the last write completed
    if reason == "finished" and ev.eval_iters:
        if not ev.eval_interval or trainer.state.iteration % ev.eval_interval:  # not just done
            trainer.evaluate(valid_ds)
        trainer.evaluate(test_ds, "test")
    return reason


def close(trainer: Optional[Trainer], completed: bool = True) -> None:
    """End the run, whatever happened: profiler, signal handler, loss curve and TensorBoard,
    then the process groups (megatron's and torch.distributed's). `completed`: False when an
    error ends the run (a launch that fails before its first value writes no TensorBoard file).
    """
    try:
        if trainer is not None:
            trainer.extras.close()
            trainer.signal.release()
            trainer.metrics.close(completed)
    finally:
        destroy_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
