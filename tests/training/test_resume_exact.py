"""A resumed run repeats the uninterrupted one bit for bit, with Megatron-LM's default dropout
(0.1), at every layout: one rank; DP=2 with DataLoader workers and a batch-size ramp-up whose
resume point is inside the ramp; TP=2 with sequence parallelism; PP=2; PP=2 x 2 model chunks
(interleaved 1F1B, `--num-virtual-stages-per-pipeline-rank`) with DataLoader workers. Each
layout runs 6 iterations uninterrupted (saving at 3 and 6, validating every 2: an evaluation
inside the save interval) and again resumed from its own iteration-3 checkpoint; the two runs
must log the same losses, grad norms, learning rates, consumed samples, validation and test
losses, and save the same parameters, Adam moments and dropout RNG states at iteration 6.

On CPU, dropout draws from generator states of its own that the checkpoint saves
(`megatron_ext.rng`): before them, a resumed run's training DataLoader iterator drew its base
seed from the CPU generator after the checkpoint's state was restored, which shifted every
dropout mask after the resume. A checkpoint loaded at another layout is exact only to a
tolerance (test_end_to_end.py); a restart under `torchrun --max-restarts` is test_cluster.py's.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_ext.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_rng_file,
    read_metadata,
)

pytestmark = pytest.mark.integration

# 1 layer, hidden 64, LEV (2 heads so that TP=2 owns one each), dropout at its default (0.1).
MODEL = [
    "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
    "--seq-length", "32", "--embedding-type", "lev", "--lev-seed-dim", "16", "--lev-rank", "4",
    "--lev-num-heads", "2", "--lev-num-knots", "5",
]  # fmt: skip
TRAIN = [
    "--micro-batch-size", "2", "--train-iters", "6", "--lr", "3e-3", "--min-lr", "3e-4",
    "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1",
    "--clip-grad", "1.0", "--seed", "1234", "--log-interval", "1", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--eval-interval", "2",
    "--eval-iters", "1", "--save-interval", "3", "--no-loss-curve",
]  # fmt: skip
RESUMED_FROM, LAST = 3, 6
RECORD_KEYS = ("iteration", "consumed_samples", "loss", "grad_norm", "lr")

LAYOUTS = {
    "one-rank": (1, ["--num-layers", "1", "--global-batch-size", "4"]),
    # Batches of 4, 4, 4, 4 (the ramp's 16 samples), then 8: iteration 3 is inside the ramp.
    "dp2-workers-rampup": (2, [
        "--num-layers", "1", "--global-batch-size", "8", "--rampup-batch-size", "4", "4", "16",
        "--num-workers", "2",
    ]),
    "tp2-sp": (2, [
        "--num-layers", "1", "--global-batch-size", "4", "--tensor-model-parallel-size", "2",
        "--sequence-parallel",
    ]),
    "pp2": (2, ["--num-layers", "2", "--global-batch-size", "4",
                "--pipeline-model-parallel-size", "2"]),
    "pp2x2-workers": (2, [
        "--num-layers", "4", "--global-batch-size", "4", "--pipeline-model-parallel-size", "2",
        "--num-virtual-stages-per-pipeline-rank", "2", "--num-workers", "2",
    ]),
}  # fmt: skip


def _outputs(run_dir) -> list[str]:
    return ["--save", str(run_dir / "ckpt"), "--tensorboard-dir", str(run_dir / "tb")]


def _evaluations(tb_dir) -> dict[tuple[str, int], float]:
    """(tag, iteration) -> value of the validation and test scalars in TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir))
    events.Reload()
    return {
        (tag, e.step): e.value
        for tag in ("lm loss validation", "lm loss test")
        if tag in events.Tags()["scalars"]
        for e in events.Scalars(tag)
    }


def _saved_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (parameters and Adam moments), whole."""
    metadata = read_metadata(str(path / ".metadata")).state_dict_metadata
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    dcp.load(
        state,
        storage_reader=SafeFileSystemReader(str(path)),
        planner=SafeLoadPlanner(str(path)),
        no_dist=True,
    )
    return state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # no_dist load
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_bit_identical_with_dropout(launcher, tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    args = [*MODEL, *TRAIN, *flags]
    chunked = "--num-virtual-stages-per-pipeline-rank" in flags
    whole_dir, resumed_dir = tmp_path / "whole", tmp_path / "resumed"
    whole = launcher(nproc, [*args, *_outputs(whole_dir)], whole_dir).check()
    load = ["--load", str(whole_dir / "ckpt"), "--ckpt-step", str(RESUMED_FROM)]
    resumed = launcher(nproc, [*args, *load, *_outputs(resumed_dir)], resumed_dir).check()

    assert f"(iteration {RESUMED_FROM}," in resumed.output  # "loaded checkpoint ... (iteration 3,"
    assert "RNG states not restored" not in resumed.output
    assert "no dropout RNG states" not in resumed.output
    # (The interleaved ranks also exit with their DataLoader workers: they once hung there.)
    assert ("model chunks per pipeline rank: 2 (1 layers each)" in resumed.output) == chunked
    saved_args = json.loads((whole_dir / "ckpt" / "iter_0000003" / "args.json").read_text())
    assert saved_args["hidden_dropout"] == saved_args["attention_dropout"] == 0.1

    after = [r for r in whole.records if r["iteration"] > RESUMED_FROM]
    assert [r["iteration"] for r in resumed.records] == list(range(RESUMED_FROM + 1, LAST + 1))
    for key in RECORD_KEYS:
        assert [r[key] for r in resumed.records] == [r[key] for r in after], key

    whole_evals, resumed_evals = _evaluations(whole_dir / "tb"), _evaluations(resumed_dir / "tb")
    expected = {k: v for k, v in whole_evals.items() if k[1] > RESUMED_FROM}
    assert {("lm loss validation", 4), ("lm loss test", LAST)} <= set(expected), whole_evals
    assert resumed_evals == expected

    final = f"iter_{LAST:07d}"
    whole_tensors = _saved_tensors(whole_dir / "ckpt" / final)
    resumed_tensors = _saved_tensors(resumed_dir / "ckpt" / final)
    assert sorted(resumed_tensors) == sorted(whole_tensors)
    assert any(key.startswith("optim.") for key in whole_tensors)
    for key, tensor in whole_tensors.items():
        assert torch.equal(resumed_tensors[key], tensor), key
    rng_files = sorted(p.name for p in (whole_dir / "ckpt" / final / "rng").iterdir())
    assert len(rng_files) == nproc
    for name in rng_files:
        a = load_rng_file(str(whole_dir / "ckpt" / final / "rng" / name))["cpu_tracker"]
        b = load_rng_file(str(resumed_dir / "ckpt" / final / "rng" / name))["cpu_tracker"]
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), name
