"""Every arm gives the same logits, loss and gradients under TP, SP and PP as on one rank, and
its input module's megatron `sharded_state_dict` describes the full (unsharded) tensors.

One single-rank run writes the references (weights, logits, loss, every gradient) of all arms
to disk; the parallel runs load those weights into their shards and compare, in float32 within
1e-5, and the global gradient norm as the training loop computes it (`clip_grad_norm`: TP
shards summed, replicated and sequence-parallel parameters counted once) within 1e-6
relative. The `untied` arm is the plain LLaMA-style backbone of the foundation issue.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed

pytestmark = pytest.mark.integration

VOCAB, SEQ, BATCH, HIDDEN = 96, 16, 2, 64
ATOL = 1e-5
# float32 gradients, squared norms summed in float64: layouts differ by ~1e-7 relative.
NORM_RTOL = 1e-6
ARMS = ("tied", "untied", "albert", "flat-mlp", "factored-mlp", "lev")
# A small LEV (2 heads so that TP=2 owns one head each).
LEV = dict(seed_dim=16, rank=4, num_heads=2, num_knots=5)


def _model_config(arm: str, **overrides):
    from megatron_ext.config.model import ModelConfig

    base = dict(
        vocab_size=VOCAB,
        num_layers=4,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        seq_length=SEQ,
        embedding=dict(embedding_type=arm, lev=dict(LEV)),
    )
    base.update(overrides)
    return ModelConfig(**base)


def _batch():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), position_ids


def _grad_norm(model) -> float:
    from megatron_ext.parallel import ProcessGroups
    from megatron_ext.training.optimizer import clip_grad_norm

    return clip_grad_norm(list(model.parameters()), 0.0, ProcessGroups.from_megatron())


def _bf16_dtypes(model, inputs, position_ids) -> dict:
    """dtypes under bf16 autocast: the input module's output, layer 0's input and output."""
    seen = {}

    def input_module(module, args, out) -> None:
        seen["input module"] = out.dtype

    def layer0(module, args, kwargs, out) -> None:
        seen.update(
            {"layer 0 input": kwargs["hidden_states"].dtype, "layer 0 output": out[0].dtype}
        )

    hooks = [
        model.embedding.word_embeddings.register_forward_hook(input_module),
        model.decoder.layers[0].register_forward_hook(layer0, with_kwargs=True),
    ]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(inputs, position_ids, None)
    for hook in hooks:
        hook.remove()
    return {k: str(v) for k, v in seen.items()}


def _references(path):
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.models import build_model
    from megatron_ext.models.full_state_dict import gather_full_state_dict
    from megatron_ext.parallel import ProcessGroups

    pg = ProcessGroups.from_megatron()
    inputs, labels, position_ids = _batch()
    refs = {}
    for arm in ARMS:
        torch.manual_seed(1)
        model = build_model(
            _model_config(arm), parallel=ParallelConfig(), precision=PrecisionConfig(), pg=pg
        )
        logits = model(inputs, position_ids, None).detach()
        loss = model(inputs, position_ids, None, labels=labels)
        loss.mean().backward()
        refs[arm] = {
            "bf16_dtypes": _bf16_dtypes(model, inputs, position_ids),
            "weights": gather_full_state_dict(model, pg.tp),
            "grads": gather_full_state_dict(model, pg.tp, grads=True),
            "logits": logits,
            "loss": loss.detach(),
            "grad_norm": _grad_norm(model),
        }
    torch.save(refs, path)


def _max_diffs(got: dict, want: dict) -> dict:
    assert set(got) == set(want), set(got) ^ set(want)
    return {k: (got[k] - want[k]).abs().max().item() for k in want}


def _tensor_parallel_checks(path):
    """TP=2 without and with sequence parallelism, each arm against its single-rank reference."""
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.models import build_model
    from megatron_ext.models.full_state_dict import gather_full_state_dict, load_full_state_dict
    from megatron_ext.parallel import ProcessGroups
    from megatron_ext.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron_ext.training.finalize_grads import allreduce_sequence_parallel_grads

    pg = ProcessGroups.from_megatron()
    refs = torch.load(path)
    inputs, labels, position_ids = _batch()
    report = {}
    for arm in ARMS:
        ref = refs[arm]
        for sequence_parallel in (False, True):
            model = build_model(
                _model_config(arm),
                parallel=ParallelConfig(
                    tensor_model_parallel_size=2, sequence_parallel=sequence_parallel
                ),
                precision=PrecisionConfig(),
                pg=pg,
            )
            load_full_state_dict(model, ref["weights"], pg.tp)
            logits = gather_from_tensor_model_parallel_region(
                model(inputs, position_ids, None), pg.tp
            )
            # bf16 autocast: the TP-reduced embeddings are the fp32 ones, bit for bit.
            with torch.no_grad():
                embedded = model.embedding(input_ids=inputs, position_ids=position_ids)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    embedded_bf16 = model.embedding(input_ids=inputs, position_ids=position_ids)
            loss = model(inputs, position_ids, None, labels=labels)
            loss.mean().backward()
            allreduce_sequence_parallel_grads([model], pg.tp)
            grads = gather_full_state_dict(model, pg.tp, grads=True)
            # Megatron's distributed-checkpoint view must describe the full tensors.
            sharded = model.sharded_state_dict(metadata={"dp_cp_group": pg.dp_cp})
            report[(arm, sequence_parallel)] = {
                "sharded_shapes": {
                    k: (getattr(sharded.get(k), "global_shape", None), tuple(v.shape))
                    for k, v in ref["weights"].items()
                    if k.startswith("embedding.")
                },
                "logits": (logits.detach() - ref["logits"]).abs().max().item(),
                "loss": (loss.detach() - ref["loss"]).abs().max().item(),
                "grads": _max_diffs(grads, ref["grads"]),
                "grad_norm": (_grad_norm(model), ref["grad_norm"]),
                "bf16_embedding": (
                    str(embedded_bf16.dtype),
                    bool(torch.equal(embedded_bf16, embedded)),
                ),
                "sp_tagged": sum(
                    1 for p in model.parameters() if getattr(p, "sequence_parallel", False)
                ),
            }
    return report


def _pipeline_checks(path):
    """Two stages (input + layers 0-1 | layers 2-3 + head) driven by hand with send/recv."""
    import torch.distributed as dist

    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.models import build_model
    from megatron_ext.models.full_state_dict import gather_full_state_dict, load_full_state_dict
    from megatron_ext.parallel import ProcessGroups
    from megatron_ext.training.finalize_grads import allreduce_tied_embedding_grads

    pg = ProcessGroups.from_megatron()
    refs = torch.load(path)
    inputs, labels, position_ids = _batch()
    first = pg.is_first_stage
    peer = pg.pp_neighbour(1 if first else -1)
    report = {}
    for arm in ARMS:
        ref = refs[arm]
        model = build_model(
            _model_config(arm),
            parallel=ParallelConfig(pipeline_model_parallel_size=2),
            precision=PrecisionConfig(),
            pre_process=first,
            post_process=not first,
            pg=pg,
        )
        load_full_state_dict(model, ref["weights"], pg.tp)
        result = {"layer_numbers": [layer.layer_number for layer in model.decoder.layers]}
        if first:
            hidden = model(inputs, position_ids, None)
            dist.send(hidden.detach().contiguous(), peer)
            grad = torch.empty_like(hidden)
            dist.recv(grad, peer)
            hidden.backward(grad)
        else:
            received = torch.empty(SEQ, BATCH, HIDDEN)
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
        allreduce_tied_embedding_grads([model], pg.embd)
        result["grad_norm"] = (_grad_norm(model), ref["grad_norm"])
        stages = [None, None]
        dist.all_gather_object(
            stages,
            gather_full_state_dict(model, pg.tp, grads=True),
            pg.pp,
        )
        result["grads"] = _max_diffs({**stages[0], **stages[1]}, ref["grads"])
        report[arm] = result
    return report


@pytest.fixture(scope="module")
def reference_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("arms") / "references.pt"
    run_distributed(_references, world_size=1, args=(str(path),))
    return str(path)


def _bad(diffs: dict) -> dict:
    return {k: v for k, v in diffs.items() if not v < ATOL}


def _assert_same_norm(got_want: tuple, where: str) -> None:
    got, want = got_want
    assert abs(got - want) <= NORM_RTOL * want, f"{where}: grad norm {got!r} != {want!r}"


def test_tensor_and_sequence_parallel_match_single_rank(reference_path):
    reports = run_distributed(_tensor_parallel_checks, world_size=2, tp=2, args=(reference_path,))
    for report in reports:
        for (arm, sequence_parallel), diffs in report.items():
            where = f"{arm} sequence_parallel={sequence_parallel}"
            assert diffs["logits"] < ATOL, (where, diffs["logits"])
            assert diffs["loss"] < ATOL, (where, diffs["loss"])
            assert not _bad(diffs["grads"]), (where, _bad(diffs["grads"]))
            _assert_same_norm(diffs["grad_norm"], where)
            assert diffs["bf16_embedding"] == ("torch.float32", True), where
            if not sequence_parallel:
                assert diffs["sp_tagged"] == 0, where
            for key, (sharded, full) in diffs["sharded_shapes"].items():
                assert sharded is not None and tuple(sharded) == full, (where, key, sharded, full)
        # 4 layers x 2 norms + the final norm are summed across TP under sequence parallel.
        assert report[("untied", True)]["sp_tagged"] == 9
        assert report[("albert", True)]["sp_tagged"] == 9 + 1  # + the replicated projection


def test_two_pipeline_stages_match_single_stage(reference_path):
    reports = run_distributed(_pipeline_checks, world_size=2, pp=2, args=(reference_path,))
    for arm in ARMS:
        first, last = reports[0][arm], reports[1][arm]
        assert first["layer_numbers"] == [1, 2] and last["layer_numbers"] == [3, 4]
        assert last["logits"] < ATOL and last["loss"] < ATOL, (arm, last["logits"], last["loss"])
        for stage in (first, last):
            assert not _bad(stage["grads"]), (arm, _bad(stage["grads"]))
            _assert_same_norm(stage["grad_norm"], f"{arm} pipeline stage")


def test_bf16_every_arm_enters_the_decoder_alike(reference_path):
    """training/precision.py: under bf16 autocast every arm's input module returns fp32 and
    layer 0 receives fp32; megatron's residual add makes the stream bf16 from layer 0 on."""
    refs = torch.load(reference_path)
    for arm in ARMS:
        assert refs[arm]["bf16_dtypes"] == {
            "input module": "torch.float32",
            "layer 0 input": "torch.float32",
            "layer 0 output": "torch.bfloat16",
        }, (arm, refs[arm]["bf16_dtypes"])
