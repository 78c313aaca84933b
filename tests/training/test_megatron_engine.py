"""The megatron-core engine (`--ddp-impl megatron`) driven end to end on CPU.

megatron-core's DDP, optimizer, schedule and gradient finalisation need CUDA; here they are the
recording doubles of `tests.support.megatron_doubles` (megatron's own configs, parameter
grouping and config overrides otherwise), and `pretrain` runs 4 iterations on 2 gloo ranks
(DP=2, forked with torchrun's rank environment: tests.support.distributed.run_entry), with
batch ramp-up, --decoupled-lr, params-norm and num-zeros logging, evaluation and checkpoints.
The same run with the portable engine (torch DDP over the two ranks) is the reference: both
engines train float32 AdamW on the same samples, so their losses agree, and a checkpoint
written by either engine resumes in the other with the same losses. The four runs share one
launch (the entry runs them in turn).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.distributed import run_entry

pytestmark = pytest.mark.integration

ENTRY = Path(__file__).with_name("_engine_entry.py")
ROOT = Path(__file__).resolve().parents[2]


def _launch(out: Path, *runs: str) -> None:
    out.mkdir(parents=True)
    log = out / "output.log"
    code = run_entry(str(ENTRY), 2, [str(out), *runs], cwd=ROOT, log_path=log, timeout=600,
                     torchrun=True)  # fmt: skip
    assert code == 0, log.read_text()[-4000:]


def _records(out: Path) -> dict[int, dict]:
    lines = (out / "log.jsonl").read_text().splitlines()
    return {r["iteration"]: r for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines") / "runs"
    _launch(
        root, "megatron=megatron", "portable=portable",
        "portable_from_megatron=portable@megatron", "megatron_from_portable=megatron@portable",
    )  # fmt: skip
    # What both ranks of the megatron run logged (the launch's output, less the other runs').
    log = "".join((root / "megatron" / f"log{rank}.txt").read_text() for rank in (0, 1))
    return {"root": root, "megatron_log": log}


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_megatron_engine_matches_the_portable_engine(runs):
    root = runs["root"]
    megatron, portable = _records(root / "megatron"), _records(root / "portable")
    assert sorted(megatron) == [1, 2, 3, 4]
    for it in megatron:
        m, p = megatron[it], portable[it]
        assert m["stepped"] and p["stepped"]
        assert m["consumed_samples"] == p["consumed_samples"]
        assert m["lr"] == pytest.approx(p["lr"], rel=1e-12)
        assert _close(m["loss"], p["loss"]), (it, m, p)
        assert _close(m["grad_norm"], p["grad_norm"]), (it, m, p)
    # Batch ramp-up: 4 samples for the first two iterations, then the full 8.
    assert [megatron[it]["consumed_samples"] for it in (1, 2, 3, 4)] == [4, 8, 16, 24]
    # The portable engine averaged its gradients with torch DDP (one micro-batch per rank,
    # then two: the first under no_sync), the megatron engine with its own DDP (the double).
    for rank in (0, 1):
        assert (root / "portable" / f"dp{rank}.txt").read_text() == "DistributedDataParallel"


def test_megatron_engine_wiring_recorded_by_the_doubles(runs):
    root = runs["root"]
    for rank in (0, 1):
        calls = json.loads((root / "megatron" / f"calls{rank}.json").read_text())
        names = [name for name, _ in calls]
        details = {name: d for name, d in calls}
        assert names.count("ddp.__init__") == 1 and details["ddp.__init__"]["dp_size"] == "2"
        assert details["get_forward_backward_func"]["pp_size"] == "1"
        schedule = [d for name, d in calls if name == "forward_backward"]
        training = [d["num_microbatches"] for d in schedule if d["forward_only"] == "False"]
        assert training == ["1", "1", "2", "2"]  # ramp-up: global batch 4, 4, 8, 8 over DP=2
        assert [d["forward_only"] for d in schedule].count("True") == 2  # eval at 4, then test
        # Every iteration: fresh buffers, forward-backward, megatron's gradient finalisation
        # (the DP average), then the optimizer step.
        steps = [
            n
            for n in names
            if n in ("ddp.zero_grad_buffer", "finalize_model_grads", "optimizer.step")
        ]
        assert steps == ["ddp.zero_grad_buffer", "finalize_model_grads", "optimizer.step"] * 4
        # --decoupled-lr: megatron's grouping gives the input embedding and output layer
        # (2 weights of the untied arm) the decoupled max lr.
        groups = details["optimizer.__init__"]["groups"]
        assert "{'n': 2, 'wd_mult': 1.0, 'max_lr': 0.003" in groups, groups


def test_megatron_engine_logs_every_field(runs):
    log = runs["megatron_log"]
    lines = [line for line in log.splitlines() if " iteration        4/       4" in line]
    assert len(lines) == 1, log[-3000:]
    for field in ("lm loss:", "grad norm:", "params norm:", "num zeros:", "learning rate:",
                  "global batch size:     8", "number of skipped iterations:   0"):  # fmt: skip
        assert field in lines[0], (field, lines[0])
    assert "validation loss at iteration 4" in log and "test loss at iteration 4" in log


def test_checkpoints_resume_across_engines(runs):
    root = runs["root"]
    megatron, portable = _records(root / "megatron"), _records(root / "portable")
    assert (root / "megatron" / "ckpt" / "iter_0000002").is_dir()
    pairs = (("portable_from_megatron", megatron), ("megatron_from_portable", portable))
    for resumed, reference in pairs:
        records = _records(root / resumed)
        assert sorted(records) == [3, 4], resumed
        for it in (3, 4):
            assert records[it]["consumed_samples"] == reference[it]["consumed_samples"]
            assert _close(records[it]["loss"], reference[it]["loss"]), (resumed, it)
            assert _close(records[it]["grad_norm"], reference[it]["grad_norm"]), (resumed, it)
