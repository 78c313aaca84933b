"""A Megatron-LM user's smoke test: the training arguments of Megatron-LM core_v0.16.1's
`examples/llama/train_llama3_8b_h100_fp8.sh` (sizes shrunk, `--fp8-*` removed, paths replaced)
run on CPU with --mock-data, and those of `examples/gpt3/train_gpt3_175b_distributed.sh` run on
2 gloo ranks at TP=2 with a GPT2BPETokenizer vocab/merges pair and a dataset preprocessed with
it. The same runs check --skip-train, --calculate-per-token-loss, and that a --rampup-batch-size
run resumed from its own mid-run --async-save checkpoint repeats the uninterrupted run exactly."""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import re
import subprocess
import sys

import pytest

from megatron_ext.data.readers import iter_lines
from tests.support.gpt2_bpe import write_gpt2_bpe_files
from tests.support.runs import REPO

pytestmark = pytest.mark.integration


def llama3_8b(run_dir) -> list[str]:
    """examples/llama/train_llama3_8b_h100_fp8.sh: sizes shrunk, --fp8-* removed."""
    return [
        "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64",
        "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "32",
        "--max-position-embeddings", "32", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
        "--attention-backend", "fused", "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "12",
        "--lr-decay-samples", "12", "--lr-warmup-samples", "4", "--lr", "0.00015",
        "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
        "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--data-cache-path", str(run_dir / "cache"), "--tiktoken-pattern", "v2",
        "--split", "99,1,0", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
        "--num-workers", "1", "--log-interval", "1", "--eval-iters", "1",
        "--eval-interval", "100", "--save-interval", "1000", "--log-throughput", "--profile",
        "--profile-step-start", "1", "--profile-step-end", "2", "--ckpt-format", "torch_dist",
        "--distributed-timeout-minutes", "60", "--save", str(run_dir / "ckpt"),
        "--load", str(run_dir / "ckpt"), "--tensorboard-dir", str(run_dir / "tb"),
    ]  # fmt: skip


def gpt3_175b(run_dir, data_prefix, vocab, merges) -> list[str]:
    """examples/gpt3/train_gpt3_175b_distributed.sh: sizes shrunk, TP 8 -> 2, PP 16 -> 1."""
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "8",
        "--rampup-batch-size", "2", "2", "8", "--train-iters", "5",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
        "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
        "--lr-decay-iters", "10", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "1", "--data-path", data_prefix,
        "--vocab-file", vocab, "--merge-file", merges, "--split", "949,50,1",
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
        "--save", str(run_dir / "ckpt"), "--load", str(run_dir / "ckpt"), "--eval-iters", "1",
        "--tensorboard-dir", str(run_dir / "tb"),
    ]  # fmt: skip


def _drop(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + 1 :]


def _scalars(tb_dir) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir))
    events.Reload()
    return {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("recipes")


@pytest.fixture(scope="module")
def llama_run(launcher, runs):
    d = runs / "llama"
    return launcher(1, llama3_8b(d), d).check()


def test_llama3_8b_fp8_vector_runs_on_cpu(llama_run, runs):
    out = llama_run.output
    assert [r["iteration"] for r in llama_run.records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in llama_run.records)
    assert "done (finished)" in out
    # What a Megatron user looks at: elapsed, ETA and tokens in the line; effective values.
    assert re.search(r"elapsed: \d+:\d\d:\d\d \| ETA: \d+:\d\d:\d\d", out)
    assert "consumed tokens:            384" in out  # 3 x 4 samples x 32 tokens
    assert re.search(r"  swiglu \.+ True", out) and re.search(r"  apply_layernorm_1p \.+ True", out)
    for note in ("--attention-backend: ignored on CPU", "--overlap-grad-reduce: ignored on CPU",
                 "--sequence-parallel is off"):  # fmt: skip
        assert note in out
    tb = runs / "llama" / "tb"
    assert glob.glob(str(tb / "rank0*.pt.trace.json")), "no profiler trace beside the events"
    scalars = _scalars(tb)
    assert [v for _, v in scalars["batch-size"]] == [4.0, 4.0, 4.0]
    assert [s for s, _ in scalars["lm loss vs tokens"]] == [128, 256, 384]


def test_skip_train_evaluates_the_checkpoint(launcher, llama_run, runs):
    d = runs / "llama"
    run = launcher(1, [*llama3_8b(d), "--skip-train"], d / "skip").check()
    assert run.records == [] and "done (skip-train)" in run.output
    assert "--skip-train: evaluating iteration 3" in run.output
    assert "validation loss at iteration 3" in run.output


def test_per_token_loss_equals_the_mean_loss_on_full_sequences(launcher, llama_run, runs):
    # Mock sequences count every token, so normalising by the global token count is the mean
    # of the micro-batch means: the same run up to rounding (BF16 autocast). The run also logs
    # to Weights & Biases in offline mode (no network) when wandb is installed.
    d = runs / "mean-loss"
    wandb = importlib.util.find_spec("wandb") is not None
    extra = ["--wandb-project", "leviathan", "--wandb-exp-name", "mean-loss",
             "--wandb-save-dir", str(d / "wandb")] if wandb else []  # fmt: skip
    run = launcher(1, [*_drop(llama3_8b(d), "--calculate-per-token-loss"), *extra], d).check()
    for it, loss in llama_run.losses.items():
        assert math.isclose(run.losses[it], loss, rel_tol=2e-3), (it, run.losses[it], loss)
    assert llama_run.losses[1] == run.losses[1]  # before any update
    if wandb:
        (record,) = glob.glob(str(d / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
        with open(record, "rb") as handle:
            content = handle.read()
        assert b"lm loss" in content and b"batch-size" in content


def _rampup_argv(d) -> list[str]:
    # Dropout at Megatron-LM's default (the recipe sets 0.0; the last flag given wins): the
    # resume must repeat its masks too.
    return [
        *llama3_8b(d), "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--rampup-batch-size", "1", "1", "6", "--log-params-norm",
        "--log-num-zeros-in-grad", "--log-memory-to-tensorboard", "--manual-gc-interval", "1",
        "--async-save",
    ]  # fmt: skip


def _replace(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return [*argv[: i + 1], value, *argv[i + 2 :]]


def test_rampup_resumes_exactly(launcher, runs):
    # The uninterrupted run also saves (asynchronously) at iteration 3 and exits by
    # --exit-interval at its last iteration; a second run resumes from the iteration-3 save.
    d = runs / "ramp"
    argv = [*_replace(_rampup_argv(d), "--save-interval", "3"), "--exit-interval", "5"]
    whole = launcher(1, argv, d).check()
    # Megatron's ramp of 3 steps over 6 samples: 1, 1, 2, 3 (7 samples), then full batches of 4.
    consumed = [r["consumed_samples"] for r in whole.records]
    assert consumed == [1, 2, 4, 7, 11]
    assert "exiting at iteration 5 (exit-interval)" in whole.output
    assert (d / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    for it in (3, 5):
        assert (d / "ckpt" / f"iter_{it:07d}" / "common.json").is_file(), it
    resumed_dir = runs / "ramp-resumed"
    argv = _replace(_rampup_argv(resumed_dir), "--load", str(d / "ckpt")) + ["--ckpt-step", "3"]
    second = launcher(1, argv, resumed_dir).check()
    assert "loaded checkpoint" in second.output and "(iteration 3," in second.output
    assert [r["iteration"] for r in second.records] == [4, 5]
    for key in ("iteration", "consumed_samples", "loss", "grad_norm", "lr"):
        assert [r[key] for r in second.records] == [r[key] for r in whole.records[3:]], key
    scalars = _scalars(d / "tb")
    assert [v for _, v in scalars["batch-size"]] == [1.0, 1.0, 2.0, 3.0, 4.0]
    assert "params-norm" in scalars and "num-zeros" in scalars
    assert any(tag.startswith("mem-") for tag in scalars)
    assert "params norm:" in whole.output and "num zeros:" in whole.output


@pytest.fixture(scope="module")
def gpt2_data(runs):
    """A GPT2BPETokenizer vocab/merges pair trained on the sample corpus, and the corpus (one
    sentence per document, so that --split 949,50,1 leaves a test split) preprocessed with it."""
    d = runs / "gpt2-data"
    subprocess.run(
        [sys.executable, "tools/make_sample_corpus.py", "--output", str(d / "raw"),
         "--size-mb", "0.3"],
        check=True, cwd=REPO, capture_output=True,
    )  # fmt: skip
    texts = [
        json.loads(line)["text"]
        for path in sorted(glob.glob(str(d / "raw" / "train" / "*")))
        for _, line in iter_lines(path)
    ]
    vocab, merges = write_gpt2_bpe_files(str(d / "bpe"), texts[:200], vocab_size=1000)
    sentences = [s for t in texts for s in re.split(r"(?<=[.!?])\s+", t) if s.strip()]
    with open(d / "sentences.jsonl", "w") as handle:
        handle.writelines(json.dumps({"text": s}) + "\n" for s in sentences)
    subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(d / "sentences.jsonl"),
         "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
         "--output-prefix", str(d / "gpt2"), "--append-eod", "--workers", "1"],
        check=True, cwd=REPO, capture_output=True,
    )  # fmt: skip
    return str(d / "gpt2_text_document"), vocab, merges


def test_gpt3_175b_vector_runs_on_two_ranks_tp2(launcher, runs, gpt2_data):
    d = runs / "gpt3"
    run = launcher(2, gpt3_175b(d, *gpt2_data), d).check()
    assert "tokenizer_type .......................... GPT2BPETokenizer" in run.output
    assert "layout: world 2 = TP 2 x CP 1 x PP 1 x DP 1" in run.output
    # --rampup-batch-size 2 2 8 to a global batch of 8: 2, 2, 4, then 8.
    assert [r["consumed_samples"] for r in run.records] == [2, 4, 8, 16, 24]
    assert all(math.isfinite(r["loss"]) for r in run.records)
    assert "validation loss at iteration 5" in run.output and "test loss" in run.output
