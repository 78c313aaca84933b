"""Impossible layouts and settings fail at construction with the flag to change."""

from __future__ import annotations

import argparse

import pytest

from megatron_ext.models import ModelConfig, add_model_arguments, model_config_from_args
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
        (dict(fp8="hybrid"), "--fp8-format needs --transformer-impl transformer_engine"),
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
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ModelConfig(**{**BASE, **overrides})


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
    argv = (
        "--use-mcore-models --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 32 --swiglu --disable-bias-linear --normalization RMSNorm "
        "--position-embedding-type rope --untie-embeddings-and-output-weights "
        "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-rope-fusion "
        "--attention-softmax-in-fp32 --use-flash-attn --no-gradient-accumulation-fusion"
    ).split()
    cfg = model_config_from_args(_parse(*argv), 128)
    assert (cfg.num_layers, cfg.hidden_size, cfg.embedding.embedding_type) == (2, 64, "lev")


@pytest.mark.parametrize(
    "flag, value",
    [("--normalization", "LayerNorm"), ("--position-embedding-type", "learned_absolute")],
)
def test_megatron_flags_asking_for_another_design_are_refused(flag, value):
    with pytest.raises(ValueError, match=f"{flag} {value}: the Leviathan backbone"):
        model_config_from_args(_parse(flag, value), 128)
