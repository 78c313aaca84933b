"""The pretraining sampler (training.data): the same global batches at every DP and micro-batch
split, and resumption at the consumed-samples count."""

from __future__ import annotations

import pytest

from megatron_ext.training.data import PretrainingSampler


def _global_batches(dp: int, mbs: int, gbs: int, consumed: int = 0, total: int = 64):
    """Sample indices of each global batch, gathered over the DP ranks' micro-batches."""
    per_rank = [list(PretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
    flat = [idx for step in zip(*per_rank) for batch in step for idx in batch]
    return [sorted(flat[i : i + gbs]) for i in range(0, len(flat) - gbs + 1, gbs)]


@pytest.mark.parametrize("dp,mbs", [(1, 2), (2, 2), (4, 1), (2, 4)])
def test_global_batch_is_the_same_at_every_dp_and_micro_batch_split(dp, mbs):
    assert _global_batches(dp, mbs, 8) == _global_batches(1, 8, 8)


def test_sampler_resumes_at_consumed_samples():
    full = _global_batches(2, 2, 8)
    assert _global_batches(2, 2, 8, consumed=24) == full[3:]
    assert len(PretrainingSampler(64, 24, 2, 0, 2)) == 10
