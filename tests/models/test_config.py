"""Impossible layouts and settings fail at construction (or, for what needs the layout too,
in `check_layout`) with the flag to change."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from megatron_ext.config.arguments import model_config_from_args_json
from megatron_ext.config.flags import add_flags
from megatron_ext.config.layout import ParallelConfig, PrecisionConfig, check_layout
from megatron_ext.config.model import EmbeddingConfig, ModelConfig
from megatron_ext.lev import LEVConfig
from megatron_ext.models.layer_specs import get_layer_spec, transformer_engine_available

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
        (
            dict(fp8_format="hybrid", bf16=True),
            "--fp8-format needs --transformer-impl transformer_engine",
        ),
        (dict(context_parallel_size=2), "--context-parallel-size 2 needs --transformer-impl"),
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
    parts = {ParallelConfig: {}, PrecisionConfig: {}, ModelConfig: dict(BASE)}
    for name, value in overrides.items():
        owner = next(
            (c for c in (ParallelConfig, PrecisionConfig) if name in _field_names(c)), ModelConfig
        )
        parts[owner][name] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        model = ModelConfig(**parts[ModelConfig])
        check_layout(
            model,
            ParallelConfig(**parts[ParallelConfig]),
            PrecisionConfig(**parts[PrecisionConfig]),
        )


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_model_config_describes_the_model_only():
    """The layout and precision are build_model's arguments, not ModelConfig fields; the run's
    ParallelConfig and PrecisionConfig own their flags, one type each: the run, the model
    builder, the memory planner, the engines and the test harness take them."""
    from megatron_ext.config import run as config
    from megatron_ext.models import memory
    from tests.support import distributed

    moved = _field_names(ParallelConfig) | {"params_dtype", "bf16", "fp16", "fp8", "fp8_format"}
    assert not moved & _field_names(ModelConfig)
    assert {"bf16", "fp16", "fp8_format", "params_dtype"} <= _field_names(PrecisionConfig)
    assert config.ParallelConfig is ParallelConfig and config.PrecisionConfig is PrecisionConfig
    plan = {f.name: f.type for f in memory.TrainingPlan.__dataclass_fields__.values()}
    assert (plan["parallel"], plan["precision"]) == ("ParallelConfig", "PrecisionConfig")
    assert distributed.ParallelConfig is ParallelConfig
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
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2).resolve(6)
    assert ParallelConfig(2, 2).resolve(8).data_parallel_size == 2


@pytest.mark.skipif(transformer_engine_available(), reason="TE is usable here")
def test_transformer_engine_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs Transformer Engine and a CUDA GPU"):
        get_layer_spec("transformer_engine")


RUN = ["--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--seq-length", "32",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]  # fmt: skip


def _model(*argv, vocab_size: int = 128) -> ModelConfig:
    """The model of `argv` as the command line builds it, at `vocab_size`."""
    from megatron_ext.config.arguments import parse_config

    return parse_config([*RUN, *argv], world_size=1).model.replace(vocab_size=vocab_size)


def _parse(*argv):
    """The model and LEV flags alone (generated from the fields, as every parser's)."""
    parser = argparse.ArgumentParser()
    add_flags(parser, ModelConfig)
    add_flags(parser, EmbeddingConfig)
    from megatron_ext.lev import LEVConfig

    add_flags(parser, LEVConfig)
    return parser.parse_args(list(argv))


def test_presets_fill_and_flags_override():
    cfg = _model("--model-size", "1.2b", "--num-layers", "4", vocab_size=200064)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (4, 2048, 5632)
    cfg = _model("--model-size", "400m", vocab_size=200064)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (16, 1024, 16)


def test_group_query_attention_defaults_to_megatron_lms_one_group():
    """Megatron-LM: --group-query-attention without --num-query-groups is one key/value group;
    without the switch, one group per head."""
    gqa = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    assert _model(*gqa, "--group-query-attention").num_query_groups == 1
    assert _model(*gqa).num_query_groups == 4
    assert _model(*gqa, "--group-query-attention", "--num-query-groups", "2").num_query_groups == 2
    assert ModelConfig(vocab_size=64, group_query_attention=True).num_query_groups == 1


def test_flag_conflicts_are_clear_errors():
    from megatron_ext.config.arguments import ArgumentError

    with pytest.raises(ArgumentError, match="contradicts --embedding-type tied"):
        _model("--embedding-type", "tied", "--untie-embeddings-and-output-weights")
    with pytest.raises(ArgumentError, match="--num-query-groups needs --group-query-attention"):
        _model("--num-query-groups", "2")
    with pytest.raises(ArgumentError, match="set --hidden-size, --num-attention-heads"):
        _model("--num-layers", "2")
    # A model built in code fills what it is not given (the debug model's sizes).
    assert ModelConfig(vocab_size=64, num_layers=3).num_attention_heads == 4


def test_megatron_launch_script_flags_are_accepted():
    from megatron_ext.config.arguments import parse_config

    argv = (
        "--use-mcore-models --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 32 --swiglu --disable-bias-linear --normalization RMSNorm "
        "--position-embedding-type rope --untie-embeddings-and-output-weights "
        "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-rope-fusion "
        "--attention-softmax-in-fp32 --use-flash-attn --no-gradient-accumulation-fusion "
        "--micro-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 100"
    ).split()
    cfg = parse_config(argv, world_size=1).model
    assert (cfg.num_layers, cfg.hidden_size, cfg.embedding.embedding_type) == (2, 64, "lev")


@pytest.mark.parametrize(
    "flag, value",
    [("--normalization", "LayerNorm"), ("--position-embedding-type", "learned_absolute")],
)
def test_megatron_flags_asking_for_another_design_are_refused(flag, value):
    """Megatron-LM compatibility rules (`config.megatron_compat`) answer these flags."""
    from megatron_ext.config.arguments import ArgumentError, parse_config

    argv = [flag, value, "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"]
    argv += ["--seq-length", "32"]
    with pytest.raises(ArgumentError, match=f"{flag} {value}: the Leviathan backbone"):
        parse_config([*argv, "--mock-data", "--tokenizer-type", "NullTokenizer"], world_size=1)


def test_lev_flags_become_the_frozen_config_the_model_holds():
    from megatron_ext.config.arguments import ArgumentError, parse_config

    cfg = _model("--lev-num-knots", "5", "--lev-rank", "4")
    lev = cfg.embedding.lev
    assert isinstance(lev, LEVConfig)
    assert (lev.vocab_size, lev.hidden_size, lev.num_knots, lev.rank) == (128, 64, 5, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lev.num_knots = 6
    # Before the tokenizer is known: the flags at no size (the base left to the vocabulary).
    run = parse_config([*RUN, "--lev-num-knots", "5"], world_size=1)
    assert (run.lev.vocab_size, run.lev.base, run.lev.num_knots) == (None, None, 5)
    assert run.model.embedding.lev == dataclasses.replace(run.lev, hidden_size=64)
    # One LEVConfig per run; once sized, args.json still records the base as given (None).
    sized = run.with_tokenizer(argparse.Namespace(vocab_size=100, fingerprint="f"))
    assert sized.lev is sized.model.embedding.lev and sized.lev.base == 6  # V padded to 128
    assert (sized.args_json()["lev_base"], sized.args_json()["lev_num_knots"]) == (None, 5)
    with pytest.raises(ValueError, match="lev=None"):
        dataclasses.replace(sized, lev=run.lev)
    # The arms sized from LEV's count hold it too; tied / untied hold none.
    albert = _model("--embedding-type", "albert", "--lev-rank", "4")
    assert albert.embedding.lev.rank == 4
    assert _model("--embedding-type", "tied").embedding.lev is None
    with pytest.raises(ArgumentError, match="--lev-num-knots"):
        _model("--lev-num-knots", "2")


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

    from megatron_ext.config.arguments import parse_config
    from megatron_ext.models import compose_transformer_config

    saved = json.loads(OLD_ARGS_JSON)
    model = model_config_from_args_json(saved).replace(vocab_size=128)
    assert (model.num_layers, model.hidden_size, model.seq_length) == (2, 64, 32)
    assert model.embedding.lev.num_heads == 2 and model.embedding.lev.rank == 8
    parallel = ParallelConfig(
        tensor_model_parallel_size=saved["tensor_model_parallel_size"],
        sequence_parallel=saved["sequence_parallel"],
    )
    # BF16 parameters (megatron's engine) from the saved --bf16.
    precision = PrecisionConfig(bf16=saved["bf16"], params_dtype=torch.bfloat16)
    tc = compose_transformer_config(model, parallel, precision)
    assert (tc.tensor_model_parallel_size, tc.sequence_parallel) == (2, True)
    assert tc.bf16 and tc.params_dtype == torch.bfloat16 and tc.pipeline_dtype == torch.bfloat16
    # --use-checkpoint-args restores the model flags from the same file.
    (tmp_path / "iter_0000010").mkdir()
    (tmp_path / "iter_0000010" / "args.json").write_text(OLD_ARGS_JSON)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10\n")
    run = parse_config(
        ["--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "10", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--load", str(tmp_path),
         "--use-checkpoint-args", "--tensor-model-parallel-size", "2"],
        world_size=2,
    )  # fmt: skip
    # The command line's dropout is Megatron-LM's 0.1 (not a model-shaping flag: not restored).
    restored = run.model.replace(vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)
    assert restored == model
