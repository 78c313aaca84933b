"""The adapter between Megatron's forward-step contract and torch.distributed.pipelining
(`training/pipeline.py`): what a stage owns and reads; a one-stage pipeline (PP = 1) against
autograd, with the forward step's errors passed through as raised; why fewer micro-batches
than stages run ScheduleGPipe; and, from the command line, that the stages after the first get
their micro-batch's own inputs (position ids and attention masks under --reset-position-ids /
--reset-attention-mask, the loss mask and labels on the loss stage) and that the loss stage's
reports (--calculate-per-token-loss) and the FP16 loss scale reach the step: PP=2 and PP=2 x 2
chunks log the single rank's losses, grad norms and validation loss."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_ext.data.preprocess import PreprocessConfig, preprocess
from megatron_ext.data.readers import iter_lines
from megatron_ext.training.pipeline import ChunkStage, _Iteration
from tests.support.distributed import run_distributed
from tests.support.runs import TINY_LEV_MODEL, TINY_TRAIN


def test_a_stage_owns_the_chunk_parameters_but_the_deferred_ones():
    chunk = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2))
    chunk[0].bias.requires_grad_(False)
    deferred = [chunk[1].weight]
    stage = ChunkStage(chunk, None, first=True, last=False, dtype=torch.float32, deferred=deferred)
    assert [id(p) for p in stage.parameters()] == [
        id(chunk[0].weight),
        id(chunk[1].bias),
    ]  # what a DistributedDataParallel around the stage reduces
    assert list(stage.children()) == [stage.owned]  # the chunk is not a submodule
    assert stage.chunk is chunk and not list(stage.buffers())


def test_the_iteration_reads_each_micro_batch_once_in_order_for_every_chunk():
    reads = []

    def source():
        for i in range(4):
            reads.append(i)
            yield {"index": i}

    iteration = _Iteration(source(), readers=2, loss_factor=1.0, autocast=None)
    assert iteration.batch(1) == {"index": 1} and reads == [0, 1]  # read in order
    assert iteration.batch(0) == {"index": 0}  # chunk 0's first two
    assert iteration.batch(0) == {"index": 0} and 0 not in iteration.batches  # chunk 1's
    assert iteration.batch(3) == {"index": 3} and reads == [0, 1, 2, 3]
    with pytest.raises(KeyError):
        iteration.batch(0)  # a third reader of micro-batch 0: there are only two chunks


def test_torch_1f1b_refuses_fewer_micro_batches_than_stages():
    """Why `Pipeline` runs ScheduleGPipe when M < P (tests/training/test_portable_engine.py
    checks that PP=2 with one micro-batch trains like one rank)."""
    from torch.distributed.pipelining import Schedule1F1B

    with pytest.raises(ValueError, match=r"Number of microbatches \(1\) must be greater"):
        Schedule1F1B(SimpleNamespace(num_stages=2), 1)


def test_reports_sum_in_float64():
    iteration = _Iteration(iter(()), readers=1, loss_factor=1.0, autocast=None)
    iteration.add({"lm loss": torch.tensor([1.0, 2.0])})
    iteration.add({"lm loss": torch.tensor([2.5, 2.0])})
    assert iteration.totals["lm loss"].dtype == torch.float64
    assert iteration.totals["lm loss"].tolist() == [3.5, 4.0]


def _check_one_stage():
    """A one-stage pipeline (PP = 1: gradient accumulation) over a linear layer: the gradients
    of the mean of the micro-batches' losses, the reports summed; an error of the forward step
    comes out as it was raised, not as torch's stage wraps it."""
    from megatron_ext.parallel import ProcessGroups
    from megatron_ext.training.pipeline import Pipeline, PipelineShape

    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 1)
    batches = [torch.randn(2, 3) for _ in range(3)]

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        if batch is None:
            raise ValueError("token id 70000 is outside [0, 512)")
        output = model(batch).sum()
        return output, lambda out: (out, {"lm loss": torch.stack([out.detach(), torch.ones(())])})

    shape = PipelineShape((1,), torch.float32, torch.device("cpu"), loss_output=())
    pipeline = Pipeline([layer], forward_step, ProcessGroups.from_megatron(), shape)
    totals = pipeline.run(iter(batches), 3, loss_scale=4.0)
    expected = torch.nn.Linear(3, 1)
    expected.load_state_dict(layer.state_dict())
    (4.0 * sum(expected(b).sum() for b in batches) / 3).backward()
    torch.testing.assert_close(layer.weight.grad, expected.weight.grad, rtol=1e-6, atol=0)
    sums = [float(expected(b).sum().detach()) for b in batches]
    torch.testing.assert_close(
        totals["lm loss"], torch.tensor([sum(sums), 3.0], dtype=torch.float64)
    )
    try:
        pipeline.run(iter([batches[0], None, batches[2]]), 3)
    except ValueError as error:
        assert "token id 70000" in str(error)
    else:
        raise AssertionError("the forward step's error did not come out")
    layer.zero_grad()
    assert pipeline.run(iter(batches), 3)["lm loss"][1] == 3  # a later iteration runs afresh
    torch.testing.assert_close(layer.weight.grad, expected.weight.grad / 4, rtol=1e-6, atol=0)
    return True


@pytest.mark.integration
def test_one_stage_accumulates_and_passes_errors_through():
    assert run_distributed(_check_one_stage, world_size=1) == [True]


# Every micro-batch reads its own position ids, attention mask and loss mask (reset at each
# document end) on every stage; the loss is the token sum over the global batch's token count.
RESETS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
INPUTS = [*RESETS, "--calculate-per-token-loss", "--exit-interval", "3", "--eval-interval", "3"]
FP16 = ["--fp16", "--loss-scale", "1024"]
PP2 = ["--pipeline-model-parallel-size", "2"]
VP2 = [*PP2, "--num-virtual-stages-per-pipeline-rank", "2"]


@pytest.fixture(scope="module")
def short_documents(corpus, tmp_path_factory) -> list[str]:
    """Data flags of the session's corpus cut into one sentence per document (same SentencePiece
    tokenizer): every 32-token sequence holds several document ends."""
    data = Path(corpus[corpus.index("--data-path") + 1])
    tokenizer = corpus[corpus.index("--tokenizer-model") + 1]
    out = tmp_path_factory.mktemp("short_documents")
    texts = [
        json.loads(line)["text"]
        for path in sorted((data.parent / "raw" / "train").iterdir())
        for _, line in iter_lines(str(path))
    ]
    sentences = [s for t in texts for s in re.split(r"(?<=[.!?])\s+", t) if s.strip()]
    with open(out / "sentences.jsonl", "w") as handle:
        handle.writelines(json.dumps({"text": s}) + "\n" for s in sentences)
    preprocess(
        PreprocessConfig(
            input=[str(out / "sentences.jsonl")],
            output_prefix=str(out / "short"),
            tokenizer_type="SentencePieceTokenizer",
            tokenizer_model=tokenizer,
            append_eod=True,
        )
    )
    return [
        "--data-path", str(out / "short_text_document"), "--split", "90,7,3",
        "--data-cache-path", str(out / "cache"),
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tokenizer,
    ]  # fmt: skip


def _validation_loss(run) -> float:
    (value,) = re.findall(r"validation loss at iteration 3 \| lm loss value: (\S+) \|", run.output)
    return float(value)


def _assert_same(run, single, rel: float, grad_rel: float) -> None:
    """`run` logged `single`'s losses, validation loss (to `rel`) and grad norms (`grad_rel`)."""
    assert sorted(run.losses) == sorted(single.losses) == [1, 2, 3]
    norms = {r["iteration"]: r["grad_norm"] for r in run.records}
    for r in single.records:
        it = r["iteration"]
        assert math.isclose(run.losses[it], single.losses[it], rel_tol=rel), it
        assert math.isclose(norms[it], r["grad_norm"], rel_tol=grad_rel), it
    assert math.isclose(_validation_loss(run), _validation_loss(single), rel_tol=rel)


@pytest.mark.integration
def test_stages_get_their_micro_batch_inputs_and_the_loss_reports(
    launcher, short_documents, tmp_path
):
    args = [*TINY_LEV_MODEL, *TINY_TRAIN, *short_documents, *INPUTS]
    single = launcher(1, args, tmp_path / "pp1").check()
    plain = [a for a in args if a not in RESETS] + ["--exit-interval", "1"]
    plain = launcher(1, plain, tmp_path / "plain").check()
    # Without the resets the same batches give other gradients: what every stage reads of its
    # micro-batch matters (about 0.6% of the first grad norm).
    first = single.records[0]["grad_norm"]
    assert not math.isclose(plain.records[0]["grad_norm"], first, rel_tol=1e-3)
    for name, layout in (("pp2", PP2), ("pp2_vp2", VP2)):
        run = launcher(2, [*args, *layout], tmp_path / name).check()
        _assert_same(run, single, rel=1e-6, grad_rel=1e-6)  # bit-identical when measured

    # FP16 with a static loss scale: the scaled loss is backpropagated and the gradients
    # unscaled (the first grad norm is float32's to FP16 rounding; 1024x off otherwise) ...
    single16 = launcher(1, [*args, *FP16], tmp_path / "pp1_fp16").check()
    assert math.isclose(single16.records[0]["grad_norm"], first, rel_tol=1e-3)
    assert "loss scale: 1024.0" in single16.output
    # ... in the pipeline too. A stage boundary sums the two gradients of its input (residual
    # and sublayer) in float32, one stage sums them in FP16; Adam's first steps amplify that
    # rounding in the next gradients (about 2e-5 after one step at PP=2 x 2).
    run = launcher(2, [*args, *FP16, *VP2], tmp_path / "pp2_vp2_fp16").check()
    _assert_same(run, single16, rel=1e-5, grad_rel=1e-4)
