"""Checkpoint atomicity on 2 gloo ranks (TP=2, DTensor shards): a save killed half-way leaves
the previous checkpoint as latest and loadable; a non-finite model is never saved; a checkpoint
of another embedding arm is refused."""

from __future__ import annotations

import os
import types

import pytest
import torch

from tests.support.distributed import run_distributed

pytestmark = pytest.mark.integration


class _Killed(BaseException):
    """Stands in for the process dying in the middle of torch.distributed.checkpoint.save."""


def _tiny_model(arm: str = "untied"):
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.config.model import ModelConfig
    from megatron_ext.models import build_model

    cfg = ModelConfig(
        vocab_size=128,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=16,
        embedding=dict(embedding_type=arm, lev=dict(seed_dim=8, rank=4, num_heads=2, num_knots=4)),
    )
    torch.manual_seed(0)
    return build_model(
        cfg,
        parallel=ParallelConfig(tensor_model_parallel_size=2),
        precision=PrecisionConfig(),
    )


def _killed_and_nonfinite_saves(root: str) -> bool:
    import torch.distributed.checkpoint as dcp

    from megatron_ext.checkpoint import format as ck
    from megatron_ext.parallel import ProcessGroups

    pg = ProcessGroups.from_megatron()
    model = _tiny_model()
    ck.save_checkpoint(root, ck.TrainState(iteration=1, consumed_train_samples=8), model, pg=pg)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)

    def dying_save(state, checkpoint_id, storage_writer=None):
        dcp.save(dict(list(state.items())[:3]), checkpoint_id=checkpoint_id)  # some shards
        raise _Killed()

    real = ck.dcp
    ck.dcp = types.SimpleNamespace(save=dying_save, load=real.load)
    try:
        ck.save_checkpoint(root, ck.TrainState(iteration=2), model, pg=pg)
        raise AssertionError("the save should have died")
    except _Killed:
        pass
    finally:
        ck.dcp = real
    assert ck.read_latest_iteration(root) == 1
    assert not os.path.exists(ck.checkpoint_dir(root, 2))
    # A save stopped by an exception (Ctrl-C's KeyboardInterrupt) removes its partial copy...
    torch.distributed.barrier()
    assert not os.path.exists(ck.checkpoint_dir(root, 2) + ".tmp")
    torch.distributed.barrier()  # every rank has looked before rank 0 leaves debris
    # ...a process killed outright cannot: its debris, which loads ignore.
    if torch.distributed.get_rank() == 0:
        os.makedirs(os.path.join(ck.checkpoint_dir(root, 2) + ".tmp", "rng"))
        with open(os.path.join(ck.checkpoint_dir(root, 2) + ".tmp", "__0_0.distcp"), "wb") as f:
            f.write(b"\0" * 100)
    torch.distributed.barrier()

    state = ck.load_checkpoint(root, model, pg=pg)
    assert state.iteration == 1 and state.consumed_train_samples == 8
    for name, param in model.named_parameters():
        assert torch.equal(param, saved[name]), name

    # A NaN anywhere (here only on TP rank 1) refuses the save on every rank.
    if torch.distributed.get_rank() == 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
    try:
        ck.save_checkpoint(root, ck.TrainState(iteration=3), model, pg=pg)
        raise AssertionError("a non-finite model was saved")
    except ck.NonFiniteStateError:
        pass
    assert ck.read_latest_iteration(root) == 1

    # The next good save replaces the debris and moves the marker.
    ck.load_checkpoint(root, model, pg=pg)
    ck.save_checkpoint(root, ck.TrainState(iteration=2), model, pg=pg, keep_last=1)
    torch.distributed.barrier()
    assert ck.read_latest_iteration(root) == 2
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]

    # A checkpoint of another embedding arm is refused, naming both arms.
    ck.save_checkpoint(
        root, ck.TrainState(iteration=4), model, pg=pg, args_json={"embedding_type": "untied"}
    )
    try:
        ck.load_checkpoint(root, _tiny_model("lev"), pg=pg)
        raise AssertionError("an untied checkpoint loaded into a lev model")
    except ck.CheckpointError as error:
        assert "--embedding-type untied" in str(error) and "--embedding-type lev" in str(error)
    return True


def test_killed_save_keeps_previous_checkpoint(tmp_path):
    assert run_distributed(_killed_and_nonfinite_saves, 2, tp=2, args=(str(tmp_path),)) == [
        True,
        True,
    ]
