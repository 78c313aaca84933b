"""Loading a checkpoint runs no code from it (megatron_ext/checkpoint/safe_load.py).

The payload is a pickled object whose `__reduce__` creates a file when it is unpickled (shown
to work with plain `pickle`/`torch.load(weights_only=False)`); planted in an RNG file, in
`.metadata`, or as a bytes entry that `.metadata` declares, it is one error naming the file,
and the file it would create never appears:

- in this process: the RNG reader, the metadata reader (also a data file outside the
  checkpoint), DCP's load with the project's planner; both RNG formats load;
- through `pretrain_leviathan.py` resuming, and `tools/convert_checkpoint.py` export-hf and
  reshard, on a checkpoint whose digests were recomputed after the payload was planted (as a
  crafted checkpoint would be: digests find damage, not intent).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from megatron_ext.checkpoint.digests import file_digest, manifest_path, write_manifest
from megatron_ext.checkpoint.io_errors import UnsafeCheckpointError, causes
from megatron_ext.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_rng_file,
    read_metadata,
    save_rng_file,
)
from tests.support.runs import TINY_MOCK_RUN, run_command


class Payload:
    """Creates the file `marker` when unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _dcp_checkpoint(path: Path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _trusted_metadata(path: Path):
    with open(path / ".metadata", "rb") as handle:
        return pickle.load(handle)  # written by this test: trusted


def test_the_payload_runs_when_unpickled_plainly(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"random": Payload(marker)}, tmp_path / "rng.pt")
    torch.load(tmp_path / "rng.pt", weights_only=False)
    assert marker.exists()


def test_rng_file_with_a_payload_is_refused(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "rng.pt"
    torch.save({"random": Payload(marker)}, path)
    with pytest.raises(UnsafeCheckpointError) as caught:
        load_rng_file(str(path))
    assert str(path) in str(caught.value) and "io.open" in str(caught.value)
    assert "--no-load-rng" in str(caught.value)
    assert not marker.exists()


def test_rng_files_of_both_formats_load(tmp_path):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    save_rng_file(str(tmp_path / "new.pt"), state)
    torch.save(state, tmp_path / "old.pt")  # the format before digests (numpy's array inside)
    for name in ("new.pt", "old.pt"):
        loaded = load_rng_file(str(tmp_path / name))
        assert loaded["random"] == state["random"], name
        assert loaded["numpy"][0] == state["numpy"][0]
        assert np.array_equal(loaded["numpy"][1], state["numpy"][1]), name
        assert loaded["numpy"][2:] == state["numpy"][2:], name
        assert torch.equal(loaded["torch"], state["torch"]), name
    # The new format needs no global at all beyond torch's tensors.
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(tmp_path / "new.pt")) == []


def test_metadata_with_a_payload_is_refused(tmp_path):
    marker = tmp_path / "ran"
    ckpt = tmp_path / "ckpt"
    _dcp_checkpoint(ckpt, {"model.w": torch.ones(4)})
    metadata = _trusted_metadata(ckpt)
    metadata.planner_data = Payload(marker)
    with open(ckpt / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    for read in (
        lambda: read_metadata(str(ckpt / ".metadata")),
        lambda: SafeFileSystemReader(str(ckpt)).read_metadata(),
    ):
        with pytest.raises(UnsafeCheckpointError) as caught:
            read()
        assert f"{ckpt / '.metadata'} holds a pickled io.open" in str(caught.value)
        assert not marker.exists()


def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    _dcp_checkpoint(ckpt, {"model.w": torch.ones(4)})
    metadata = _trusted_metadata(ckpt)
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = _StorageInfo("../elsewhere", info.offset, info.length)
    with open(ckpt / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    with pytest.raises(UnsafeCheckpointError, match="names the data file '../elsewhere'"):
        read_metadata(str(ckpt / ".metadata"))


def test_bytes_entry_is_refused_by_the_planner(tmp_path):
    marker, ckpt = tmp_path / "ran", tmp_path / "ckpt"
    _dcp_checkpoint(ckpt, {"model.w": torch.ones(4), "extra": Payload(marker)})  # a bytes entry
    assert not marker.exists()
    target = {"model.w": torch.zeros(4), "extra": None}
    with pytest.raises(BaseException) as caught:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                target,
                storage_reader=SafeFileSystemReader(str(ckpt)),
                planner=SafeLoadPlanner(str(ckpt)),
                no_dist=True,
            )
    refused = [c for c in causes(caught.value) if isinstance(c, UnsafeCheckpointError)]
    assert refused and "declares extra as pickled bytes" in str(refused[0]), caught.value
    assert not marker.exists()


# ------------------------------------------------------------------- through the entry points

TINY = [*TINY_MOCK_RUN, "--train-iters", "4"]


def resign(checkpoint: Path, name: str) -> None:
    """Record the digest of the (changed) file `name` in its manifest, as a crafted checkpoint
    would: the digests then say nothing is damaged."""
    for rank in range(16):
        path = Path(manifest_path(str(checkpoint), rank))
        if not path.exists():
            break
        body = json.loads(path.read_text())
        if name in body["files"]:
            files = {k: file_digest(str(checkpoint / k)) for k in body["files"]}
            write_manifest(str(checkpoint), rank, body["world_size"], files)
            return
    raise AssertionError(f"{name} is in no manifest of {checkpoint}")


def _run_module(tmp_path, *argv, module=None, script=None):
    return run_command(module or str(script), list(argv), tmp_path, timeout=600)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 1-rank tiny run's checkpoint (iteration 4)."""
    d = tmp_path_factory.mktemp("safe_load")
    run = _run_module(d, *TINY, "--save", "ckpt", module="pretrain_leviathan")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return d / "ckpt"


def _resume(tmp_path: Path) -> subprocess.CompletedProcess:
    return _run_module(
        tmp_path, *TINY, "--load", "ckpt", "--save", "out", module="pretrain_leviathan"
    )


def _crafted(saved: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(saved, tmp_path / "ckpt")
    return tmp_path / "ckpt" / "iter_0000004"


def _one_error(run: subprocess.CompletedProcess) -> str:
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Traceback" not in run.stdout + run.stderr
    return errors[0]


@pytest.mark.integration
def test_rng_payload_is_refused_on_resume(saved, tmp_path):
    ckpt = _crafted(saved, tmp_path)
    marker = tmp_path / "ran"
    torch.save({"random": Payload(marker)}, ckpt / "rng" / "pp0_tp0_cp0_dp0.pt")
    resign(ckpt, "rng/pp0_tp0_cp0_dp0.pt")
    run = _run_module(
        tmp_path, *TINY, "--load", "ckpt", "--save", "out", module="pretrain_leviathan"
    )
    line = _one_error(run)
    assert "ckpt/iter_0000004/rng/pp0_tp0_cp0_dp0.pt holds a pickled io.open" in line, line
    assert not marker.exists()


@pytest.mark.integration
def test_metadata_payload_is_refused_by_resume_and_conversion(saved, tmp_path):
    ckpt = _crafted(saved, tmp_path)
    marker = tmp_path / "ran"
    metadata = _trusted_metadata(ckpt)
    metadata.planner_data = Payload(marker)
    with open(ckpt / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    resign(ckpt, ".metadata")
    tool = Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py"
    runs = {
        "resume": _resume(tmp_path),
        "export-hf": _run_module(
            tmp_path, "export-hf", "--load", "ckpt", "--output", "hf", "--no-tokenizer",
            script=tool,
        ),
        "reshard": _run_module(
            tmp_path, "reshard", "--load", "ckpt", "--output", "re", script=tool
        ),
    }  # fmt: skip
    for name, run in runs.items():
        line = _one_error(run)
        assert "ckpt/iter_0000004/.metadata holds a pickled io.open" in line, (name, line)
    assert not marker.exists()
    assert not (tmp_path / "hf").exists() and not (tmp_path / "re").exists()


@pytest.mark.integration
def test_bytes_entry_is_refused_on_resume(saved, tmp_path):
    ckpt = _crafted(saved, tmp_path)
    marker = tmp_path / "ran"
    payload = pickle.dumps(Payload(marker))
    (ckpt / "__payload.distcp").write_bytes(payload)
    metadata = _trusted_metadata(ckpt)
    key = "model.output_layer.weight"
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    for index in [i for i in metadata.storage_data if i.fqn == key]:
        del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__payload.distcp", 0, len(payload))
    with open(ckpt / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    resign(ckpt, ".metadata")
    run = _run_module(
        tmp_path, *TINY, "--load", "ckpt", "--save", "out", module="pretrain_leviathan"
    )
    line = _one_error(run)
    assert f"ckpt/iter_0000004/.metadata declares {key} as pickled bytes" in line, line
    assert not marker.exists()
    assert os.path.getsize(ckpt / "__payload.distcp") == len(payload)


def _payload_in_one_rng_file(root: str, marker: str) -> str:
    from megatron_ext.checkpoint import format as ck
    from megatron_ext.parallel import ProcessGroups
    from tests.checkpoint.test_format import _tiny_model

    pg = ProcessGroups.from_megatron()
    model = _tiny_model()
    ck.save_checkpoint(root, ck.TrainState(iteration=1), model, pg=pg)
    path = ck.checkpoint_dir(root, 1)
    if torch.distributed.get_rank() == 0:  # rank 1's file only, without digests to notice it
        import shutil

        shutil.rmtree(os.path.join(path, "digests"))
        torch.save({"random": Payload(marker)}, os.path.join(path, "rng", "pp0_tp1_cp0_dp0.pt"))
    torch.distributed.barrier()
    with pytest.raises(ck.CheckpointError) as caught:
        ck.load_checkpoint(root, model, pg=pg)
    return f"{type(caught.value).__name__}: {caught.value}"


@pytest.mark.integration
def test_a_payload_in_one_rank_s_rng_file_stops_every_rank(tmp_path):
    from tests.support.distributed import run_distributed

    marker = tmp_path / "ran"
    rank0, rank1 = run_distributed(
        _payload_in_one_rng_file, 2, tp=2, args=(str(tmp_path / "ckpt"), str(marker))
    )
    expected = "iter_0000001/rng/pp0_tp1_cp0_dp0.pt holds a pickled io.open"
    assert rank1.startswith("UnsafeCheckpointError: ") and expected in rank1, rank1
    assert rank0.startswith("CheckpointError: rank 1: ") and expected in rank0, rank0
    assert not marker.exists()
