"""Impossible layouts and settings fail at construction (or, for what needs the layout too,
in `check_layout`) with the flag to change."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from megatron_ext.lev import LEVConfig
from megatron_ext.models import (
    EmbeddingConfig,
    ModelConfig,
    ModelParallelism,
    ModelPrecision,
    add_model_arguments,
    check_layout,
    model_config_from_args,
)
from megatron_ext.models.layer_specs import get_layer_spec, transformer_engine_available
from megatron_ext.parallel import validate_parallel_layout

BASE = dict(vocab_size=128, num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(num_attention_heads=6, hidden_size=96, tensor_model_parallel_size=4),
            "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4",
        ),
        (
            dict(num_query_groups=2, tensor_model_parallel_size=4),
            "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4",
        ),
        (
            dict(num_layers=3, pipeline_model_parallel_size=2),
            "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2",
        ),
        (dict(sequence_parallel=True), "--sequence-parallel needs --tensor-model-parallel-size"),
        (
            dict(sequence_parallel=True, tensor_model_parallel_size=2, seq_length=33),
            "--seq-length 33 is not divisible by --tensor-model-parallel-size 2",
        ),
        (dict(fp8_format="hybrid"), "--fp8-format needs --transformer-impl transformer_engine"),
        (dict(context_parallel_size=2), "--context-parallel-size > 1 needs --transformer-impl"),
        (dict(bf16=True, fp16=True), "--bf16 and --fp16 are exclusive"),
        (dict(transformer_impl="apex"), "--transformer-impl must be"),
        (dict(embedding=dict(embedding_type="lookup")), "--embedding-type must be one of"),
        (
            dict(
                embedding=dict(embedding_type="lev", lev=dict(num_heads=3)),
                tensor_model_parallel_size=2,
            ),
            "--lev-num-heads 3 is not divisible by --tensor-model-parallel-size 2",
        ),
        (dict(embedding=dict(embedding_type="albert", albert_dim=0)), "--albert-dim must be >= 1"),
    ],
)
def test_impossible_settings_are_clear_errors(overrides, message):
    parts = {ModelParallelism: {}, ModelPrecision: {}, ModelConfig: dict(BASE)}
    for name, value in overrides.items():
        owner = next(
            (c for c in (ModelParallelism, ModelPrecision) if name in _field_names(c)), ModelConfig
        )
        parts[owner][name] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        model = ModelConfig(**parts[ModelConfig])
        check_layout(
            model,
            ModelParallelism(**parts[ModelParallelism]),
            ModelPrecision(**parts[ModelPrecision]),
        )


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_model_config_describes_the_model_only():
    """The layout and precision are build_model's arguments, not ModelConfig fields; the run's
    ParallelConfig and PrecisionConfig own their flags."""
    from megatron_ext.training.config import ParallelConfig, PrecisionConfig

    moved = _field_names(ModelParallelism) | {"params_dtype", "bf16", "fp16", "fp8", "fp8_format"}
    assert not moved & _field_names(ModelConfig)
    assert _field_names(ModelParallelism) <= _field_names(ParallelConfig)
    assert {"bf16", "fp16", "fp8_format"} <= _field_names(PrecisionConfig)
    # A ParallelConfig is a layout build_model takes as it is.
    run = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    assert ModelParallelism.of(run) == ModelParallelism(
        tensor_model_parallel_size=2, sequence_parallel=True
    )
    with pytest.raises(
        ValueError,
        match="--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4",
    ):
        check_layout(
            ModelConfig(**{**BASE, "num_attention_heads": 6, "hidden_size": 96}),
            ParallelConfig(tensor_model_parallel_size=4),
        )


def test_world_size_must_split_into_tp_times_pp():
    with pytest.raises(ValueError, match="world size 6 is not divisible by .* 2x2x1=4"):
        validate_parallel_layout(6, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert validate_parallel_layout(8, 2, 2) == 2


@pytest.mark.skipif(transformer_engine_available(), reason="TE is usable here")
def test_transformer_engine_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs Transformer Engine and a CUDA GPU"):
        get_layer_spec("transformer_engine")


def _parse(*argv):
    return add_model_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_presets_fill_and_flags_override():
    cfg = model_config_from_args(_parse("--model-size", "1.2b", "--num-layers", "4"), 200064)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (4, 2048, 5632)
    cfg = model_config_from_args(_parse("--model-size", "400m"), 200064)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (16, 1024, 16)


def test_flag_conflicts_are_clear_errors():
    with pytest.raises(ValueError, match="contradicts --embedding-type tied"):
        model_config_from_args(
            _parse("--embedding-type", "tied", "--untie-embeddings-and-output-weights"), 128
        )
    with pytest.raises(ValueError, match="--num-query-groups needs --group-query-attention"):
        model_config_from_args(_parse("--num-query-groups", "2"), 128)
    with pytest.raises(ValueError, match="set --hidden-size, --num-attention-heads"):
        model_config_from_args(_parse("--num-layers", "2"), 128)


def test_megatron_launch_script_flags_are_accepted():
    from megatron_ext.training.arguments import parse_args

    argv = (
        "--use-mcore-models --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 32 --swiglu --disable-bias-linear --normalization RMSNorm "
        "--position-embedding-type rope --untie-embeddings-and-output-weights "
        "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-rope-fusion "
        "--attention-softmax-in-fp32 --use-flash-attn --no-gradient-accumulation-fusion "
        "--micro-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 100"
    ).split()
    cfg = model_config_from_args(parse_args(argv, world_size=1), 128)
    assert (cfg.num_layers, cfg.hidden_size, cfg.embedding.embedding_type) == (2, 64, "lev")


@pytest.mark.parametrize(
    "flag, value",
    [("--normalization", "LayerNorm"), ("--position-embedding-type", "learned_absolute")],
)
def test_megatron_flags_asking_for_another_design_are_refused(flag, value):
    """Megatron-LM compatibility rules (`training.megatron_compat`) answer these flags."""
    from megatron_ext.training.arguments import ArgumentError, parse_args

    argv = [flag, value, "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"]
    with pytest.raises(ArgumentError, match=f"{flag} {value}: the Leviathan backbone"):
        parse_args([*argv, "--mock-data", "--tokenizer-type", "NullTokenizer"], world_size=1)


def test_lev_flags_become_the_frozen_config_the_model_holds():
    cfg = model_config_from_args(_parse("--lev-num-knots", "5", "--lev-rank", "4"), 128)
    lev = cfg.embedding.lev
    assert isinstance(lev, LEVConfig)
    assert (lev.vocab_size, lev.hidden_size, lev.num_knots, lev.rank) == (128, 64, 5, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lev.num_knots = 6
    # The arms sized from LEV's count hold it too; tied / untied hold none.
    albert = model_config_from_args(_parse("--embedding-type", "albert", "--lev-rank", "4"), 128)
    assert albert.embedding.lev.rank == 4
    assert model_config_from_args(_parse("--embedding-type", "tied"), 128).embedding.lev is None
    with pytest.raises(ValueError, match="--lev-num-knots"):
        model_config_from_args(_parse("--lev-num-knots", "2"), 128)


def test_lev_given_as_dict_or_config_is_the_same_model():
    as_dict = ModelConfig(**BASE, embedding=dict(embedding_type="lev", lev=dict(num_heads=2)))
    lev = LEVConfig(vocab_size=128, hidden_size=64, num_heads=2)
    as_config = ModelConfig(**BASE, embedding=EmbeddingConfig("lev", lev=lev))
    assert as_dict == as_config and as_config.embedding.lev is lev
    with pytest.raises(ValueError, match="LEVConfig is for V=100, D=64 .* --vocab-size 128"):
        ModelConfig(
            **BASE, embedding=EmbeddingConfig("lev", lev=dataclasses.replace(lev, vocab_size=100))
        )


def test_replace_carries_new_sizes_over_to_lev_and_keeps_its_base():
    cfg = ModelConfig(**BASE)
    assert cfg.embedding.lev.base == 6  # smallest b with b**3 >= 128
    bigger = cfg.replace(vocab_size=200, hidden_size=128)
    assert (bigger.embedding.lev.vocab_size, bigger.embedding.lev.hidden_size) == (200, 128)
    assert bigger.embedding.lev.base == 6  # the codebooks keep their shape
    with pytest.raises(ValueError, match=r"cover only 6\*\*3=216 ids"):
        cfg.replace(vocab_size=300)
    assert cfg.replace(embedding=dict(embedding_type="tied")).embedding.lev is None
    # albert only matches LEV's count: its LEV base follows the vocabulary.
    albert = ModelConfig(**{**BASE, "embedding": dict(embedding_type="albert")})
    assert albert.replace(vocab_size=300).embedding.lev.base == 7


# The model, layout and precision keys of an args.json written before ModelConfig lost its
# layout and precision fields (main at 0cacffe: --tensor-model-parallel-size 2
# --sequence-parallel --bf16 --embedding-type lev ..., world size 2). args.json keeps the flags'
# names, so the same keys feed the parallel/precision side now.
OLD_ARGS_JSON = """{
  "bf16": true, "fp16": false, "fp8_format": null, "tensor_model_parallel_size": 2,
  "pipeline_model_parallel_size": 1, "context_parallel_size": 1, "sequence_parallel": true,
  "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
  "embedding_type": "lev", "lev_num_heads": 2, "lev_rank": 8, "lev_seed_dim": 16,
  "transformer_impl": "local", "vocab_size": 100, "tokenizer_type": "NullTokenizer",
  "ffn_hidden_size": null, "num_query_groups": null, "make_vocab_size_divisible_by": 128,
  "data_parallel_size": 1, "lr": 0.001, "train_iters": 10, "micro_batch_size": 1
}"""


def test_an_args_json_written_before_the_split_still_builds_its_model(tmp_path):
    import json

    from megatron_ext.models import compose_transformer_config
    from megatron_ext.training.arguments import parse_args

    saved = argparse.Namespace(**json.loads(OLD_ARGS_JSON))
    model = model_config_from_args(saved, 128)
    assert (model.num_layers, model.hidden_size, model.seq_length) == (2, 64, 32)
    assert model.embedding.lev.num_heads == 2 and model.embedding.lev.rank == 8
    parallel = ModelParallelism.of(saved)
    assert parallel == ModelParallelism(tensor_model_parallel_size=2, sequence_parallel=True)
    tc = compose_transformer_config(model, parallel, ModelPrecision(bf16=saved.bf16))
    assert (tc.tensor_model_parallel_size, tc.sequence_parallel) == (2, True)
    assert tc.bf16 and tc.params_dtype == torch.bfloat16 and tc.pipeline_dtype == torch.bfloat16
    # --use-checkpoint-args restores the model flags from the same file.
    (tmp_path / "iter_0000010").mkdir()
    (tmp_path / "iter_0000010" / "args.json").write_text(OLD_ARGS_JSON)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10\n")
    args = parse_args(
        ["--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "10", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--load", str(tmp_path),
         "--use-checkpoint-args", "--tensor-model-parallel-size", "2"],
        world_size=2,
    )  # fmt: skip
    assert model_config_from_args(args, 128) == model
