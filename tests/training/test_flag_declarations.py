"""Every flag of `pretrain_leviathan.py` is declared once, by one mechanism
(`config.flags.flag`): on the config field that owns it (LEV's included), as a Megatron-LM
compatibility rule, or (until its config owns it) in the short list below."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from megatron_ext.config import run as C
from megatron_ext.config.arguments import build_parser, parse_config
from megatron_ext.config.data import DataConfig
from megatron_ext.config.flags import command_line_default, flag_dest, flag_fields, flag_name
from megatron_ext.config.lev import LEVConfig
from megatron_ext.config.megatron_compat import _CompatAction
from megatron_ext.config.model import EmbeddingConfig, ModelConfig

TREE = (
    C.RunConfig, C.ParallelConfig, C.BatchConfig, C.PrecisionConfig, C.ExitConfig,
    C.EvalConfig, C.OptimizerConfig, C.CheckpointConfig, C.LoggingConfig, C.MemoryConfig,
    C.EngineConfig, ModelConfig, EmbeddingConfig, LEVConfig, DataConfig,
)  # fmt: skip

# Flags still declared by hand (argparse code), until the config that owns them declares them.
# This list may only shrink: test_no_flag_is_declared_outside_the_tree fails on a new entry.
HAND_DECLARED = {
    # deprecated alias mapped onto --lev-kernel by config.arguments._lev_flag_values (old args.json)
    "--lev-fused",
}  # fmt: skip

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
]  # fmt: skip


def _declared() -> dict[str, dataclasses.Field]:
    """Option string -> the config field that declares it."""
    out = {}
    for cls in TREE:
        for f in flag_fields(cls):
            for name in (flag_name(f), *f.metadata["aliases"]):
                assert name not in out, f"{name} declared twice"
                out[name] = f
    return out


def test_no_flag_is_declared_outside_the_tree():
    parser = build_parser()
    declared = _declared()
    outside = set()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (_CompatAction, argparse._HelpAction)):
            continue
        names = set(action.option_strings)
        if isinstance(action, argparse.BooleanOptionalAction):  # --x and its --no-x
            names = {n for n in names if not (n.startswith("--no-") and f"--{n[5:]}" in names)}
        outside |= {n for n in names if n not in declared}
    assert outside - HAND_DECLARED == set(), "flags declared outside the config tree"
    assert HAND_DECLARED - outside == set(), "declared on a field now: drop from HAND_DECLARED"


def test_the_command_line_default_is_the_fields_default():
    """The flag's default is the field's, except where the field declares Megatron-LM's
    command-line default (and says why in its docstring)."""
    parser = build_parser()
    differs = set()
    for name, f in _declared().items():
        action = parser._option_string_actions[name]
        assert action.dest == flag_dest(f), name
        default = command_line_default(f)
        assert action.default == (list(default) if isinstance(default, tuple) else default), name
        if "command_line_default" in f.metadata:
            differs.add(name)
    # Required or derived on the command line (None), Megatron-LM's 2 workers and 0.1 dropout
    # (a model built in code: 0.0, deterministic), and TE where it can run: each field's
    # docstring says so.
    assert differs == {
        "--micro-batch-size", "--global-batch-size", "--train-iters", "--num-workers",
        "--transformer-impl", "--hidden-dropout", "--attention-dropout",
    }  # fmt: skip


def test_one_mechanism_for_every_field_backed_flag():
    """The LEV flags are generated as every other: booleans on by default get --no-x (off:
    Megatron-LM's store_true, or --lev-eval-table's own --no-lev-eval-table), tuples take any
    number of values, dests are the flag names (lev_<field>), helps and choices the fields'."""
    parser = build_parser()
    flags = parser._option_string_actions
    for f in flag_fields(LEVConfig):
        action = flags[flag_name(f)]
        assert action.dest == "lev_" + f.name and action.help == f.metadata["help"]
        if f.type == "bool":
            assert flags["--no-" + flag_name(f)[2:]] is action
    assert flags["--lev-weight-decay-groups"].nargs == "*"
    assert flags["--lev-kernel"].choices == ("auto", "reference", "torch", "triton", "cpu")
    assert flags["--lev-base"].type is int and flags["--lev-init-output-std"].type is float
    assert isinstance(flags["--sequence-parallel"], argparse._StoreTrueAction)
    assert isinstance(flags["--no-loss-curve"], argparse._StoreFalseAction)


def test_lr_decay_style_default_is_megatron_lms_command_line_default():
    parser = build_parser()
    assert parser.get_default("lr_decay_style") == "linear"
    assert C.OptimizerConfig(lr=1e-4).lr_decay_style == "linear"
    with pytest.raises(ValueError, match="--lr is required"):
        C.OptimizerConfig()


def test_every_declared_field_reaches_args_json_and_the_config():
    """A flag set to a non-default value shows in args.json and in the built RunConfig."""
    argv = [
        *BASE, "--exit-interval", "5", "--eval-iters", "3", "--clip-grad", "0.5",
        "--lr-decay-style", "cosine", "--log-interval", "7", "--ddp-bucket-size", "1000",
        "--manual-gc-interval", "4", "--profile-ranks", "0", "1", "--seed", "99",
        "--no-manual-gc-eval", "--fp8-amax-compute-algo", "max",
    ]  # fmt: skip
    cfg = parse_config(argv, world_size=1)
    saved = cfg.args_json()
    parts = {
        C.RunConfig: cfg, C.ParallelConfig: cfg.parallel, C.PrecisionConfig: cfg.precision,
        C.ExitConfig: cfg.exit, C.EvalConfig: cfg.eval, C.OptimizerConfig: cfg.optim,
        C.CheckpointConfig: cfg.ckpt, C.LoggingConfig: cfg.log, C.EngineConfig: cfg.engine,
        C.MemoryConfig: cfg.memory,
    }  # fmt: skip
    for cls, part in parts.items():
        for f in flag_fields(cls):
            value = getattr(part, f.name)
            assert saved[flag_dest(f)] == (list(value) if isinstance(value, list) else value), f
        # Derived fields too (no hand-kept list of them): every field but the parts themselves
        # and the parameters' dtype (the engine's); the flags no config owns by their names.
        for f in dataclasses.fields(cls):
            value = getattr(part, f.name)
            if f.name == "compat_flags":
                assert all(saved[k] == v for k, v in value.items())
            elif f.name != "params_dtype" and not dataclasses.is_dataclass(value):
                assert saved[f.name] == value, f.name
    assert (saved["data_parallel_size"], saved["lr_decay_steps"]) == (1, 20)
    assert (cfg.exit.exit_interval, cfg.eval.eval_iters, cfg.optim.clip_grad) == (5, 3, 0.5)
    assert (cfg.optim.lr_decay_style, cfg.log.log_interval, cfg.seed) == ("cosine", 7, 99)
    assert (cfg.engine.ddp_bucket_size, cfg.log.profile_ranks) == (1000, [0, 1])
    assert cfg.memory.manual_gc_eval is False
    assert cfg.precision.fp8_amax_compute_algo == "max"


# A non-default value for every flag that shapes the model (one valid model together). The test
# fails naming a field marked shapes_model that has no value here, so a new one is covered.
SHAPING_VALUES = {
    "--model-size": ["200m"], "--num-layers": ["3"], "--hidden-size": ["96"],
    "--num-attention-heads": ["6"], "--group-query-attention": [], "--num-query-groups": ["2"],
    "--ffn-hidden-size": ["256"], "--seq-length": ["48"], "--rotary-base": ["500000"],
    "--rotary-percent": ["0.5"], "--kv-channels": ["16"], "--norm-epsilon": ["1e-6"],
    "--qk-layernorm": [], "--max-position-embeddings": ["4096"], "--embedding-type": ["albert"],
    "--albert-dim": ["8"], "--flat-mlp-seed-dim": ["9"], "--embedding-mlp-hidden": ["10"],
    "--untie-embeddings-and-output-weights": [], "--tokenizer-type": ["NullTokenizer"],
    "--tokenizer-model": ["unused.model"], "--vocab-size": ["200"],
    "--make-vocab-size-divisible-by": ["64"], "--lev-rank": ["4"], "--lev-num-knots": ["5"],
}  # fmt: skip
RUN = [
    "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
]  # fmt: skip


def _write_checkpoint_args(root, saved: dict) -> None:
    ckpt = root / "iter_0000010"
    ckpt.mkdir()
    (ckpt / "args.json").write_text(json.dumps(saved))
    (root / "latest_checkpointed_iteration.txt").write_text("10\n")


def test_every_model_flag_reaches_args_json_and_round_trips_through_use_checkpoint_args(
    tmp_path,
):
    """Every field marked shapes_model (model, embedding, tokenizer) and every --lev-* flag is
    written to args.json and restored by --use-checkpoint-args (names read from the fields,
    no list), giving the same ModelConfig and the same tokenizer settings."""
    from megatron_ext.config.arguments import model_shaping_dests

    parser = build_parser()
    shaping = [
        f for cls in (ModelConfig, EmbeddingConfig, DataConfig) for f in flag_fields(cls)
        if f.metadata.get("shapes_model")
    ]  # fmt: skip
    missing = {flag_name(f) for f in shaping} - SHAPING_VALUES.keys()
    assert not missing, f"give these model-shaping flags a value in SHAPING_VALUES: {missing}"
    argv = [*RUN]
    for name, values in SHAPING_VALUES.items():
        argv += [name, *values]
    original = parse_config(argv, world_size=1)
    saved = original.args_json()
    lev = [flag_dest(f) for f in flag_fields(LEVConfig)]
    dests = [flag_dest(f) for f in shaping] + lev
    assert set(model_shaping_dests()) == {flag_dest(f) for f in shaping}
    for dest in dests:
        assert dest in saved, dest
    for f in shaping:  # every value in the test differs from the flag's default
        action = parser._option_string_actions[flag_name(f)]
        assert saved[flag_dest(f)] != action.default, flag_name(f)

    _write_checkpoint_args(tmp_path, saved)
    # The command line restates none of them (its own NullTokenizer size is overridden too,
    # with a warning): all come from args.json.
    restored = parse_config(
        [*RUN[:-4], "--load", str(tmp_path), "--use-checkpoint-args"], world_size=1
    )
    written = restored.args_json()
    for dest in dests:
        assert written[dest] == saved[dest], dest
    assert (restored.model, restored.lev, restored.data) == (
        original.model, original.lev, original.data
    )  # fmt: skip
    cfg = restored.model
    assert (cfg.num_layers, cfg.hidden_size, cfg.kv_channels, cfg.seq_length) == (3, 96, 16, 48)
    assert (cfg.model_size, cfg.num_query_groups, cfg.embedding.embedding_type) == (
        "200m",
        2,
        "albert",
    )
    assert (cfg.embedding.mlp_hidden, cfg.embedding.lev.rank) == (10, 4)
    data = restored.data
    assert (data.vocab_size, data.make_vocab_size_divisible_by) == (200, 64)


def test_every_model_and_data_flag_reaches_args_json_and_its_config():
    """A model or data flag set to a non-default value shows in args.json under its dest and in
    the config parsed (renamed fields included: --kv-channels is head_dim)."""
    argv = [*RUN]
    for name, values in SHAPING_VALUES.items():
        argv += [name, *values]
    argv += [
        "--init-method-std", "0.01", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--no-use-cpu-initialization", "--recompute-activations", "--recompute-method",
        "uniform", "--recompute-num-layers", "1", "--split", "90,5,5", "--data-cache-path",
        "cache", "--tiktoken-pattern", "cl100k", "--eod-mask-loss", "--reset-position-ids",
        "--reset-attention-mask", "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files", "--num-dataset-builder-threads", "3", "--vocab-file", "v.json",
        "--merge-file", "m.txt",
    ]  # fmt: skip
    run = parse_config(argv, world_size=1)
    saved = run.args_json()
    model, data = run.model, run.data
    parts = ((ModelConfig, model), (EmbeddingConfig, model.embedding), (DataConfig, data))
    for cls, part in (*parts, (LEVConfig, run.lev)):
        for f in flag_fields(cls):
            flag_value = saved[flag_dest(f)]
            if flag_value is not None:
                value = getattr(part, f.name)
                assert (list(value) if isinstance(value, tuple) else value) == flag_value, f.name
    assert model.recompute_granularity == "selective"  # Megatron-LM's --recompute-activations
    assert (model.head_dim, model.embedding.mlp_hidden) == (16, 10)
    assert (data.create_attention_mask, data.mmap_bin_files) == (False, False)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--train-samples", "1000", "--lr-decay-samples", "800", "--lr-warmup-samples", "80",
         "--rampup-batch-size", "4", "4", "400", "--global-batch-size", "8", "--decoupled-lr",
         "1e-3", "--lr-decay-style", "cosine", "--tensor-model-parallel-size", "2",
         "--sequence-parallel", "--embedding-type", "albert"],
    ],
)  # fmt: skip
def test_the_entry_point_builds_the_config_once_and_args_json_rebuilds_the_same(extra):
    """`parse_config` returns the frozen RunConfig it built while validating (derived values
    included); rebuilding it from its args.json (a checkpoint's, for tools) gives the same
    config, which writes the same args.json."""
    from megatron_ext.config.arguments import run_config_from_args_json

    argv = [*RUN, "--seq-length", "32", *extra]
    if "--train-samples" in extra:
        argv.remove("--train-iters"), argv.remove("10")
    cfg = parse_config(argv, world_size=4)
    assert run_config_from_args_json(cfg.args_json()) == cfg
    assert run_config_from_args_json(cfg.args_json()).args_json() == cfg.args_json()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch.train_iters = 1


def test_every_config_of_the_tree_checks_its_declared_values_first():
    """`flag_dataclass`: the declared checks (required, minimum, above, choices, needs) run
    before a config's own `__post_init__`, and a subclass keeps its parent's checks."""
    from megatron_ext.config.flags import flag, flag_dataclass

    @flag_dataclass
    class Parent:
        size: int = flag(1, "a size", minimum=1)
        mode: str = flag("a", "a mode", choices=("a", "b"))

        def __post_init__(self):
            if self.size == 3:
                raise ValueError("three is refused by the class itself")

    @flag_dataclass
    class Child(Parent):
        pass

    for cls in (Parent, Child):
        with pytest.raises(ValueError, match="--size must be >= 1, got 0"):
            cls(size=0)
        with pytest.raises(ValueError, match="--mode must be a or b, got 'c'"):
            cls(mode="c")
        with pytest.raises(ValueError, match="three is refused by the class itself"):
            cls(size=3)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    # Every config of the run is one (the decorator's __post_init__ wraps the class's own).
    undecorated = [c for c in TREE if not hasattr(vars(c)["__post_init__"], "__wrapped__")]
    assert not undecorated and all(c.__dataclass_params__.frozen for c in TREE)
