"""The data loaders (training.data): the pretraining sampler gives the same global batches at
every DP and micro-batch split and resumes at the consumed-samples count; a rank that dies of an
exception while its DataLoader workers run still exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from megatron_ext.launch import job_environment
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


# A rank's script: a loader with two workers (which ignore SIGTERM, as in training), one batch
# taken, then an exception that escapes, keeping the iterator alive in its traceback.
_CRASHING_RANK = """
import torch
from megatron_ext.training.data import build_data_loader

loader = build_data_loader([torch.tensor([i]) for i in range(64)], 0, 2, 0, 1, num_workers=2)
batches = iter(loader)
next(batches)
print("workers", *[worker.pid for worker in batches._workers], flush=True)
raise RuntimeError("the step failed")
"""


@pytest.mark.integration
def test_a_rank_that_raises_with_live_workers_exits_and_reaps_them(tmp_path):
    # multiprocessing's exit hook stops daemonic children with SIGTERM and joins them; our
    # workers ignore SIGTERM, so before the fix this process never exited (the timeout fires).
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(_CRASHING_RANK))
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=job_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "RuntimeError: the step failed" in proc.stderr
    pids = [int(pid) for pid in proc.stdout.split("workers", 1)[1].split()]
    assert len(pids) == 2
    for pid in pids:  # killed and reaped by the rank, not left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
