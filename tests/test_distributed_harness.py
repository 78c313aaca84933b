import pytest
import torch
import torch.distributed as dist

from tests.support.distributed import run_distributed

pytestmark = pytest.mark.integration


def _layout_and_allreduce():
    from megatron.core import parallel_state as ps

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank(),
        t.item(),
    )


def _raise():
    raise ValueError("boom from a rank")


# The four-rank TP=2 x PP=2 layout (ranks, groups, a TP all-reduce) is checked by
# tests/test_parallel.py::test_process_groups_match_megatron, which runs through this harness.


def test_rank_failure_is_reported():
    with pytest.raises(RuntimeError, match="boom from a rank"):
        run_distributed(_raise, world_size=2, tp=2)


def test_bad_layout_rejected():
    with pytest.raises(ValueError, match="not divisible"):
        run_distributed(_layout_and_allreduce, world_size=3, tp=2)
