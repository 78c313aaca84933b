import pytest
import torch
import torch.distributed as dist

from megatron_ext.testing.distributed import run_distributed

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


def test_four_ranks_tp2_pp2_groups():
    out = run_distributed(_layout_and_allreduce, world_size=4, tp=2, pp=2)
    assert [o[0] for o in out] == [0, 1, 0, 1]
    assert [o[1] for o in out] == [0, 0, 1, 1]
    assert [o[3] for o in out] == [3.0, 3.0, 7.0, 7.0]


def test_rank_failure_is_reported():
    with pytest.raises(RuntimeError, match="boom from a rank"):
        run_distributed(_raise, world_size=2, tp=2)


def test_bad_layout_rejected():
    with pytest.raises(ValueError, match="not divisible"):
        run_distributed(_layout_and_allreduce, world_size=3, tp=2)
