"""The training loop: `pretrain(cfg, model_provider=..., forward_step=..., datasets_provider=...)`,
Megatron-LM's entry contract on the portable (gloo/NCCL) machinery of this package.

`pretrain` initialises the process groups (`parallel.initialize_parallel` returns them as one
`ProcessGroups`, passed to everything that communicates) and runs three steps: `setup` (seeds,
model, optimizer, checkpoint load), `train` (datasets, the iterations, final evaluation) and
`close` (logs, profiler, process groups), which runs whatever happened.

One iteration: forward/backward over the micro-batches (`schedules.forward_backward`, 1F1B under
pipeline parallelism) -> Megatron's gradient reductions (sequence-parallel norms, tied
embeddings) -> data-parallel all-reduce -> global grad-norm clipping -> one world all-reduce of
[loss sum, token count, non-finite flags, exit flags] -> optimizer step (or a stop / skip on a
non-finite loss or grad norm) -> scheduler step. Then logging, validation, checkpointing and the
exit conditions (--exit-signal-handler, --exit-duration-in-mins, --exit-interval), each of which
saves before leaving.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import time
from dataclasses import dataclass
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
from megatron_ext.training.checkpointing import (
    TrainState,
    load_checkpoint,
    read_latest_iteration,
    save_checkpoint,
)
from megatron_ext.training.config import TrainingConfig
from megatron_ext.training.data import build_data_loader
from megatron_ext.training.finalize_grads import (
    allreduce_sequence_parallel_grads,
    allreduce_tied_embedding_grads,
)
from megatron_ext.training.initialization import initialize_like_single_stage
from megatron_ext.training.megatron_features import RunExtras
from megatron_ext.training.metrics import (
    Reporter,
    flops_per_iteration,
    format_train_line,
    peak_tflops,
    run_info,
)
from megatron_ext.training.optimizer import (
    LossScaler,
    allreduce_data_parallel_grads,
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
)
from megatron_ext.training.precision import autocast_factory, pipeline_dtype
from megatron_ext.training.schedules import ForwardStep, PipelineShape, forward_backward

logger = logging.getLogger(__name__)

__all__ = ["pretrain", "setup", "train", "close", "NonFiniteError"]

ModelProvider = Callable[[bool, bool], torch.nn.Module]
DatasetsProvider = Callable[[Sequence[int]], tuple]


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm became NaN/inf; the run stopped without saving it."""


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


@dataclass
class _StepResult:
    loss: float
    grad_norm: float
    stepped: bool
    signal: bool
    timeout: bool


class _Trainer:
    """State and collaborators of one run (built by `setup`)."""

    def __init__(self, cfg: TrainingConfig, model, forward_step, pg: ProcessGroups):
        self.cfg, self.model, self.forward_step, self.pg = cfg, model, forward_step, pg
        b, prec = cfg.batch, cfg.precision
        self.features = cfg.features
        f = self.features
        self.optimizer = build_optimizer(
            model,
            cfg.optim,
            pg.dp_cp if cfg.parallel.use_distributed_optimizer else None,
            decoupled=(f.decoupled_lr, f.decoupled_min_lr) if f.decoupled_lr else None,
        )
        self.scheduler = build_scheduler(self.optimizer, cfg.optim)
        self.scaler = (
            LossScaler(
                prec.loss_scale,
                prec.initial_loss_scale,
                prec.min_loss_scale,
                prec.loss_scale_window,
                prec.hysteresis,
            )
            if prec.fp16
            else None
        )
        self.autocast = autocast_factory(prec)
        device = next(model.parameters()).device
        tp = cfg.parallel.tensor_model_parallel_size
        seq = b.seq_length // cfg.parallel.context_parallel_size
        if cfg.parallel.sequence_parallel:
            seq //= tp
        self.shape = PipelineShape(
            (seq, b.micro_batch_size, model.config.hidden_size), pipeline_dtype(prec), device
        )
        self.state = TrainState()
        self.is_rank0 = dist.get_rank() == 0
        self.reporter = Reporter(
            cfg.log.tensorboard_dir, cfg.log.tensorboard_queue_size, enabled=self.is_rank0
        )
        self.flops = flops_per_iteration(
            global_batch_size=b.global_batch_size,
            seq_length=b.seq_length,
            num_layers=model.config.num_layers,
            hidden_size=model.config.hidden_size,
            ffn_hidden_size=model.config.ffn_hidden_size,
            num_attention_heads=model.config.num_attention_heads,
            num_query_groups=model.config.num_query_groups or model.config.num_attention_heads,
            vocab_size=model.vocab_size,
        )
        self.peak = peak_tflops(cfg.log.peak_tflops)
        self.start_time = time.time()
        """Job start for --exit-duration-in-mins (`pretrain` sets the process's start time)."""
        self.step_seconds = 0.0
        """Wall time of the latest iteration (the exit-duration check's look-ahead)."""
        self.save_seconds = 0.0
        """Longest save (or load) of this run: the exit-duration check reserves it."""
        self.phase: tuple[str, Optional[dist.ProcessGroup]] = ("setup", None)
        """What the rank is doing and over which group: named when a collective times out."""
        self.signal = _SignalHandler() if cfg.exit.exit_signal_handler else None
        self.consecutive_nonfinite = 0
        self.last_saved: Optional[int] = None
        self.timers: dict[str, float] = {}
        self._last_mark = time.perf_counter()
        self.extras = RunExtras(cfg, pg)
        self.reporter.wandb = self.extras.wandb
        self.global_batch = b.global_batch_size
        """This iteration's global batch size (below the flag's during --rampup-batch-size)."""

    # ---------------------------------------------------------------- one iteration

    def _world_stats(self, totals: dict, local_loss_ok: bool, local_grad_ok: bool) -> list:
        """[loss sum, token count, bad-loss ranks, bad-grad ranks, signal, timeout] over all
        ranks; the loss counts once per data-parallel replica (TP rank 0 of the last stage)."""
        stats = torch.zeros(6, dtype=torch.float64)
        counts_loss = self.pg.is_last_stage and self.pg.tp_rank == 0
        if counts_loss and "lm loss" in totals:
            stats[0:2] = totals["lm loss"].cpu()
        stats[2] = 0.0 if local_loss_ok else 1.0
        stats[3] = 0.0 if local_grad_ok else 1.0
        stats[4] = 1.0 if self.signal is not None and self.signal.received else 0.0
        stats[5] = 1.0 if self._duration_exhausted() else 0.0
        if self.shape.device.type == "cuda":
            stats = stats.cuda()
        dist.all_reduce(stats)
        return stats.cpu().tolist()

    def _duration_exhausted(self) -> bool:
        """--exit-duration-in-mins: would one more iteration plus the final save end past the
        limit (from the job start)? Then this iteration is the last one, and the save after it
        ends before the limit as long as the next iteration and save take no longer than the
        slowest seen so far. Before any save or load was timed, a save is reserved
        max(2 iterations, 5% of the limit up to 60 s)."""
        limit = self.cfg.exit.exit_duration_in_mins
        if not limit:
            return False
        save = self.save_seconds
        if save <= 0:
            save = max(2 * self.step_seconds, min(3.0 * limit, 60.0))
        ahead = time.time() - self.start_time + self.step_seconds + save
        return ahead > 60.0 * limit

    def _bad_ranks(self, local_bad: bool) -> list[int]:
        flags = torch.zeros(dist.get_world_size(), dtype=torch.float32, device=self.shape.device)
        flags[dist.get_rank()] = 1.0 if local_bad else 0.0
        dist.all_reduce(flags)
        return [r for r, f in enumerate(flags.tolist()) if f > 0]

    def _mark(self, name: Optional[str] = None) -> None:
        """--timing-log-level >= 1: add the time since the previous mark to `name`."""
        if self.cfg.log.timing_log_level == 0:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if name is not None:
            self.timers[name] = self.timers.get(name, 0.0) + now - self._last_mark
        self._last_mark = now

    def train_step(self, data_iterator) -> _StepResult:
        b, p = self.cfg.batch, self.cfg.parallel
        self._mark()
        self.optimizer.zero_grad()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        f = self.features
        self.phase = ("forward-backward (tensor/pipeline-parallel group)", self.pg.mp)
        totals = forward_backward(
            forward_step=self.forward_step,
            data_iterator=data_iterator,
            model=self.model,
            num_microbatches=self.global_batch // (b.micro_batch_size * p.data_parallel_size),
            shape=self.shape,
            pg=self.pg,
            loss_scale=scale,
            autocast=self.autocast,
            per_token_loss=f.calculate_per_token_loss,
        )
        self._mark("forward-backward")
        if p.sequence_parallel:
            allreduce_sequence_parallel_grads([self.model], self.pg.tp)
        allreduce_tied_embedding_grads([self.model], self.pg.embd)
        self.phase = ("data-parallel gradient all-reduce (data-parallel group)", self.pg.dp_cp)
        grad_scale = 1.0 / scale
        if f.calculate_per_token_loss:
            grad_scale *= self._per_token_grad_scale(totals)
        grads_ok = allreduce_data_parallel_grads(
            self.optimizer.params,
            self.pg.dp_cp,
            scale=grad_scale,
            reduce_dtype=torch.bfloat16 if f.grad_reduce_in_bf16 else None,
        )
        self._mark("grads-all-reduce")
        grad_norm = clip_grad_norm(self.optimizer.params, self.cfg.optim.clip_grad, self.pg)
        self._mark("grad-norm-and-clip")
        loss_ok = all(bool(torch.isfinite(v).all()) for v in totals.values())
        self.phase = ("all-reduce of the iteration's loss and exit flags (world group)", None)
        stats = self._world_stats(totals, loss_ok, grads_ok)
        loss = stats[0] / stats[1] if stats[1] > 0 else float("nan")
        grad_finite = math.isfinite(grad_norm)
        loss_finite = math.isfinite(loss) and stats[2] == 0
        iteration = self.state.iteration + 1
        stepped = False
        if self.scaler is not None and loss_finite and not grad_finite:
            # An FP16 overflow: halve the scale (after hysteresis) and skip the step.
            self.scaler.update(True)
            self.state.skipped_iterations += 1
        elif self.cfg.exit.check_for_nan_in_loss_and_grad and not (loss_finite and grad_finite):
            self._nonfinite(iteration, loss, grad_norm, loss_ok, grads_ok, stats)
            self.state.skipped_iterations += 1
        else:
            self.optimizer.step()
            self.scheduler.step(increment=self.global_batch)
            if self.scaler is not None:
                self.scaler.update(False)
            self.consecutive_nonfinite = 0
            stepped = True
        self._mark("optimizer")
        return _StepResult(loss, grad_norm, stepped, stats[4] > 0, stats[5] > 0)

    def _per_token_grad_scale(self, totals: dict) -> float:
        """--calculate-per-token-loss: the loss is a sum over tokens; the gradient divides by
        the global batch's token count (the DP average then multiplies back by DP x CP)."""
        count = torch.zeros(1, dtype=torch.float64, device=self.shape.device)
        if self.pg.is_last_stage and self.pg.tp_rank == 0 and "lm loss" in totals:
            count[0] = totals["lm loss"][1]
        dist.all_reduce(count)
        dp_cp = self.pg.dp_cp_size
        return dp_cp / max(float(count.item()), 1.0)

    def _nonfinite(self, iteration, loss, grad_norm, loss_ok, grads_ok, stats) -> None:
        ex = self.cfg.exit
        self.state.nonfinite_iterations += 1
        self.consecutive_nonfinite += 1
        bad_loss = self._bad_ranks(not loss_ok) if stats[2] else []
        bad_grad = self._bad_ranks(not grads_ok) if stats[3] else []
        where = []
        if bad_loss:
            where.append(f"non-finite loss on rank(s) {bad_loss}")
        if bad_grad:
            where.append(f"non-finite gradients on rank(s) {bad_grad}")
        message = f"iteration {iteration}: loss {loss} / grad norm {grad_norm} is not finite" + (
            f" ({'; '.join(where)})" if where else ""
        )
        if not ex.skip_nonfinite_steps:
            raise NonFiniteError(
                message + "; stopped without saving (--skip-nonfinite-steps skips such steps)"
            )
        if self.consecutive_nonfinite >= ex.max_nonfinite_steps:
            raise NonFiniteError(
                message + f"; {self.consecutive_nonfinite} non-finite iterations in a row "
                "(--max-nonfinite-steps), stopped"
            )
        if self.is_rank0:
            logger.warning("%s; skipping the optimizer step", message)

    # ---------------------------------------------------------------- validation

    def evaluate(self, dataset, name: str = "validation") -> Optional[float]:
        """Mean loss over the first --eval-iters global batches of `dataset` (the same samples
        at every evaluation, so that validation curves compare like with like)."""
        b, ev = self.cfg.batch, self.cfg.eval
        num_microbatches = self.cfg.num_microbatches
        if dataset is None or ev.eval_iters == 0:
            return None
        loader = build_data_loader(
            dataset,
            0,
            b.micro_batch_size,
            self.pg.dp_rank,
            self.pg.dp_size,
            b.num_workers,
        )
        if loader is None or len(loader.batch_sampler) < ev.eval_iters * num_microbatches:
            if self.is_rank0:
                logger.warning("%s set is smaller than --eval-iters global batches", name)
            return None
        iterator = iter(loader)
        totals: dict[str, torch.Tensor] = {}
        self.extras.around_eval()
        self.model.eval()
        try:
            for _ in range(ev.eval_iters):
                step = forward_backward(
                    forward_step=self.forward_step,
                    data_iterator=iterator,
                    model=self.model,
                    num_microbatches=num_microbatches,
                    shape=self.shape,
                    pg=self.pg,
                    forward_only=True,
                    autocast=self.autocast,
                )
                for key, value in step.items():
                    totals[key] = totals[key] + value if key in totals else value
        finally:
            self.model.train()
            self.extras.around_eval()
        stats = self._world_stats(totals, True, True)
        return stats[0] / stats[1] if stats[1] > 0 else None

    def log_evaluation(self, loss: Optional[float], name: str) -> None:
        if loss is None or not self.is_rank0:
            return
        ppl = math.exp(min(20.0, loss))
        it = self.state.iteration
        line = (
            f" {name} loss at iteration {it} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
        )
        bar = "-" * len(line)
        logger.info("%s\n%s\n%s", bar, line, bar)
        tag = "lm loss validation" if name == "validation" else f"lm loss {name}"
        self.reporter.scalar(tag, loss, it)
        self.reporter.scalar(f"{tag} ppl", ppl, it)
        self.reporter.scalar(f"{tag} vs samples", loss, self.state.consumed_train_samples)

    # ---------------------------------------------------------------- checkpoints

    def save(self) -> None:
        ck = self.cfg.ckpt
        if not ck.save or self.last_saved == self.state.iteration:
            return
        self.wait_for_save()  # one background write at a time
        self.phase = ("checkpoint save (world group)", None)
        started = time.time()
        saved = save_checkpoint(
            ck.save,
            self.state,
            self.model,
            None if ck.no_save_optim else self.optimizer,
            self.scheduler,
            self.scaler,
            pg=self.pg,
            args_json=ck.args_json,
            save_rng=not ck.no_save_rng,
            keep_last=ck.ckpt_keep_last,
            async_save=self.features.async_save,
        )
        if self.features.async_save:
            self.pending_save = saved
        self.last_saved = self.state.iteration
        self.save_seconds = max(self.save_seconds, time.time() - started)
        self.phase = ("training loop (world group)", None)

    def wait_for_save(self) -> None:
        """--async-save: finish the checkpoint being written (collective)."""
        if getattr(self, "pending_save", None) is not None:
            self.pending_save.wait()
            self.pending_save = None

    def poll_save(self) -> None:
        """--async-save: finish the checkpoint if every rank's write is done (collective)."""
        if getattr(self, "pending_save", None) is not None and self.pending_save.poll():
            self.pending_save = None

    def load(self) -> None:
        ck = self.cfg.ckpt
        if not ck.load:
            return
        started = time.time()
        state = load_checkpoint(
            ck.load,
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            pg=self.pg,
            iteration=ck.ckpt_step,
            load_optim=not ck.no_load_optim,
            load_rng=not ck.no_load_rng,
            finetune=ck.finetune,
            strict_missing=ck.exit_on_missing_checkpoint or ck.ckpt_step is not None,
        )
        if state is not None:
            # Reading a checkpoint takes about as long as writing it: the exit-duration check
            # reserves that much before this run's first save.
            self.save_seconds = time.time() - started
            self.state = state
            if not ck.finetune:
                self.last_saved = state.iteration if ck.load == ck.save else None

    # ---------------------------------------------------------------- the loop

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
        if self.is_rank0 and lg.log_jsonl:
            _truncate_jsonl(lg.log_jsonl, self.state.iteration)
        iterator = iter(loader)
        self.model.train()
        interval_start, interval_iters = time.time(), 0
        grad_norms: list[float] = []
        losses: list[float] = []
        reason = "finished"
        while self.state.iteration < b.train_iters:
            step_start, step_cpu_start = time.time(), time.process_time()
            self.global_batch = self.extras.global_batch(self.state.consumed_train_samples)
            self.extras.before_step(self.state.iteration + 1)
            result = self.train_step(iterator)
            self.state.iteration += 1
            self.state.consumed_train_samples += self.global_batch
            self.state.floating_point_operations_so_far += (
                self.flops * self.global_batch / b.global_batch_size
            )
            self.extras.after_step(self.state.iteration)
            self.step_seconds = max(self.step_seconds, time.time() - step_start)
            it = self.state.iteration
            interval_iters += 1
            losses.append(result.loss)
            grad_norms.append(result.grad_norm)
            if it % lg.tensorboard_log_interval == 0 or it % lg.log_interval == 0:
                self.last_extras = self.extras.stats(self.optimizer.params)  # collective
            if it % lg.tensorboard_log_interval == 0:
                self._tensorboard(result, it)
            self._jsonl(result, it, time.time() - step_start, time.process_time() - step_cpu_start)
            if it % lg.log_interval == 0:
                self._log_line(interval_start, interval_iters, losses, grad_norms)
                interval_start, interval_iters = time.time(), 0
                losses, grad_norms = [], []
            ev = self.cfg.eval
            if ev.eval_iters and valid_ds is not None and it % ev.eval_interval == 0:
                self.log_evaluation(self.evaluate(valid_ds), "validation")
            ck = self.cfg.ckpt
            self.poll_save()
            if ck.save_interval and it % ck.save_interval == 0:
                self.save()
            if result.signal:
                reason = "signal"
            elif result.timeout:
                reason = "exit-duration"
            elif self.cfg.exit.exit_interval and it % self.cfg.exit.exit_interval == 0:
                reason = "exit-interval"
            if reason != "finished":
                if self.is_rank0:
                    logger.info("exiting at iteration %d (%s)", it, reason)
                self.save()
                self.wait_for_save()
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

    def _jsonl(self, result: _StepResult, it: int, seconds: float, cpu_seconds: float) -> None:
        path = self.cfg.log.log_jsonl
        if not path or not self.is_rank0:
            return
        record = dict(
            iteration=it,
            consumed_samples=self.state.consumed_train_samples,
            loss=result.loss,
            grad_norm=result.grad_norm,
            lr=self.optimizer.get_lr(),
            stepped=result.stepped,
            seconds=seconds,
            cpu_seconds=cpu_seconds,  # this process's CPU time: robust on a shared machine
        )
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def _tensorboard(self, result: _StepResult, it: int) -> None:
        r = self.reporter
        r.scalar("lm loss", result.loss, it)
        r.scalar("lm loss vs samples", result.loss, self.state.consumed_train_samples)
        if math.isfinite(result.loss):
            r.scalar("lm loss ppl", math.exp(min(20.0, result.loss)), it)
        r.scalar("learning-rate", self.optimizer.get_lr(), it)
        r.scalar("grad-norm", result.grad_norm, it)
        if self.scaler is not None and self.features.log_loss_scale_to_tensorboard:
            r.scalar("loss-scale", self.scaler.scale, it)
        tokens = self.state.consumed_train_samples * self.cfg.batch.seq_length
        r.scalar("lm loss vs tokens", result.loss, tokens)
        r.scalar("batch-size", self.global_batch, it)
        if self.features.log_world_size_to_tensorboard:
            r.scalar("world-size", dist.get_world_size(), it)
        for key, value in getattr(self, "last_extras", {}).items():
            r.scalar(key, value, it)

    def _log_line(self, start: float, iters: int, losses, grad_norms) -> None:
        self._report(start, iters, losses, grad_norms)
        self.timers.clear()

    def _report(self, start: float, iters: int, losses, grad_norms) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = (time.time() - start) / max(iters, 1)
        b = self.cfg.batch
        world = dist.get_world_size()
        tflops = self.flops * self.global_batch / b.global_batch_size / elapsed / world / 1e12
        tokens = self.global_batch * b.seq_length / elapsed
        finite = [x for x in losses if math.isfinite(x)]
        values = dict(
            iteration=self.state.iteration,
            train_iters=b.train_iters,
            consumed_samples=self.state.consumed_train_samples,
            iteration_ms=1000 * elapsed,
            tflops=tflops if (torch.cuda.is_available() or self.cfg.log.log_throughput) else None,
            mfu=tflops / self.peak if self.peak else None,
            tokens_per_sec=tokens,
            lr=self.optimizer.get_lr(),
            global_batch_size=self.global_batch,
            elapsed=time.time() - self.start_time,
            eta=elapsed * (b.train_iters - self.state.iteration),
            consumed_tokens=self.state.consumed_train_samples * b.seq_length,
            extras=getattr(self, "last_extras", {}),
            loss=sum(finite) / len(finite) if finite else float("nan"),
            loss_scale=self.scaler.scale if self.scaler is not None else None,
            grad_norm=grad_norms[-1] if grad_norms else None,
            skipped=self.state.skipped_iterations,
            nonfinite=self.state.nonfinite_iterations,
        )
        if self.is_rank0:
            logger.info(format_train_line(values))
            if self.timers:
                logger.info(
                    "    time per iteration (ms): %s",
                    " | ".join(f"{k}: {1000 * v / iters:.1f}" for k, v in self.timers.items()),
                )
                if self.cfg.log.log_timers_to_tensorboard:
                    for key, value in self.timers.items():
                        self.reporter.scalar(f"timers/{key}", value / iters, self.state.iteration)
            it = self.state.iteration
            self.reporter.scalar("iteration-time", elapsed, it)
            self.reporter.scalar("throughput/tokens per second", tokens, it)
            self.reporter.scalar("throughput/TFLOP per second per GPU", tflops, it)
            if values["mfu"] is not None:
                self.reporter.scalar("throughput/MFU", values["mfu"], it)
            self.reporter.flush()


def _count_parameters(model: torch.nn.Module, pg: ProcessGroups) -> int:
    """Unique parameters of the whole model (TP shards summed, replicas and the tied copy once)."""
    tp_rank = pg.tp_rank
    total = 0
    for param in model.parameters():
        if getattr(param, "shared", False):
            continue
        if getattr(param, "tensor_model_parallel", False) or tp_rank == 0:
            total += param.numel()
    count = torch.tensor([float(total)], dtype=torch.float64)
    if torch.cuda.is_available():
        count = count.cuda()
    dist.all_reduce(count, group=pg.mp)
    return int(count.item())


def _truncate_jsonl(path: str, iteration: int) -> None:
    """--log-jsonl keeps one record per iteration: a run resumed at `iteration` drops the
    records after it (those iterations are trained again), and a torn last line."""
    if not os.path.isfile(path):
        return
    with open(path) as handle:
        lines = handle.readlines()
    keep = []
    for line in lines:
        try:
            if json.loads(line)["iteration"] <= iteration:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    if len(keep) == len(lines):
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as handle:
        handle.writelines(keep)
    os.replace(tmp, path)
    logger.info(
        "--log-jsonl %s: dropped %d record(s) after iteration %d",
        path,
        len(lines) - len(keep),
        iteration,
    )


def _check_save_directory(root: str, num_params: int, with_optimizer: bool) -> None:
    """Refuse to start when --save is not writable or cannot hold one checkpoint (fp32
    weights, plus two Adam moments each with the optimizer state)."""
    from megatron_ext.training.checkpoint_io import check_save_directory
    from megatron_ext.training.checkpointing import CheckpointError

    needed = 4 * num_params * (3 if with_optimizer else 1)
    problem = check_save_directory(root, needed)
    if problem is not None:
        raise CheckpointError(
            f"--save {os.path.abspath(root)} cannot hold checkpoints: {problem}; point --save "
            "at a writable directory with enough space"
        )


def setup(
    cfg: TrainingConfig,
    pg: ProcessGroups,
    *,
    model_provider: ModelProvider,
    forward_step: ForwardStep,
    full_model_provider: Optional[Callable[[], torch.nn.Module]] = None,
) -> _Trainer:
    """Seed, build this stage's model, its optimizer and the rest of the run, and load --load.

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
        for key, value in sorted(ck.args_json.items()):
            logger.info("  %s %s %s", key, "." * max(2, 40 - len(key)), value)
    # Megatron-LM's contract: the provider builds its stage on the groups it is given.
    model = model_provider(
        pre_process=pg.is_first_stage,
        post_process=pg.is_last_stage,
        pg_collection=pg.megatron_collection(),
    )
    resuming = bool(ck.load) and (
        ck.ckpt_step is not None or read_latest_iteration(ck.load) is not None
    )
    if p.pipeline_model_parallel_size > 1 and full_model_provider and not resuming:
        initialize_like_single_stage(model, full_model_provider, cfg.seed)
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    num_params = _count_parameters(model, pg)
    trainer_class = _Trainer
    if cfg.engine.ddp_impl == "megatron":  # CUDA only (gpu_arguments)
        from megatron_ext.training.megatron_engine import MegatronEngineTrainer

        trainer_class = MegatronEngineTrainer
    trainer = trainer_class(cfg, model, forward_step, pg)
    if rank0:
        logger.info("model parameters: %d (%.1fM)", num_params, num_params / 1e6)
        trainer.reporter.text(
            "config", "\n".join(f"    {k}: {v}" for k, v in sorted(ck.args_json.items()))
        )
    trainer.load()
    if ck.save:
        _check_save_directory(ck.save, num_params, with_optimizer=not ck.no_save_optim)
    return trainer


def train(trainer: _Trainer, datasets_provider: DatasetsProvider) -> str:
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
    if cfg.features.skip_train:  # Megatron-LM's --skip-train: evaluate and exit
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
    trainer.wait_for_save()  # the latest marker moves once the last write completed
    if reason == "finished" and ev.eval_iters:
        if trainer.state.iteration % ev.eval_interval:  # not just evaluated
            trainer.log_evaluation(trainer.evaluate(valid_ds), "validation")
        trainer.log_evaluation(trainer.evaluate(test_ds, "test"), "test")
    return reason


def close(trainer: Optional[_Trainer]) -> None:
    """End the run, whatever happened: profiler, signal handler, loss curve and TensorBoard,
    then the process groups (megatron's and torch.distributed's)."""
    try:
        if trainer is not None:
            cfg = trainer.cfg
            trainer.extras.close()
            if trainer.signal is not None:
                trainer.signal.release()
            if trainer.is_rank0 and cfg.log.loss_curve:
                curve = trainer.reporter.close(cfg.log.tensorboard_dir or cfg.ckpt.save)
                if curve:
                    logger.info("loss curve: %s", curve)
            else:
                trainer.reporter.close()
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
        )
        trainer.start_time = job_start
        _log_restart(trainer)
        return train(trainer, datasets_provider)
    except RuntimeError as error:
        if trainer is None or not is_collective_timeout(error):
            raise
        what, group = trainer.phase
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


def _log_restart(trainer: _Trainer) -> None:
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
