"""The run's checkpoint glue: --save (with --async-save, one write in flight; only while this
run holds --save's lock), --load (verified unless --no-verify-checkpoint), and the bookkeeping
the exit conditions need (the slowest save, the last saved iteration). Both engines' model,
optimizer, scheduler and loss scaler go through the project's one format.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch.distributed as dist

from megatron_ext.checkpoint.format import (
    CheckpointError,
    PendingSave,
    TrainState,
    load_checkpoint,
    save_checkpoint,
)
from megatron_ext.checkpoint.io_errors import check_save_directory
from megatron_ext.checkpoint.lock import SaveLock
from megatron_ext.config.run import RunConfig
from megatron_ext.parallel import ProcessGroups
from megatron_ext.training.engine import Engine, Phase

__all__ = ["CheckpointManager"]

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Saves and loads the engine's model, optimizer, scheduler and loss scaler with the run's
    `TrainState`; `save_lock` (the run's `checkpoint.lock.SaveLock` of --save) is checked
    before every save."""

    def __init__(
        self,
        cfg: RunConfig,
        engine: Engine,
        pg: ProcessGroups,
        phase: Phase,
        save_lock: Optional[SaveLock] = None,
    ) -> None:
        self.cfg, self.engine, self.pg, self.phase = cfg, engine, pg, phase
        self.save_lock = save_lock
        self.pending: Optional[PendingSave] = None  # --async-save: the write in flight
        self.last_saved: Optional[int] = None  # a second save of it is skipped
        self.save_seconds = 0.0  # the longest save (or load): --exit-duration-in-mins reserves it

    def check_space(self, num_params: int) -> None:
        """Refuse to start when --save is not writable or cannot hold one checkpoint (fp32
        weights, plus two Adam moments each with the optimizer state)."""
        ck = self.cfg.ckpt
        needed = 4 * num_params * (1 if ck.no_save_optim else 3)
        problem = check_save_directory(ck.save, needed) if ck.save else None
        if problem is not None:
            raise CheckpointError(
                f"--save {os.path.abspath(ck.save)} cannot hold checkpoints: {problem}; point "
                "--save at a writable directory with enough space"
            )

    def save(self, state: TrainState) -> None:
        """Save `state` into --save (collective; nothing without --save or when this iteration
        is saved already)."""
        ck = self.cfg.ckpt
        if not ck.save or self.last_saved == state.iteration:
            return
        self.wait()  # one background write at a time
        self.phase.set("checkpoint save (world group)")
        if self.save_lock is not None:
            self.save_lock.check()  # another run took --save over: stop, do not overwrite
        started, e = time.time(), self.engine
        with e.checkpoint_view():
            saved = save_checkpoint(
                ck.save,
                state,
                e.model,
                None if ck.no_save_optim else e.optimizer,
                e.scheduler,
                e.scaler,
                pg=self.pg,
                args_json=self.cfg.args_json(),
                save_rng=not ck.no_save_rng,
                keep_last=ck.ckpt_keep_last,
                async_save=ck.async_save,
            )
        if ck.async_save:
            self.pending = saved
        self.last_saved = state.iteration
        self.save_seconds = max(self.save_seconds, time.time() - started)
        self.phase.set("training loop (world group)")

    def wait(self) -> None:
        """--async-save: finish the checkpoint being written (collective)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def poll(self) -> None:
        """--async-save: finish the checkpoint if every rank's write is done (collective)."""
        if self.pending is not None and self.pending.poll():
            self.pending = None

    def load(self) -> Optional[TrainState]:
        """Load --load into the engine's parts; the loaded state, or None (nothing to load)."""
        ck = self.cfg.ckpt
        if not ck.load:
            return None
        started = time.time()
        if not ck.verify_checkpoint and dist.get_rank() == 0:
            logger.info("--no-verify-checkpoint: loading without checking the digests")
        e = self.engine
        with e.checkpoint_view():
            state = load_checkpoint(
                ck.load,
                e.model,
                e.optimizer,
                e.scheduler,
                e.scaler,
                pg=self.pg,
                iteration=ck.ckpt_step,
                load_optim=not ck.no_load_optim,
                load_rng=not ck.no_load_rng,
                finetune=ck.finetune,
                strict_missing=ck.exit_on_missing_checkpoint or ck.ckpt_step is not None,
                verify=ck.verify_checkpoint,
            )
        if state is None:
            return None
        # Reading a checkpoint takes about as long as writing it: the exit-duration check
        # reserves that much before this run's first save.
        self.save_seconds = time.time() - started
        if not ck.finetune:
            self.last_saved = state.iteration if ck.load == ck.save else None
        return state
