"""The portable engine on gloo ranks (forked with torchrun's rank environment,
tests.support.distributed.run_entry): 1F1B and interleaved
1F1B (virtual pipeline stages) on torch.distributed.pipelining against one rank, torch DDP
around every pipeline stage with LEV's deferred gradients, and a NaN on one data-parallel rank
named.

A 4-layer tiny GPT trains 4 iterations from the single-stage model's weights: on one rank, as
2 pipeline stages of 2 layers (1F1B), and as 2 stages x 2 model chunks of 1 layer each (rank 0
holds layers 1 and 3, rank 1 layers 2 and 4; the activations go round the ring twice). All
three must report the same losses, grad norms and evaluation loss. With 4 micro-batches the
schedule runs warm-up, steady 1F1B and cool-down; with 2 (= the pipeline size) it is all
warm-up. The LEV arm (its backward once per global batch, after the schedule) trains on one
rank and as 2 stages x 2 chunks x 2 data-parallel replicas on 4 ranks: every stage's module is
a torch DDP, LEV's gradients are averaged by the engine's one explicit call, and the losses
match. Three launches serve every check here (the entry runs several cases per launch): one
rank runs the single-stage references, two ranks the pipelines and the data-parallel NaN run,
four ranks the pipeline with data parallelism.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_ext.training.pipeline import Pipeline, PipelineShape
from tests.support.distributed import run_entry

ENTRY = Path(__file__).with_name("_portable_entry.py")
ROOT = Path(__file__).resolve().parents[2]


def _launch(out: Path, nproc: int, *cases: str) -> None:
    out.mkdir(parents=True)
    log = out / "output.log"
    code = run_entry(str(ENTRY), nproc, [str(out), *cases], cwd=ROOT, log_path=log,
                     timeout=600, torchrun=True)  # fmt: skip
    assert code == 0, log.read_text()[-4000:]


NAN_RANK = 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Each case's output folder: "pp1_gb<B>" (one rank), "pp2_vp2_gb<B>" (2 ranks x 2 chunks),
    "pp2_gb<B>" (2 ranks x 1 chunk), "dp2_nan" (2 data-parallel ranks, NaN on NAN_RANK), and with
    LEV "lev_pp1_gb4" (one rank), "lev_pp2_vp2_dp2_gb4" (2 ranks x 2 chunks x DP 2)."""
    out = tmp_path_factory.mktemp("portable")
    _launch(out / "one", 1, "v1_gb4", "v1_gb2", "v1_gb1", "lev_v1_gb4")
    _launch(out / "two", 2, "v2_gb4", "v1_gb4", "v2_gb2", "v1_gb1", f"nan{NAN_RANK}")
    _launch(out / "four", 4, "lev_v2_dp2_gb4")
    return {
        "pp1_gb4": out / "one" / "v1_gb4", "pp1_gb2": out / "one" / "v1_gb2",
        "pp2_vp2_gb4": out / "two" / "v2_gb4", "pp2_gb4": out / "two" / "v1_gb4",
        "pp2_vp2_gb2": out / "two" / "v2_gb2", "dp2_nan": out / "two" / f"nan{NAN_RANK}",
        "pp1_gb1": out / "one" / "v1_gb1", "pp2_gb1": out / "two" / "v1_gb1",
        "lev_pp1_gb4": out / "one" / "lev_v1_gb4",
        "lev_pp2_vp2_dp2_gb4": out / "four" / "lev_v2_dp2_gb4",
    }  # fmt: skip


def _losses(run: Path) -> dict:
    return json.loads((run / "losses.json").read_text())


def _assert_same(actual: dict, expected: dict, rel: float = 1e-6) -> None:
    """The same losses, grad norms and evaluation loss (to `rel`), every step taken."""
    assert actual["stepped"] == [True] * 4, actual
    for key in ("losses", "grad_norms"):
        for it, (a, e) in enumerate(zip(actual[key], expected[key]), start=1):
            assert math.isclose(a, e, rel_tol=rel), f"{key} at iteration {it}: {a!r} != {e!r}"
    assert math.isclose(actual["eval_loss"], expected["eval_loss"], rel_tol=rel)


def test_interleaved_schedule_needs_micro_batches_in_groups_of_the_pipeline_size():
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    pg = SimpleNamespace(pp_size=2, pp_rank=0, is_first_stage=True, is_last_stage=False)
    shape = PipelineShape((2, 1, 2), torch.float32, torch.device("cpu"), loss_output=(1, 2))
    pipeline = Pipeline(chunks, forward_step=None, pg=pg, shape=shape)
    with pytest.raises(ValueError, match=r"micro-batches \(3\) to be a multiple of the pipeline"):
        pipeline.run(iter(()), 3)  # refused before any communication


@pytest.mark.integration
@pytest.mark.parametrize("global_batch", [4, 2], ids=["steady-1f1b", "all-warmup"])
def test_interleaved_pipeline_matches_one_rank(runs, global_batch):
    single = _losses(runs[f"pp1_gb{global_batch}"])
    interleaved = _losses(runs[f"pp2_vp2_gb{global_batch}"])
    assert interleaved["layers"] == [[[1], [3]], [[2], [4]]]  # rank -> chunk -> layer numbers
    assert len(set(single["losses"])) > 1  # the weights moved
    _assert_same(interleaved, single)
    # Without data parallelism the stages run the chunks themselves (no DDP around them).
    assert interleaved["wrappers"] == [["ChunkStage", "ChunkStage"]] * 2
    if global_batch == 4:
        plain = _losses(runs["pp2_gb4"])
        assert plain["layers"] == [[[1, 2]], [[3, 4]]]
        _assert_same(plain, single)
        assert interleaved["losses"] == plain["losses"]  # same sums in the same order


@pytest.mark.integration
def test_fewer_micro_batches_than_stages_match_one_rank(runs):
    """One micro-batch on two stages: torch's Schedule1F1B refuses fewer micro-batches than
    stages (tests/training/test_pipeline.py), so the pipeline runs ScheduleGPipe, the same
    work in the same order."""
    single, piped = _losses(runs["pp1_gb1"]), _losses(runs["pp2_gb1"])
    assert piped["layers"] == [[[1, 2]], [[3, 4]]]
    assert len(set(single["losses"])) > 1
    _assert_same(piped, single)


@pytest.mark.integration
def test_ddp_around_every_stage_with_lev_deferred_gradients_matches_one_rank(runs):
    """PP=2 x 2 chunks x DP=2 (4 ranks) of the LEV arm against one rank: each chunk's stage is
    a torch DDP (which averages the transformer's gradients in each stage's last backward);
    LEV's, computed after the schedule, are averaged by the engine's one explicit call (left
    out, or summed instead, the first grad norm would differ)."""
    single, piped = _losses(runs["lev_pp1_gb4"]), _losses(runs["lev_pp2_vp2_dp2_gb4"])
    assert single["lev_deferred"] and piped["lev_deferred"]
    assert piped["layers"] == [[[1], [3]], [[1], [3]], [[2], [4]], [[2], [4]]]
    assert piped["wrappers"] == [["DistributedDataParallel"] * 2] * 4
    assert len(set(single["losses"])) > 1
    _assert_same(piped, single, rel=1e-5)  # DP sums the micro-batch means in another order


@pytest.mark.integration
def test_nonfinite_loss_under_ddp_names_its_rank(runs):
    """DP=2 on torch DDP: rank 1's second-iteration loss is NaN, rank 0's is finite. Both
    ranks stop at iteration 2 and name rank 1 alone: for the loss, and for the gradients (its
    DDP hook saw its own buckets non-finite before the average spread the NaN to rank 0)."""
    out, nan_rank = runs["dp2_nan"], NAN_RANK
    for rank in (0, 1):
        assert (out / f"ddp{rank}.txt").read_text() == "DistributedDataParallel"
        error = (out / f"error{rank}.txt").read_text()
        assert error.startswith("2: loss nan / grad norm nan is not finite"), error
        assert f"non-finite loss on rank(s) [{nan_rank}]" in error, error
        assert f"non-finite gradients on rank(s) [{nan_rank}]" in error, error
