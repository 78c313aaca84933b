"""The LLaMA-style backbone gives the same logits and gradients under TP, SP and PP as on one rank.

One single-rank run writes the reference (weights, batch, logits, loss, every gradient) to disk;
the parallel runs load those weights into their shards and compare, all in float32 within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.testing.distributed import run_distributed

VOCAB, SEQ, BATCH = 96, 16, 2
ATOL = 1e-5


def _model_config(**overrides):
    from megatron_ext.models.config import ModelConfig

    base = dict(
        vocab_size=VOCAB,
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        seq_length=SEQ,
    )
    base.update(overrides)
    return ModelConfig(**base)


def _batch():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), position_ids


def _reference(path):
    from megatron_ext.models.full_state_dict import gather_full_state_dict
    from megatron_ext.models.leviathan_model import LeviathanModel

    model = LeviathanModel(_model_config())
    inputs, labels, position_ids = _batch()
    logits = model(inputs, position_ids, None).detach()
    loss = model(inputs, position_ids, None, labels=labels)
    loss.mean().backward()
    torch.save(
        {
            "weights": gather_full_state_dict(model),
            "grads": gather_full_state_dict(model, grads=True),
            "logits": logits,
            "loss": loss.detach(),
        },
        path,
    )


def _max_diffs(got: dict, want: dict) -> dict:
    assert set(got) == set(want), set(got) ^ set(want)
    return {k: (got[k] - want[k]).abs().max().item() for k in want}


def _tensor_parallel_checks(path):
    """TP=2 without and with sequence parallelism, each against the single-rank reference."""
    from megatron.core import parallel_state as ps

    from megatron_ext.models.full_state_dict import gather_full_state_dict, load_full_state_dict
    from megatron_ext.models.leviathan_model import LeviathanModel
    from megatron_ext.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron_ext.training.finalize_grads import allreduce_sequence_parallel_grads

    ref = torch.load(path)
    inputs, labels, position_ids = _batch()
    report = {}
    for sequence_parallel in (False, True):
        model = LeviathanModel(
            _model_config(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
        )
        load_full_state_dict(model, ref["weights"])
        logits = gather_from_tensor_model_parallel_region(
            model(inputs, position_ids, None), ps.get_tensor_model_parallel_group()
        )
        loss = model(inputs, position_ids, None, labels=labels)
        loss.mean().backward()
        allreduce_sequence_parallel_grads([model])
        grads = gather_full_state_dict(model, grads=True)
        norm_params = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", 0)]
        report[sequence_parallel] = {
            "logits": (logits.detach() - ref["logits"]).abs().max().item(),
            "loss": (loss.detach() - ref["loss"]).abs().max().item(),
            "grads": _max_diffs(grads, ref["grads"]),
            "sp_tagged_norms": len(norm_params),
        }
    return report


def _pipeline_checks(path):
    """Two stages (embedding + layers 0-1 | layers 2-3 + head) driven by hand with send/recv."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext.models.full_state_dict import gather_full_state_dict, load_full_state_dict
    from megatron_ext.models.leviathan_model import LeviathanModel

    ref = torch.load(path)
    inputs, labels, position_ids = _batch()
    first = ps.is_pipeline_first_stage()
    model = LeviathanModel(
        _model_config(pipeline_model_parallel_size=2), pre_process=first, post_process=not first
    )
    load_full_state_dict(model, ref["weights"])
    peer = (
        ps.get_pipeline_model_parallel_next_rank()
        if first
        else (ps.get_pipeline_model_parallel_prev_rank())
    )
    hidden_shape = (SEQ, BATCH, 64)
    result = {"layer_numbers": [layer.layer_number for layer in model.decoder.layers]}
    if first:
        hidden = model(inputs, position_ids, None)
        dist.send(hidden.detach().contiguous(), peer)
        grad = torch.empty(hidden_shape)
        dist.recv(grad, peer)
        hidden.backward(grad)
    else:
        received = torch.empty(hidden_shape)
        dist.recv(received, peer)
        received.requires_grad_(True)
        model.set_input_tensor(received)
        loss = model(None, position_ids, None, labels=labels)
        loss.mean().backward()
        dist.send(received.grad.contiguous(), peer)
        with torch.no_grad():
            model.set_input_tensor(received.detach())
            logits = model(None, position_ids, None)
        result["logits"] = (logits - ref["logits"]).abs().max().item()
        result["loss"] = (loss.detach() - ref["loss"]).abs().max().item()
    grads = gather_full_state_dict(model, grads=True)
    stages = [None] * 2
    dist.all_gather_object(stages, grads, group=ps.get_pipeline_model_parallel_group())
    merged = {**stages[0], **stages[1]}
    result["grads"] = _max_diffs(merged, ref["grads"])
    return result


@pytest.fixture(scope="module")
def reference_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("backbone") / "reference.pt"
    run_distributed(_reference, world_size=1, args=(str(path),))
    return str(path)


def test_tensor_and_sequence_parallel_match_single_rank(reference_path):
    reports = run_distributed(_tensor_parallel_checks, world_size=2, tp=2, args=(reference_path,))
    for report in reports:
        for sequence_parallel, diffs in report.items():
            assert diffs["logits"] < ATOL, (sequence_parallel, diffs["logits"])
            assert diffs["loss"] < ATOL, (sequence_parallel, diffs["loss"])
            bad = {k: v for k, v in diffs["grads"].items() if not v < ATOL}
            assert not bad, (sequence_parallel, bad)
        # 4 layers x 2 norms + the final norm are tagged only when sequence parallel is on.
        assert report[False]["sp_tagged_norms"] == 0
        assert report[True]["sp_tagged_norms"] == 9


def test_two_pipeline_stages_match_single_stage(reference_path):
    reports = run_distributed(_pipeline_checks, world_size=2, pp=2, args=(reference_path,))
    assert reports[0]["layer_numbers"] == [1, 2]
    assert reports[1]["layer_numbers"] == [3, 4]
    assert reports[1]["logits"] < ATOL and reports[1]["loss"] < ATOL
    for report in reports:
        bad = {k: v for k, v in report["grads"].items() if not v < ATOL}
        assert not bad, bad
