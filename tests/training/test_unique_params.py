"""The one "count each parameter once over the model-parallel group" predicate, used by the
grad norm (optimizer.clip_grad_norm), the params norm, zeros in grads and the parameter count
(unique_params)."""

from __future__ import annotations

import torch

from megatron_ext.training.unique_params import counted_once, counted_params


def _param(**attrs) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(2))
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


def test_shards_count_on_every_tp_rank_replicas_on_rank_zero_the_tied_copy_never():
    shard = _param(tensor_model_parallel=True)
    replica = _param()
    tied_copy = _param(shared=True, tensor_model_parallel=True)
    for tp_rank in (0, 1, 3):
        assert counted_once(shard, tp_rank)
        assert counted_once(replica, tp_rank) == (tp_rank == 0)
        assert not counted_once(tied_copy, tp_rank)
    assert counted_params([shard, replica, tied_copy], 0) == [shard, replica]
    assert counted_params([shard, replica, tied_copy], 1) == [shard]


def test_no_other_copy_of_the_predicate_in_the_training_package():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "megatron_ext"
    owners = [
        path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        if 'getattr(p, "tensor_model_parallel", False) or tp_rank == 0' in path.read_text()
        or 'getattr(param, "tensor_model_parallel", False)) or tp_rank == 0' in path.read_text()
    ]
    assert owners == ["training/unique_params.py"], owners
