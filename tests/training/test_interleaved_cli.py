"""--num-layers-per-virtual-pipeline-stage (or Megatron-LM's --num-virtual-stages-per-pipeline-
rank) from the command line: `pretrain_leviathan.py` on two gloo ranks (PP=2, two model chunks
per rank: the interleaved 1F1B schedule) logs the training and validation losses of the
single-rank run, through a --rampup-batch-size ramp; bad combinations of the flags are refused
with one line. Checkpoints of model chunks: tests/training/test_end_to_end.py."""

from __future__ import annotations

import math
import re

import pytest

from megatron_ext.config.arguments import ArgumentError, parse_config

RTOL = 1e-5
INTERLEAVED = [
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers-per-virtual-pipeline-stage",
    "1",
]
STAGES = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
SHORT = ["--exit-interval", "3", "--eval-interval", "2"]
# Batches 4, 4, 8: two and four micro-batches of 2 on PP=2 (the schedule's M % PP rule).
RAMP = ["--rampup-batch-size", "4", "4", "8"]


def _validation_losses(run) -> dict[int, float]:
    """The boxed evaluation lines: `validation loss at iteration N | lm loss value: X |`."""
    pattern = r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|"
    return {int(it): float(value) for it, value in re.findall(pattern, run.output)}


@pytest.mark.integration
def test_interleaved_pipeline_matches_one_rank(launcher, base_args, tmp_path):
    single = launcher(1, [*base_args, *SHORT, *RAMP], tmp_path / "pp1").check()
    interleaved = launcher(2, [*base_args, *SHORT, *RAMP, *INTERLEAVED], tmp_path / "vp2").check()
    assert "model chunks per pipeline rank: 2" in interleaved.output
    assert sorted(interleaved.losses) == [1, 2, 3]
    consumed = {r["iteration"]: r["consumed_samples"] for r in interleaved.records}
    assert consumed == {1: 4, 2: 8, 3: 16}, consumed  # the ramp: batches 4, 4, 8
    for it in (1, 2, 3):
        a, b = interleaved.losses[it], single.losses[it]
        assert math.isclose(a, b, rel_tol=RTOL), f"iteration {it}: {a!r} != {b!r}"
    grad_norms = {r["iteration"]: r["grad_norm"] for r in interleaved.records}
    for r in single.records:
        assert math.isclose(grad_norms[r["iteration"]], r["grad_norm"], rel_tol=RTOL), r
    assert "lm loss:" in interleaved.output and "grad norm:" in interleaved.output
    expected, actual = _validation_losses(single), _validation_losses(interleaved)
    assert sorted(expected) == sorted(actual) == [2], (expected, actual)
    assert math.isclose(actual[2], expected[2], rel_tol=RTOL), (actual, expected)


BASE = [
    "--micro-batch-size", "1", "--global-batch-size", "4", "--seq-length", "32", "--lr", "1e-3",
    "--train-iters", "10", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "100", "--num-layers", "4", "--hidden-size", "32",
    "--num-attention-heads", "4",
]  # fmt: skip


def test_the_flag_derives_the_chunks_per_rank():
    layout = parse_config([*BASE, *INTERLEAVED], world_size=2).parallel
    assert layout.num_layers_per_virtual_pipeline_stage == 1
    assert layout.virtual_pipeline_model_parallel_size == 2  # 4 layers / (PP 2 x 1)
    layout = parse_config([*BASE, "--pipeline-model-parallel-size", "2"], world_size=2).parallel
    assert layout.virtual_pipeline_model_parallel_size is None


def test_the_chunks_follow_the_models_depth_from_a_preset():
    """The layers per chunk come from the model's depth, a --model-size preset's included
    (before issue 47 the flag's None reached the division)."""
    argv = [*BASE[:-6], "--model-size", "400m", *STAGES]  # 16 layers
    layout = parse_config(argv, world_size=2).parallel
    assert layout.num_layers_per_virtual_pipeline_stage == 4  # 16 / (PP 2 x 2)


@pytest.mark.parametrize(
    "extra,world_size,message",
    [
        (["--num-layers-per-virtual-pipeline-stage", "1"], 1, "needs --pipeline-model-parallel"),
        ([*INTERLEAVED[:3], "2", "--num-layers", "6"], 2, "--num-layers 6 is not divisible by"),
        ([*INTERLEAVED[:2], "--num-layers-per-virtual-pipeline-stage", "0"], 2, "must be >= 1"),
        ([*INTERLEAVED, "--global-batch-size", "3"], 2, "micro-batches per iteration (3"),
        ([*INTERLEAVED, "--rampup-batch-size", "1", "1", "8"], 2, "START 1 to be a multiple"),
        ([*INTERLEAVED, "--rampup-batch-size", "2", "1", "8"], 2, "INCREMENT 1 to be a multi"),
        (STAGES[2:], 1, "stages-per-pipeline-rank needs --pipeline-model-parallel"),
        ([*STAGES[:3], "0"], 2, "--num-virtual-stages-per-pipeline-rank must be >= 1"),
        ([*STAGES[:3], "3"], 2, "--num-layers 4 is not divisible by"),
        ([*STAGES, *INTERLEAVED[2:]], 2, "cannot be set at the same time"),
        ([*STAGES, "--global-batch-size", "3"], 2, "micro-batches per iteration (3"),
        ([*STAGES, "--ddp-impl", "megatron"], 2, "runs on the portable engine"),
    ],
)
def test_bad_virtual_pipeline_flags_are_refused_in_one_line(extra, world_size, message):
    with pytest.raises(ArgumentError) as info:
        parse_config([*BASE, *extra], world_size=world_size)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert "-virtual-" in str(info.value) or "PP" in str(info.value)


def test_the_chunks_per_rank_spelling_maps_onto_the_same_config():
    """Megatron-LM's --num-virtual-stages-per-pipeline-rank N is num-layers / (PP x N) layers
    per chunk; N = 1 is no interleaving (as there)."""
    by_stages = parse_config([*BASE, *STAGES], world_size=2).parallel
    by_layers = parse_config([*BASE, *INTERLEAVED], world_size=2).parallel
    assert by_stages == by_layers
    for layout in (by_stages, by_layers):
        assert layout.num_layers_per_virtual_pipeline_stage == 1
        assert layout.virtual_pipeline_model_parallel_size == 2
    one = parse_config([*BASE, *STAGES[:3], "1"], world_size=2).parallel
    assert one.num_layers_per_virtual_pipeline_stage is None
    assert one.virtual_pipeline_model_parallel_size is None


def test_interleaved_runs_accept_checkpoints_and_a_batch_ramp():
    args = [*BASE, *INTERLEAVED, "--save", "ckpt", "--load", "ckpt"]
    ramp = ["--rampup-batch-size", "2", "2", "8", "--global-batch-size", "8"]
    parsed = parse_config([*args, *ramp], world_size=2)
    assert parsed.ckpt.save == "ckpt" and parsed.ckpt.load == "ckpt"
    assert list(parsed.batch.rampup_batch_size) == [2, 2, 8]
