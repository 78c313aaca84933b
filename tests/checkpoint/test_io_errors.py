"""Checkpoint I/O failures (megatron_ext/checkpoint/io_errors.py) on 2 gloo ranks (TP=2):

- a disk that fills up during a save on one rank: every rank raises one CheckpointSaveError
  saying "no space left on device", the `.tmp` is removed, the previous checkpoint stays the
  latest and the next save works; the same for a permission error;
- a truncated shard or `.metadata`: CheckpointError naming the file and the iteration and
  suggesting `--ckpt-step` of the older checkpoint (found by the digests; a `.metadata` loaded
  without verification fails to unpickle, also named);
- `--save` that cannot be written, or lacks the space for one checkpoint, is refused before the
  first iteration (here through pretrain_leviathan.py: exit 2, one `error:` line).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.runs import ENTRY_MODULE, run_command

from .test_format import _tiny_model

pytestmark = pytest.mark.integration


class _FillsUp:
    """A writable stream on a disk that is full after `room` bytes."""

    def __init__(self, stream, room: int) -> None:
        self._stream, self._room = stream, room

    def write(self, data) -> int:
        if len(data) > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(data)
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _failing_writes(failing_rank: int, error: str):
    """DCP's file streams fail on `failing_rank`: a full disk after 100 bytes (which torch's
    zip writer reports as "unexpected pos", as on a real full disk, while the file system
    reports no free space), or EACCES."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode or torch.distributed.get_rank() != failing_rank:
            with real(self, path, mode) as stream:
                yield stream
            return
        if error == "EACCES":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        with real(self, path, mode) as stream:
            yield _FillsUp(stream, 100)

    real_usage = shutil.disk_usage

    def disk_usage(path):  # what a full disk reports
        usage = real_usage(path)
        return usage._replace(free=0) if error == "ENOSPC" else usage

    FileSystem.create_stream = create_stream
    shutil.disk_usage = disk_usage
    try:
        yield
    finally:
        FileSystem.create_stream = real
        shutil.disk_usage = real_usage


def _save_and_load_failures(root: str) -> dict:
    from megatron_ext.checkpoint import format as ck
    from megatron_ext.checkpoint.io_errors import check_save_directory
    from megatron_ext.parallel import ProcessGroups

    pg = ProcessGroups.from_megatron()
    model = _tiny_model()
    ck.save_checkpoint(root, ck.TrainState(iteration=1), model, pg=pg)
    errors = {}
    for failing_rank, kind in ((1, "ENOSPC"), (0, "EACCES")):
        with _failing_writes(failing_rank, kind):
            with pytest.raises(ck.CheckpointSaveError) as caught:
                ck.save_checkpoint(root, ck.TrainState(iteration=2), model, pg=pg)
        torch.distributed.barrier()
        errors[kind] = str(caught.value)
        assert not os.path.exists(ck.checkpoint_dir(root, 2) + ".tmp"), kind
        assert not os.path.exists(ck.checkpoint_dir(root, 2)), kind
        assert ck.read_latest_iteration(root) == 1, kind

    # The run could go on: the next save works and is loadable.
    ck.save_checkpoint(root, ck.TrainState(iteration=2), model, pg=pg)
    assert ck.load_checkpoint(root, model, pg=pg).iteration == 2
    torch.distributed.barrier()

    # A truncated shard of iteration 2.
    path = ck.checkpoint_dir(root, 2)
    shard = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[-1]
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(path, shard), "r+b") as handle:
            handle.truncate(os.path.getsize(os.path.join(path, shard)) // 2)
    torch.distributed.barrier()
    with pytest.raises(ck.CheckpointError) as caught:
        ck.load_checkpoint(root, model, pg=pg)
    errors["shard"] = str(caught.value)
    torch.distributed.barrier()
    # A truncated .metadata.
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(path, ".metadata"), "r+b") as handle:
            handle.truncate(10)
    torch.distributed.barrier()
    with pytest.raises(ck.CheckpointError) as caught:
        ck.load_checkpoint(root, model, pg=pg)
    errors["metadata"] = str(caught.value)
    with pytest.raises(ck.CheckpointError) as caught:  # not verified: unpickling it fails
        ck.load_checkpoint(root, model, pg=pg, verify=False)
    errors["metadata_unverified"] = str(caught.value)
    assert ck.load_checkpoint(root, model, pg=pg, iteration=1).iteration == 1  # the hint works

    # --save checks: a path below a regular file; too little space for one checkpoint.
    blocker = os.path.join(root, "a_file")
    if torch.distributed.get_rank() == 0:
        open(blocker, "w").close()
    torch.distributed.barrier()
    errors["not_a_dir"] = check_save_directory(os.path.join(blocker, "ckpt"), 1)
    errors["space"] = check_save_directory(os.path.join(root, "fresh"), 1 << 60)
    errors["fine"] = check_save_directory(os.path.join(root, "fresh"), 1 << 20)
    return errors


def test_save_and_load_failures_are_one_clear_error(tmp_path):
    root = str(tmp_path / "ckpt")
    for errors in run_distributed(_save_and_load_failures, 2, tp=2, args=(root,)):
        full, denied = errors["ENOSPC"], errors["EACCES"]
        assert "saving iteration 2" in full and "no space left on device on rank 1" in full, full
        assert "iteration 1 is still the latest" in full and "iter_0000002.tmp" in full, full
        assert "permission denied on rank 0 (EACCES" in denied, denied
        assert "Traceback" not in full + denied

        shard = errors["shard"]
        assert "checkpoint iteration 2 cannot be loaded" in shard, shard
        assert ".distcp is truncated" in shard and "--ckpt-step 1" in shard, shard
        meta = errors["metadata"]  # the digests name it (and the truncated shard)
        assert "iteration 2" in meta and ".metadata is truncated (10 of" in meta, meta
        assert "(and 1 more: __1_0.distcp)" in meta and "iteration 1 verifies" in meta, meta
        assert "--ckpt-step 1" in meta, meta
        meta = errors["metadata_unverified"]
        assert "iteration 2" in meta and "corrupt or truncated" in meta, meta
        assert "--ckpt-step 1" in meta, meta

        assert "not a directory" in errors["not_a_dir"], errors["not_a_dir"]
        assert "free, but a checkpoint needs about" in errors["space"], errors["space"]
        assert errors["fine"] is None


def test_unwritable_save_is_refused_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "5", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--save", str(blocker / "ckpt"), "--eval-iters", "0",
        "--log-jsonl", str(tmp_path / "metrics.jsonl"), "--no-loss-curve",
    ]  # fmt: skip
    run = run_command(ENTRY_MODULE, args, tmp_path)
    returncode, stdout, stderr = run.returncode, run.stdout, run.stderr
    assert returncode == 2, stdout[-3000:] + stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"--save {blocker / 'ckpt'} cannot hold" in errors[0], errors
    assert "not a directory" in errors[0], errors
    assert "Traceback" not in stderr
    assert not (tmp_path / "metrics.jsonl").exists()  # no iteration ran
