"""Megatron-LM flag compatibility: every flag of Megatron-LM core_v0.16.1's named argument
groups and of its LLaMA-3 8B / GPT-3 175B example scripts is known to the parser, with the
answer docs/megatron-compat.md shows (generated from the parser)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from megatron_ext.config.arguments import ArgumentError, build_parser, parse_config
from megatron_ext.config.megatron_compat import compat_table, flag_status
from megatron_ext.config.megatron_flags import MEGATRON_FLAGS

REPO = Path(__file__).resolve().parents[2]

# Training arguments of Megatron-LM core_v0.16.1's examples, unchanged but for the paths.
LLAMA3_8B_FP8 = [
    "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096",
    "--ffn-hidden-size", "14336", "--num-attention-heads", "32", "--group-query-attention",
    "--num-query-groups", "8", "--kv-channels", "128", "--seq-length", "8192",
    "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
    "--attention-backend", "fused", "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--micro-batch-size", "1", "--global-batch-size", "128",
    "--train-samples", "1953125000", "--lr-decay-samples", "1949218748",
    "--lr-warmup-samples", "3906252", "--lr", "0.00015", "--min-lr", "0.00001",
    "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine",
    "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
    "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
    "--exit-duration-in-mins", "235", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
    "--fp8-amax-compute-algo", "max", "--fp8-param-gather", "--tensor-model-parallel-size", "1",
    "--context-parallel-size", "1", "--sequence-parallel", "--use-distributed-optimizer",
    "--overlap-grad-reduce", "--overlap-param-gather", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--data-cache-path", "cache",
    "--tiktoken-pattern", "v2", "--split", "99,1,0", "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files", "--num-workers", "1", "--log-interval", "1", "--eval-iters", "32",
    "--eval-interval", "100", "--save-interval", "1000", "--log-throughput", "--profile",
    "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format", "torch_dist",
    "--distributed-timeout-minutes", "60", "--save", "ckpt", "--load", "ckpt",
    "--tensorboard-dir", "tb",
]  # fmt: skip
GPT3_175B = [
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
    "--seq-length", "2048", "--max-position-embeddings", "2048", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "1536",
    "--rampup-batch-size", "16", "16", "5859375", "--train-iters", "500000",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
    "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
    "--lr-decay-iters", "430000", "--tensor-model-parallel-size", "8",
    "--pipeline-model-parallel-size", "16", "--data-path", "data", "--vocab-file", "vocab.json",
    "--merge-file", "merges.txt", "--split", "949,50,1", "--log-interval", "100",
    "--save-interval", "10000", "--eval-interval", "1000", "--save", "ckpt", "--load", "ckpt",
    "--eval-iters", "10", "--tensorboard-dir", "tb",
]  # fmt: skip
BASE = [
    "--micro-batch-size", "2", "--seq-length", "32", "--lr", "1e-3", "--train-iters", "10",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
]  # fmt: skip


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def test_every_megatron_flag_has_an_answer(parser):
    assert len(MEGATRON_FLAGS) > 450
    unknown = [flag for _, flag, _ in MEGATRON_FLAGS if flag_status(parser, flag)[0] == "unknown"]
    assert unknown == []
    for _, flag, _ in MEGATRON_FLAGS:
        status, note = flag_status(parser, flag)
        if status != "implemented":
            assert note and "\n" not in note, f"{flag} ({status}) has no one-line reason"


@pytest.mark.parametrize("argv", [LLAMA3_8B_FP8, GPT3_175B], ids=["llama3-8b-fp8", "gpt3-175b"])
def test_example_scripts_parse(parser, argv):
    _, unknown = parser.parse_known_args(argv)
    assert unknown == []


def test_docs_table_is_generated_from_the_parser(parser):
    doc = (REPO / "docs" / "megatron-compat.md").read_text()
    assert doc == compat_table(parser), (
        "docs/megatron-compat.md is stale: python -m megatron_ext.training.compat_doc "
        "--write docs/megatron-compat.md"
    )
    assert "| `--apply-layernorm-1p` |" in doc and "| `--moe-router-topk` |" in doc


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--moe-router-topk", "2"], "--moe-router-topk 2: no mixture-of-experts layers"),
        (["--use-legacy-models"], "--use-legacy-models: only megatron-core models"),
        (
            ["--microbatch-group-size-per-virtual-pipeline-stage", "2"],
            "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank",
        ),
        (["--cp-comm-type", "a2a"], "context parallelism is TE's p2p ring"),
        (["--dist-ckpt-format", "zarr"], "checkpoints are one format"),
        (["--fp8-amax-history-len", "16"], "needs --fp8-format"),
        (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
        (["--rampup-batch-size", "3", "2", "10", "--global-batch-size", "8"], "START 3"),
        (["--skip-train"], "--skip-train evaluates a checkpoint: pass --load"),
        (["--profile", "--profile-step-start", "3", "--profile-step-end", "3"], "--profile"),
    ],
)
def test_refused_flags_say_why_in_one_line(extra, message):
    with pytest.raises(ArgumentError) as info:
        parse_config([*BASE, *extra], world_size=1)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_cuda_path_flags_on_cpu(caplog):
    with caplog.at_level(logging.INFO):
        run = parse_config([*BASE, "--overlap-grad-reduce", "--attention-backend", "flash"], 1)
    assert run.engine.overlap_grad_reduce is True
    assert run.compat_flags["attention_backend"] == "flash"
    assert "--overlap-grad-reduce: ignored on CPU" in caplog.text
    assert "--attention-backend: ignored on CPU" in caplog.text
    with pytest.raises(ArgumentError, match="--tp-comm-overlap: TP communication overlap"):
        parse_config([*BASE, "--tp-comm-overlap"], 1)


def test_design_flags_show_their_effective_values():
    run = parse_config([*BASE, "--cp-comm-type", "p2p", "--position-embedding-type", "rope"], 1)
    # Always on in this design, whether typed or not: the argument dump (args.json) says so.
    saved = run.args_json()
    assert saved["swiglu"] is True and saved["disable_bias_linear"] is True
    assert saved["use_mcore_models"] is True and saved["cp_comm_type"] == ["p2p"]
    assert "_megatron_compat_given" not in saved


def test_gpt2_bpe_is_inferred_from_vocab_and_merge_files():
    argv = [a for a in BASE if a not in ("--tokenizer-type", "NullTokenizer")]
    run = parse_config([*argv, "--vocab-file", "v.json", "--merge-file", "m.txt"], 1)
    assert run.data.tokenizer_type == "GPT2BPETokenizer"
    assert run.args_json()["tokenizer_type"] == "GPT2BPETokenizer"


def test_rampup_sets_train_iters_from_train_samples():
    argv = [a for a in BASE if a not in ("--train-iters", "10")]
    run = parse_config(
        [*argv, "--train-samples", "40", "--global-batch-size", "8",
         "--rampup-batch-size", "2", "2", "12"],
        1,
    )  # fmt: skip
    # Megatron's count: batches 2, 2, 4, 6 (14 samples, past the 12 of the ramp), then
    # (40 - 14) // 8 = 3 full batches.
    assert run.batch.train_iters == 7


def test_defaults_are_megatron_lms_or_listed_with_their_reason(parser):
    """Issue 47: a launch script written for Megatron-LM that relies on a default trains what
    it trained there. Every option the parser shares with Megatron-LM core_v0.16.1's own parser
    (its dests and defaults recorded from the tag by tests/training/megatron_lm_defaults.py)
    defaults as there, or is in DEFAULT_DIFFERENCES with Megatron-LM's default and why;
    docs/megatron-compat.md lists those."""
    import argparse
    import json

    from megatron_ext.config.megatron_compat import DEFAULT_DIFFERENCES
    from megatron_ext.config.model import transformer_engine_available

    table = json.loads((Path(__file__).parent / "data" / "megatron_lm_defaults.json").read_text())
    assert table["tag"] == "core_v0.16.1"
    theirs = table["options"]
    shared = [option for option in parser._option_string_actions if option in theirs]
    assert len(shared) > 450
    differ = {}
    for option in shared:
        action = parser._option_string_actions[option]
        if action.default is argparse.SUPPRESS:
            continue  # a compatibility flag that stores nothing unless given (nothing reads it)
        ours = list(action.default) if isinstance(action.default, tuple) else action.default
        if ours != theirs[option]["default"]:
            differ[option] = theirs[option]["default"]
    listed = {flag: default for flag, (default, _) in DEFAULT_DIFFERENCES.items()}
    if transformer_engine_available():  # then --transformer-impl defaults as in Megatron-LM
        listed.pop("--transformer-impl")
    assert differ == listed
    # The training defaults issue 47 took from Megatron-LM.
    for option, default in (
        ("--hidden-dropout", 0.1), ("--attention-dropout", 0.1), ("--fp8-amax-history-len", 1),
        ("--fp8-amax-compute-algo", "most_recent"), ("--eval-interval", None),
    ):  # fmt: skip
        assert (
            parser._option_string_actions[option].default == default == (theirs[option]["default"])
        ), option
    doc = (REPO / "docs" / "megatron-compat.md").read_text()
    for flag in DEFAULT_DIFFERENCES:
        assert any(
            row.startswith(f"| `{flag}` |") for row in doc.split("## Defaults")[1].splitlines()
        )


def test_fp8_param_gather_is_implemented_where_it_can_work(parser):
    """Before issue 47 the table called --fp8-param-gather refused (both engines refused it);
    now the row says where it works (tests/training/test_gpu_path.py checks that it does)."""
    status, note = flag_status(parser, "--fp8-param-gather")
    assert status == "implemented" and "--ddp-impl megatron --use-distributed-optimizer" in note
