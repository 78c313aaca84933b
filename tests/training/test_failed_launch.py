"""A launch that fails at start leaves nothing it created: no --save directory it made, no
TensorBoard event file or directory (issue 50 item 6), and says why in one `error:` line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_ext.checkpoint import lock as L
from tests.support.runs import ENTRY_MODULE, TINY_MOCK_RUN, run_command

pytestmark = pytest.mark.integration

RUN = [*TINY_MOCK_RUN, "--train-iters", "4", "--save", "runs/a/ckpt"]
RUN += ["--tensorboard-dir", "runs/a/tb"]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _fail(tmp_path: Path, args: list[str]) -> tuple[str, Path]:
    """Run `args` in a fresh working directory; its one error line and the directory."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    run = run_command(ENTRY_MODULE, args, work)
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    return errors[0], work


def _set(args: list[str], flag: str, value: str) -> list[str]:
    i = args.index(flag)
    return [*args[: i + 1], value, *args[i + 2 :]]


CASES = {
    # found when the datasets are built, after --save, TensorBoard and the model exist
    "bad-data-path": (
        [*(a for a in RUN if a != "--mock-data"), "--data-path", "nowhere/corpus_text_document"],
        "error: dataset not found: nowhere/corpus_text_document",
    ),
    # a flag value found wrong when the checkpoint is looked up (--load exists, empty)
    "bad-ckpt-step": (
        [*RUN, "--load", "empty", "--ckpt-step", "3"],
        "error: empty/iter_0000003 is not a complete checkpoint",
    ),
    # Megatron-LM refuses a sequence longer than the position table too
    "seq-length-over-max-position-embeddings": (
        [*RUN, "--max-position-embeddings", "8"],
        "error: --seq-length 16 is longer than --max-position-embeddings 8 (Megatron-LM "
        "refuses it too); raise --max-position-embeddings to at least 16",
    ),
    # a flag value found wrong once the world size is known
    "bad-batch-size": (
        _set(RUN, "--global-batch-size", "3"),
        "error: --global-batch-size 3 is not divisible by --micro-batch-size 2",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_failed_launch_leaves_nothing(tmp_path, case):
    args, error = CASES[case]
    (tmp_path / "work" / "empty").mkdir(parents=True)
    line, work = _fail(tmp_path, args)
    assert line.startswith(error), line
    assert _files(work) == ["empty"]  # no runs/: neither --save nor TensorBoard


def test_a_refused_save_keeps_the_holders_lock_and_writes_no_tensorboard(tmp_path):
    root = tmp_path / "work" / "runs" / "a" / "ckpt"
    root.mkdir(parents=True)
    holder = L.LockHolder.me()  # this test's process: alive, on this host
    (root / L.LOCK_FILENAME).write_text(json.dumps(dataclasses.asdict(holder)))
    before = (root / L.LOCK_FILENAME).read_text()
    line, work = _fail(tmp_path, RUN)
    assert line.startswith("error: --save runs/a/ckpt is in use by another run"), line
    assert _files(work) == ["runs", "runs/a", "runs/a/ckpt", "runs/a/ckpt/save.lock"]
    assert (root / L.LOCK_FILENAME).read_text() == before


def test_a_successful_run_still_writes_its_tensorboard_file(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    run = run_command(ENTRY_MODULE, RUN, work, merge_stderr=True)
    assert run.returncode == 0, run.stdout[-3000:]
    (events,) = (work / "runs" / "a" / "tb").glob("events.out.tfevents.*")
    content = events.read_bytes()
    assert b"config" in content and b"lm loss" in content  # the text entry and the scalars
    assert (work / "runs" / "a" / "ckpt" / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            [],
            "error: --context-parallel-size 2 needs --transformer-impl transformer_engine on a "
            "CUDA GPU (megatron-core's context-parallel attention is Transformer Engine's); "
            "without one, pass --context-parallel-size 1",
        ),
        (
            ["--transformer-impl", "transformer_engine"],
            "error: --transformer-impl transformer_engine needs a CUDA GPU; use local and "
            "--context-parallel-size 1",
        ),
    ],
)
def test_context_parallel_on_cpu_names_the_way_out(tmp_path, flags, error):
    """Megatron-LM's long-context flag on a machine without a GPU, on the 2 ranks it needs:
    each message leads to --context-parallel-size 1, not to the other message."""
    work = tmp_path / "work"
    work.mkdir()
    args = [*RUN, "--context-parallel-size", "2", *flags]
    run = run_command(ENTRY_MODULE, args, work, nproc=2, merge_stderr=True)
    output = run.stdout
    assert run.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [error], output[-3000:]
    assert "Traceback" not in output, output[-3000:]  # no rank prints one
    assert _files(work) == []
