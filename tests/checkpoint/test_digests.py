"""Checkpoint digests (megatron_ext/checkpoint/digests.py) with real processes:

- on 2 gloo ranks (TP=2), saved synchronously and with --async-save: each rank records its
  files; one altered byte in each kind of file of a checkpoint (a shard of each rank,
  `.metadata`, common.json, args.json, each rank's RNG file, each rank's manifest), a file
  grown by a byte and a missing manifest are one CheckpointDigestError on every rank naming the
  iteration, the file and the newest older checkpoint that verifies (checked, not loaded);
  nothing of the damaged checkpoint is loaded;
- an old checkpoint without digests (the format before them: `digests/` removed and the RNG
  files rewritten as the code before this change wrote them) loads, RNG states included;
- through `pretrain_leviathan.py`, on a copy of the session's LEV run saved on 2 ranks at
  iterations 3 and 6 (`trained`, tests/conftest.py): 64 bytes altered in the middle of
  `__1_0.distcp` (a bad copy) stop the resume with one `error:` line and exit 2 before any
  iteration (with --no-verify-checkpoint it loads, as before digests); the old-format
  checkpoint resumes on 2 ranks with exactly one warning;
- `tools/convert_checkpoint.py verify`: exit 0 on a good checkpoint, 1 naming the damaged file,
  2 on a missing directory; export-hf refuses the damaged checkpoint (exit 2, the file named).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.runs import ENTRY_MODULE, run_command, run_tool, trained_run_flags

from .test_format import _tiny_model

pytestmark = pytest.mark.integration


def alter_byte(path: str, offset: int | None = None, count: int = 1, mask: int = 0xFF) -> None:
    """Flip the `mask` bits of `count` bytes of `path` from `offset` (default: its middle)."""
    size = os.path.getsize(path)
    offset = size // 2 if offset is None else offset
    with open(path, "r+b") as handle:
        handle.seek(offset)
        data = handle.read(count)
        handle.seek(offset)
        handle.write(bytes(b ^ mask for b in data))


def write_pre_digest_format(checkpoint: str) -> None:
    """Turn a checkpoint into the format before digests: no `digests/`, and each RNG file as
    the code before this change wrote it (torch.save of the states as Python returns them,
    numpy's as an array)."""
    shutil.rmtree(os.path.join(checkpoint, "digests"))
    from megatron_ext.checkpoint.safe_load import load_rng_file

    for name in os.listdir(os.path.join(checkpoint, "rng")):
        path = os.path.join(checkpoint, "rng", name)
        torch.save(load_rng_file(path), path)


def _damage_every_kind(root: str) -> dict:
    from megatron_ext.checkpoint import format as ck
    from megatron_ext.parallel import ProcessGroups

    pg = ProcessGroups.from_megatron()
    rank = torch.distributed.get_rank()
    model = _tiny_model()
    flags = {"embedding_type": "untied"}  # args.json
    for iteration in (1, 2):
        ck.save_checkpoint(root, ck.TrainState(iteration=iteration), model, pg=pg, args_json=flags)
    pending = ck.save_checkpoint(
        root, ck.TrainState(iteration=3), model, pg=pg, args_json=flags, async_save=True
    )
    pending.wait()
    out: dict = {"manifests": {}}
    for iteration in (1, 2, 3):
        path = ck.checkpoint_dir(root, iteration)
        out["manifests"][iteration] = sorted(os.listdir(os.path.join(path, "digests")))
        assert ck.verify_or_raise(root, iteration).ok
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}

    path = ck.checkpoint_dir(root, 3)
    kinds = [
        "__0_0.distcp", "__1_0.distcp", ".metadata", "common.json", "args.json",
        "rng/pp0_tp0_cp0_dp0.pt", "rng/pp0_tp1_cp0_dp0.pt",
        "digests/rank00000.json", "digests/rank00001.json",
    ]  # fmt: skip
    errors = {}

    def load_error(name: str) -> str:
        with torch.no_grad():  # a load that got through would change the weights
            for param in model.parameters():
                param.add_(1.0)
        with pytest.raises(ck.CheckpointDigestError) as caught:
            ck.load_checkpoint(root, model, pg=pg)
        for n, p in model.named_parameters():  # nothing was loaded
            assert torch.equal(p, saved[n] + 1.0), (name, n)
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(1.0)
        return str(caught.value)

    for name in kinds:
        file = os.path.join(path, name)
        if rank == 0:
            offset = None
            if name.endswith(".json") and name.startswith("digests"):
                offset = open(file).read().index('"digest": "') + 12  # inside a hex digest
            alter_byte(file, offset)
        torch.distributed.barrier()
        errors[name] = load_error(name)
        torch.distributed.barrier()
        if rank == 0:
            alter_byte(file, offset)  # flipped back: the checkpoint is whole again
        torch.distributed.barrier()
    assert ck.load_checkpoint(root, model, pg=pg).iteration == 3

    # A shard grown by a byte; a manifest gone.
    shard = os.path.join(path, "__0_0.distcp")
    if rank == 0:
        with open(shard, "ab") as handle:
            handle.write(b"\0")
        os.rename(os.path.join(path, "digests", "rank00001.json"), os.path.join(root, "m.json"))
    torch.distributed.barrier()
    errors["grown+manifest"] = load_error("grown")
    # The older checkpoints damaged too: none to fall back on.
    if rank == 0:
        for older in (1, 2):
            alter_byte(os.path.join(ck.checkpoint_dir(root, older), "common.json"))
    torch.distributed.barrier()
    errors["all damaged"] = load_error("all")

    # The format before digests: loads (with a warning), RNG states restored.
    if rank == 0:
        shutil.rmtree(root)
    torch.distributed.barrier()
    random.seed(11)
    np.random.seed(11)
    torch.manual_seed(11)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(11)
    np.random.seed(11)
    torch.manual_seed(11)
    ck.save_checkpoint(root, ck.TrainState(iteration=5), model, pg=pg)
    if rank == 0:
        write_pre_digest_format(ck.checkpoint_dir(root, 5))
    torch.distributed.barrier()
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    state = ck.load_checkpoint(root, model, pg=pg)
    drawn = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    out["old format"] = (state.iteration, drawn == expected)
    out["errors"] = errors
    return out


def test_one_altered_byte_in_any_file_is_named(tmp_path):
    root = str(tmp_path / "ckpt")
    for out in run_distributed(_damage_every_kind, 2, tp=2, args=(root,)):
        for iteration in (1, 2, 3):  # async_save (3) records them too
            assert out["manifests"][iteration] == ["rank00000.json", "rank00001.json"]
        errors = out["errors"]
        for name, error in errors.items():
            assert "Traceback" not in error, error
            if name in ("grown+manifest", "all damaged"):
                continue
            assert error.startswith("checkpoint iteration 3 cannot be loaded: "), error
            assert f"iter_0000003/{name} " in error, (name, error)
            what = "is damaged" if name.startswith("digests/") else "does not match the digest"
            assert what in error, (name, error)
            assert "iteration 2 verifies: load it with --ckpt-step 2" in error, error
        grown = errors["grown+manifest"]
        assert "iter_0000003/__0_0.distcp is longer than saved" in grown, grown
        assert "(and 1 more: digests/rank00001.json)" in grown, grown
        assert (
            "no older checkpoint in" in errors["all damaged"]
            and "verifies (2, 1)" in (errors["all damaged"])
        ), errors["all damaged"]
        assert out["old format"] == (5, True)


# ------------------------------------------------------------------- through the entry points


@pytest.fixture(scope="module")
def saved_run(trained, corpus) -> tuple:
    """The session's LEV run (TP=2, saved at iterations 3 and 6) and its flags."""
    nproc, args = trained_run_flags("lev", corpus)
    assert nproc == 2
    return Path(trained["ckpt"]["lev"]), [*args, "--eval-iters", "0"]


def _resume(d, args, *extra, nproc=2, name="resume"):
    """Resume `d`/ckpt with `args` + `extra`, saving to `d`/`name`_ckpt."""
    args = [*args, "--load", str(d / "ckpt"), "--save", str(d / f"{name}_ckpt"), *extra]
    run = run_command(ENTRY_MODULE, args, d, nproc=nproc)
    return run.returncode, run.stdout, run.stderr


def _convert(*argv, cwd):
    return run_tool("convert_checkpoint.py", list(argv), cwd)


def test_damaged_shard_stops_the_resume_and_the_tools(saved_run, tmp_path):
    ckpt, args = saved_run
    work = tmp_path / "damaged"
    shutil.copytree(ckpt, work / "ckpt")
    good = _convert("verify", "--load", "ckpt", cwd=work)
    assert good.returncode == 0 and "verify: ckpt/iter_0000006: " in good.stdout, good.stderr
    assert "match their digests" in good.stdout
    # The lowest bit of each byte: the parameters stay finite (all ones, as from a zero, would
    # be a NaN), so that the unverified load below trains.
    alter_byte(str(work / "ckpt" / "iter_0000006" / "__1_0.distcp"), count=64, mask=0x01)

    # On one rank (TP=1; the checkpoint is layout-free), so that the exit status is the
    # entry point's own (under torchrun the first rank to exit 2 makes torchrun stop the other).
    returncode, stdout, stderr = _resume(work, args, "--tensor-model-parallel-size", "1", nproc=1)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert returncode == 2 and len(errors) == 1, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    assert errors[0].startswith(
        "error: checkpoint iteration 6 cannot be loaded: ckpt/iter_0000006/__1_0.distcp does not "
        "match the digest recorded when it was saved"
    ), errors[0]
    assert "iteration 3 verifies: load it with --ckpt-step 3" in errors[0], errors[0]
    assert " iteration        7/" not in stdout  # nothing trained
    assert not (work / "resume_ckpt" / "save.lock").exists()  # released on the error too
    # --no-verify-checkpoint: the user's choice, said once; the damage is not noticed then.
    returncode, stdout, stderr = _resume(
        work, args, "--tensor-model-parallel-size", "1", "--no-verify-checkpoint",
        "--exit-interval", "7", nproc=1, name="unverified",
    )  # fmt: skip
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "--no-verify-checkpoint: loading without checking the digests" in stdout
    assert "loaded checkpoint ckpt/iter_0000006 (iteration 6" in stdout

    bad = _convert("verify", "--load", "ckpt", cwd=work)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "error: checkpoint iteration 6 cannot be loaded: ckpt/iter_0000006/__1_0.distcp" in (
        bad.stderr
    )
    older = _convert("verify", "--load", "ckpt/iter_0000003", cwd=work)
    assert older.returncode == 0 and "ckpt/iter_0000003: " in older.stdout, older.stderr
    missing = _convert("verify", "--load", "no_such_dir", cwd=work)
    assert missing.returncode == 2 and "error: checkpoint directory no_such_dir does not exist" in (
        missing.stderr
    )
    export = _convert("export-hf", "--load", "ckpt", "--output", "hf", cwd=work)
    assert export.returncode == 2 and "Traceback" not in export.stderr, export.stderr[-3000:]
    assert "ckpt/iter_0000006/__1_0.distcp does not match" in export.stderr
    assert not (work / "hf").exists()


def test_checkpoint_without_digests_resumes_with_one_warning(saved_run, tmp_path):
    ckpt, args = saved_run
    work = tmp_path / "old"
    shutil.copytree(ckpt, work / "ckpt")
    write_pre_digest_format(str(work / "ckpt" / "iter_0000006"))
    returncode, stdout, stderr = _resume(work, args, "--exit-interval", "7")
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    warnings = [line for line in stdout.splitlines() if "has no digests" in line]
    assert len(warnings) == 1, stdout[-3000:]
    assert "WARNING: checkpoint iteration 6 (ckpt/iter_0000006) has no digests" in warnings[0]
    assert "loaded checkpoint ckpt/iter_0000006 (iteration 6" in stdout
    assert "RNG states not restored" not in stdout  # the old RNG files are read
