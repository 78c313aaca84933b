"""Data loaders of the loop: Megatron-LM's sequential pretraining sampler.

Micro-batch step j hands samples [j*mbs*dp, (j+1)*mbs*dp) to the DP ranks in rank order, so a
global batch is the same samples at every DP size and split, and a resume at `consumed_samples`
continues exactly. DataLoader workers ignore SIGTERM/SIGINT (a launcher signals whole process
groups; the rank decides when to stop); an exit hook, run before multiprocessing's, SIGKILLs
those still alive, so that a crashed rank does not wait forever for them.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util  # noqa: F401  (registers its exit hook before ours)
import os
import signal
import weakref
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader

from megatron_ext import _signals

__all__ = ["PretrainingSampler", "build_data_loader", "ignore_termination_signals"]


def ignore_termination_signals(worker_id: int = 0) -> None:
    """DataLoader `worker_init_fn`: leave SIGTERM and SIGINT to the rank; unblock them, which
    the rank blocked around the fork."""
    for sig in _signals.TERMINATION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    _signals.unblock()


_iterators_with_workers: "weakref.WeakSet" = weakref.WeakSet()


def _kill_workers_at_exit() -> None:
    """atexit: kill and reap the workers of the iterators still alive at interpreter exit.
    PyTorch's SIGCHLD handler ("DataLoader worker ... killed by signal") is reset first: raised
    in this hook it would leave the other workers for multiprocessing's hook to wait on."""
    workers = [
        worker
        for iterator in list(_iterators_with_workers)
        for worker in getattr(iterator, "_workers", ())
    ]
    if not workers:
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for worker in workers:
        if worker.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)
    for worker in workers:
        worker.join()


# Registered after multiprocessing's exit hook, so it runs before it (atexit runs last in first).
atexit.register(_kill_workers_at_exit)


class _SignalSafeDataLoader(DataLoader):
    """A DataLoader whose workers are forked with SIGTERM/SIGINT blocked (they inherit the mask
    until `ignore_termination_signals`); the rank's own mask is restored at once."""

    def __iter__(self):
        if self.num_workers == 0:
            return super().__iter__()
        with _signals.blocked():
            iterator = super().__iter__()
        _iterators_with_workers.add(iterator)
        return iterator


class PretrainingSampler:
    """Batches of sample indices for one data-parallel rank (Megatron's
    MegatronPretrainingSampler, `--dataloader-type single`)."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"the dataset has no samples ({total_samples})")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"bad data-parallel rank {data_parallel_rank}/{data_parallel_size}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank, self.size = data_parallel_rank, data_parallel_size
        self.step = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.step

    def __iter__(self) -> Iterator[list[int]]:
        start = self.rank * self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples - self.step + 1, self.step):
            yield list(range(first + start, first + start + self.micro_batch_size))


def build_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
) -> Optional[DataLoader]:
    """A DataLoader over `dataset` starting after `consumed_samples` (None without a dataset)."""
    if dataset is None or len(dataset) == 0:
        return None
    sampler = PretrainingSampler(
        len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
    )
    return _SignalSafeDataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        worker_init_fn=ignore_termination_signals if num_workers else None,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
    )
