"""Data loaders of the loop: Megatron-LM's sequential pretraining sampler.

Each iteration consumes the next `global_batch_size` samples of the (already shuffled) GPT
dataset; micro-batch step j hands samples [j*mbs*dp, (j+1)*mbs*dp) out to the DP ranks in rank
order. So the global batch is the same set of samples at every DP size and micro-batch split,
and resuming at `consumed_samples` continues exactly where the run stopped.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader

__all__ = ["PretrainingSampler", "build_data_loader"]


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
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
    )
