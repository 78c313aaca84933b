"""The batch-size ramp-up schedule (`config.rampup`) against megatron-core's own
calculator, consumed sample by consumed sample, and its refusals."""

from __future__ import annotations

import megatron_ext.megatron_import  # noqa: F401  (megatron-core's first import: see its docstring)

import pytest

from megatron_ext.config.rampup import BatchSizeRampup


def _megatron_rampup(gbs, mbs, dp, start, incr, samples):
    from megatron.core.num_microbatches_calculator import (
        RampupBatchsizeNumMicroBatchesCalculator,
    )

    return RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, False, 0, start, incr, samples)


@pytest.mark.parametrize(
    "gbs,mbs,dp,start,incr,samples",
    [
        (1536, 1, 1, 16, 16, 5_859_375),
        (64, 2, 2, 8, 4, 1000),
        (32, 1, 2, 2, 2, 37),
        (8, 1, 1, 4, 4, 16),
    ],
)
def test_rampup_matches_megatron_core(gbs, mbs, dp, start, incr, samples):
    ours = BatchSizeRampup(start, incr, samples, gbs, mbs * dp)
    reference = _megatron_rampup(gbs, mbs, dp, start, incr, samples)
    consumed = 0
    for _ in range(400):
        reference.update(consumed, consistency_check=True)
        assert ours.global_batch(consumed) == reference.get_current_global_batch_size(), consumed
        consumed += ours.global_batch(consumed)
    for probe in (0, 1, samples // 3, samples - 1, samples, samples + 1, 10 * samples + 7):
        reference.update(probe, consistency_check=False)
        assert ours.global_batch(probe) == reference.get_current_global_batch_size(), probe


def test_rampup_rejects_batches_that_do_not_split():
    with pytest.raises(ValueError, match="minus START 6 must be a non-negative multiple"):
        BatchSizeRampup(6, 4, 100, 16, 2)
    with pytest.raises(ValueError, match="INCREMENT 3 is not divisible"):
        BatchSizeRampup(4, 3, 100, 16, 2)
