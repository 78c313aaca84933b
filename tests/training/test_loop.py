"""`pretrain(cfg)` driven by a `RunConfig` built in code, without any flags: `setup`,
`train` and `close` in one single-rank gloo process (the flag path is covered end to end by
test_end_to_end.py); `close` tears the process groups down even when setup fails."""

from __future__ import annotations

import functools
import json
import math

import pytest

from tests.support.distributed import find_free_port
from tests.support.tiny_gpt import SEQ, VOCAB, RandomSamples, forward_step, model_config
from tests.support.tiny_gpt import model_provider as _tiny_provider

# The loop's tests train the default arm (LEV).
model_provider = functools.partial(_tiny_provider, embedding_type="lev")


@pytest.fixture
def single_rank(monkeypatch):
    """torchrun's environment for a one-rank world on a free port."""
    port = str(find_free_port())
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_PORT=port).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")


def _config(tmp_path):
    from megatron_ext.config.run import (
        BatchConfig,
        CheckpointConfig,
        EvalConfig,
        LoggingConfig,
        OptimizerConfig,
        RunConfig,
    )

    return RunConfig(
        batch=BatchConfig(micro_batch_size=2, global_batch_size=4, train_iters=3),
        model=model_config("lev"),
        optim=OptimizerConfig(
            lr=1e-3, lr_decay_steps=12, start_weight_decay=0.01, end_weight_decay=0.01
        ),
        eval=EvalConfig(eval_interval=2, eval_iters=1),
        ckpt=CheckpointConfig(save=str(tmp_path / "ckpt"), save_interval=3),
        log=LoggingConfig(log_interval=1, log_jsonl=str(tmp_path / "log.jsonl"), loss_curve=False),
    )


def test_pretrain_from_a_config_built_in_code(tmp_path, single_rank):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ext.checkpoint.format import checkpoint_dir, read_latest_iteration
    from megatron_ext.training import pretrain

    cfg = _config(tmp_path)
    reason = pretrain(
        cfg,
        model_provider=model_provider,
        forward_step=forward_step,
        datasets_provider=lambda counts: tuple(RandomSamples(n) for n in counts),
    )
    assert reason == "finished"
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert [r["consumed_samples"] for r in records] == [4, 8, 12]
    assert all(math.isfinite(r["loss"]) and r["stepped"] for r in records)
    # Random tokens: the first loss is near ln(V) for an untrained model.
    assert abs(records[0]["loss"] - math.log(VOCAB)) < 1.0
    root = cfg.ckpt.save
    assert read_latest_iteration(root) == 3
    with open(f"{checkpoint_dir(root, 3)}/args.json") as handle:
        saved = json.load(handle)  # the run as built in code (RunConfig.args_json)
    assert saved == cfg.args_json() and saved["eval_interval"] == 2 and saved["world_size"] == 1
    assert (saved["num_layers"], saved["seq_length"], saved["embedding_type"]) == (2, SEQ, "lev")
    # close() ran: no process group is left behind.
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()


def test_close_runs_when_setup_fails(tmp_path, single_rank):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ext.training import pretrain

    def broken_provider(pre_process, post_process, pg_collection):
        raise RuntimeError("no model today")

    with pytest.raises(RuntimeError, match="no model today"):
        pretrain(
            _config(tmp_path),
            model_provider=broken_provider,
            forward_step=forward_step,
            datasets_provider=lambda counts: (None, None, None),
        )
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()


def _megatron_engine_with_doubles(cfg, model, forward_step, pg, phase, timers):
    """megatron-core's engine over the recording doubles (runs on CPU; LEV per micro-batch)."""
    from megatron_ext.training.megatron_engine import MegatronEngine
    from tests.support.megatron_doubles import CallLog, recording_parts

    return MegatronEngine(
        cfg, model, forward_step, pg, phase, timers, parts=recording_parts(CallLog())
    )


@pytest.mark.parametrize(
    "engine, embedding", [("portable", "lev"), ("megatron", "lev"), ("portable", "tied")]
)
def test_timing_log_level_2_times_lev_inside_forward_backward(
    tmp_path, single_rank, caplog, engine, embedding
):
    import dataclasses

    from megatron_ext.training import pretrain

    cfg = _config(tmp_path)
    cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, timing_log_level=2))
    with caplog.at_level("INFO", logger="megatron_ext.training.metrics_logger"):
        pretrain(
            cfg,
            model_provider=functools.partial(_tiny_provider, embedding_type=embedding),
            forward_step=forward_step,
            datasets_provider=lambda counts: tuple(RandomSamples(n) for n in counts),
            engine_builder=_megatron_engine_with_doubles if engine == "megatron" else None,
        )
    messages = [r.getMessage().strip() for r in caplog.records]
    lines = [m for m in messages if m.startswith("time per iteration (ms): ")]
    assert len(lines) == 3  # --log-interval 1, 3 iterations
    # The portable engine runs LEV's backward once per global batch (timed); megatron's engine
    # runs it inside each micro-batch's backward; a model without LEV has no LEV spans.
    spans = {"lev": ["lev-forward", "lev-backward"], "tied": []}[embedding]
    if engine == "megatron":
        spans = ["lev-forward"]
    marks = ["forward-backward", "grads-all-reduce", "grad-norm-and-clip", "optimizer"]
    for line in lines:
        parts = dict(p.split(": ") for p in line.split("(ms): ", 1)[1].split(" | "))
        assert list(parts)[0] == "forward-backward"
        # The marks in the iteration's order, then the spans inside forward-backward.
        assert [k for k in parts if k.startswith("lev-")] == spans
        assert list(parts)[len(parts) - len(spans) :] == spans
        ms = {k: float(v) for k, v in parts.items()}
        assert sum(ms[k] for k in spans) < ms["forward-backward"]
        assert all(ms[k] > 0 for k in spans)
        if engine == "portable":
            assert list(parts)[: len(marks)] == marks
