"""Dropout's random streams on CPU, kept apart from everything else as megatron keeps them on GPU.

On GPU, dropout draws from the CUDA generator and the tracker's "model-parallel-rng" state,
never from the CPU generator; on CPU there is one generator, which other code draws from at
points that differ between a run and its resume. `CpuRNGStatesTracker` is megatron's tracker
over CPU generator states, plus DEVICE_RNG (the CPU twin of the CUDA default generator, used
inside `device_rng()`); checkpoints save its states and `checkpoint` replays them.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

import megatron_ext.megatron_import  # noqa: F401

import torch
from megatron.core.tensor_parallel import random as mcore_random
from torch.utils.checkpoint import checkpoint as torch_checkpoint

__all__ = [
    "DEVICE_RNG",
    "CpuRNGStatesTracker",
    "install_cpu_tracker",
    "cpu_tracker",
    "device_rng",
    "checkpoint",
]

DEVICE_RNG = "device-default-rng"
"""The CPU tracker's stand-in for the CUDA default generator (seeded as megatron seeds it)."""

_NOT_FORKED = "default-rng"  # megatron's name for "no fork active"


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """megatron's `CudaRNGStatesTracker` contract (`add`, nested `fork`) over CPU generator
    states; `states_` maps names to `torch.get_rng_state()` byte tensors."""

    def add(self, name: str, seed: int) -> None:
        """Track a new CPU state `name` seeded with `seed`."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"RNG state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    def manual_seed_device(self, seed: int) -> None:
        """Seed DEVICE_RNG (what `torch.cuda.manual_seed` does to the CUDA default generator)."""
        self.states_[DEVICE_RNG] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block on the CPU generator at `name`'s state, then restore the previous one."""
        if name not in self.states_:
            raise KeyError(f"RNG state {name} is not added")
        outer_state, outer_name = torch.get_rng_state(), self._current_state_name
        if outer_name != _NOT_FORKED:  # a nested fork: the outer state is live, keep it
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if outer_name != _NOT_FORKED:
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name

    def snapshot(self) -> tuple[dict[str, torch.Tensor], str]:
        """The states as they are now (a forked one's live state included) and the fork."""
        states = dict(self.states_)
        if self._current_state_name != _NOT_FORKED:
            states[self._current_state_name] = torch.get_rng_state()
        return states, self._current_state_name

    def replay(self, snapshot: tuple[dict[str, torch.Tensor], str]) -> ContextManager:
        """A context (reusable) that runs its block on the states of `snapshot` and leaves the
        live states as they were."""
        return _Replay(self, snapshot)


class _Replay:
    """See `CpuRNGStatesTracker.replay` (a class: torch may recompute a block more than once)."""

    def __init__(self, tracker: CpuRNGStatesTracker, snapshot) -> None:
        self.tracker, self.snapshot, self.live = tracker, snapshot, []

    def __enter__(self) -> None:
        t = self.tracker
        self.live.append((t.states_, t._current_state_name))
        t.states_, t._current_state_name = dict(self.snapshot[0]), self.snapshot[1]

    def __exit__(self, *exc) -> None:
        self.tracker.states_, self.tracker._current_state_name = self.live.pop()


def install_cpu_tracker() -> CpuRNGStatesTracker:
    """Make a fresh `CpuRNGStatesTracker` the one megatron's `get_cuda_rng_tracker()` returns
    (megatron-core has no hook for another kind: its module global is what callers read)."""
    tracker = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker


def cpu_tracker() -> Optional[CpuRNGStatesTracker]:
    """The installed CPU tracker, or None (on GPU: megatron's own)."""
    tracker = mcore_random._CUDA_RNG_STATE_TRACKER
    return tracker if isinstance(tracker, CpuRNGStatesTracker) else None


def device_rng() -> ContextManager:
    """What a training forward runs in: on CPU the DEVICE_RNG stream; nothing on GPU, where
    dropout outside tensor-parallel regions draws from the CUDA default generator itself."""
    tracker = cpu_tracker()
    if tracker is None or DEVICE_RNG not in tracker.states_:
        return contextlib.nullcontext()
    return tracker.fork(DEVICE_RNG)


def checkpoint(function: Callable, *args):
    """`torch.utils.checkpoint` (non-reentrant) whose recomputation also replays the CPU
    tracker's states, as megatron's `tensor_parallel.checkpoint` does for the CUDA tracker."""
    tracker = cpu_tracker()
    if tracker is None:
        return torch_checkpoint(function, *args, use_reentrant=False)

    def contexts():
        return contextlib.nullcontext(), tracker.replay(tracker.snapshot())

    return torch_checkpoint(function, *args, use_reentrant=False, context_fn=contexts)
