"""End-to-end training on CPU: `pretrain_leviathan.py` under torchrun with gloo ranks.

A tiny LEV model trains on a generated, tokenized and preprocessed corpus, without dropout (runs
at different layouts compare their losses). One single-rank run (20 iterations, checkpoints at
10 and 20) is the reference: TP=2 (+ sequence parallel) and DP=2 (+ distributed optimizer) runs
match its losses (float32, same data order); checkpoints saved at TP=2 and by the distributed
optimizer at DP=2 resume at other layouts with the same losses to a tolerance: the TP=2 one at
one rank and as PP=2 x 2 interleaved model chunks, whose checkpoint in turn resumes unchunked at
TP=2; SIGTERM to the DP=2 run's rank processes (with DataLoader workers) leaves a loadable
checkpoint and every rank exits 0 (SIGTERM to torchrun, to the whole job, Ctrl-C:
test_signals.py); a NaN stops the run without saving it. A resume at the saving run's own layout
is bit-identical, with dropout: test_resume_exact.py. PP=2 from scratch against one rank:
test_pipeline.py and test_interleaved_cli.py; --exit-duration-in-mins: test_cluster.py and
docs/cluster.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.runs import launch

pytestmark = pytest.mark.integration

RTOL = 1e-5
# Runs pretrain_leviathan in the rank's own process and records how it exited (test_signals.py).
RANK_ENTRY = Path(__file__).with_name("_rank_entry.py")


def _grad_norms(run) -> dict[int, float]:
    return {r["iteration"]: r["grad_norm"] for r in run.records}


def _ckpt(run_dir, *extra):
    return ["--save", str(run_dir / "ckpt"), *extra]


def _assert_close(actual: dict, expected: dict, iterations, rtol: float = RTOL) -> None:
    for it in iterations:
        assert it in actual, f"iteration {it} missing from {sorted(actual)}"
        assert math.isclose(actual[it], expected[it], rel_tol=rtol), (
            f"iteration {it}: {actual[it]!r} != {expected[it]!r} (rtol {rtol})"
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def ref_run(launcher, base_args, runs):
    """Single rank, 20 iterations, checkpoints at 10 and 20, TensorBoard."""
    d = runs / "ref"
    args = [*base_args, *_ckpt(d, "--save-interval", "10"), "--exit-interval", "20"]
    args += ["--tensorboard-dir", str(d / "tb")]
    return launcher(1, args, d).check()


@pytest.fixture(scope="module")
def tp_run(launcher, base_args, runs):
    """TP=2 with sequence parallelism, 20 iterations (of the schedule's 30), checkpoints at 10
    and 20."""
    d = runs / "tp2"
    args = [*base_args, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    args += ["--exit-interval", "20"]
    return launcher(2, [*args, *_ckpt(d, "--save-interval", "10")], d).check()


@pytest.fixture(scope="module")
def zero_run(base_args, runs):
    """DP=2 with the distributed optimizer and 2 DataLoader workers per rank (no validation,
    whose iterator would start workers of its own), saving every 2 iterations (keeping 2),
    under torchrun, stopped by SIGTERM to the rank processes after iteration 3
    (test_signals.py's other two deliveries); each rank records its exit in d/exits."""
    d = runs / "dp2"
    (d / "exits").mkdir(parents=True)
    args = [*base_args, "--use-distributed-optimizer", "--exit-signal-handler", "--eval-iters"]
    args += ["0", "--num-workers", "2"]
    args += _ckpt(d, "--save-interval", "2", "--ckpt-keep-last", "2")
    env = {"LEVIATHAN_TEST_EXIT_DIR": str(d / "exits")}
    return launch(2, args, d, sigterm_after_iteration=3, entry=RANK_ENTRY, env=env)


def test_reference_run_logs_validates_and_checkpoints(ref_run, runs):
    assert sorted(ref_run.losses) == list(range(1, 21))
    out = ref_run.output
    assert "iteration       20/      30 | consumed samples:          160" in out
    for field in ("learning rate:", "lm loss:", "grad norm:", "tokens per second:"):
        assert field in out
    assert "validation loss at iteration 10" in out and "lm loss PPL" in out
    assert "git=" in out and "megatron-core=" in out  # provenance of the run
    ckpt = runs / "ref" / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    for it in (10, 20):
        d = ckpt / f"iter_{it:07d}"
        assert (d / ".metadata").is_file() and (d / "common.json").is_file()
        saved = json.loads((d / "args.json").read_text())
        assert saved["embedding_type"] == "lev"
        # LEV's training controls are recorded with their (spec) defaults.
        assert saved["lev_init_output_std"] is None and saved["lev_lr_mult"] == 1.0
        assert saved["lev_weight_decay_groups"] == [
            "codebooks", "seed_proj", "spline_delta", "out_proj"
        ]  # fmt: skip
    assert "lev_weight_decay_groups ......" in out  # the config dump
    assert not list(ckpt.glob("*.tmp"))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs / "ref" / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in (
        "lm loss",
        "lm loss ppl",
        "learning-rate",
        "grad-norm",
        "lm loss validation",
        "lm loss validation ppl",
        "throughput/tokens per second",
        "iteration-time",
    ):
        assert tag in tags, f"TensorBoard scalar {tag!r} missing from {sorted(tags)}"
    assert len(events.Scalars("lm loss")) == 20


def test_tensor_parallel_matches_and_loss_falls(tp_run, ref_run):
    losses = tp_run.losses
    assert sorted(losses) == list(range(1, 21))
    _assert_close(losses, ref_run.losses, range(1, 6))
    # Clipping is active (norms > 1): TP-sharded and replicated parameters each counted once.
    _assert_close(_grad_norms(tp_run), _grad_norms(ref_run), range(1, 6))
    first, last = [losses[i] for i in range(1, 6)], [losses[i] for i in range(16, 21)]
    assert sum(last) / 5 < sum(first) / 5 - 0.5, f"loss did not fall: {first} -> {last}"


def test_data_parallel_distributed_optimizer_and_sigterm(zero_run, ref_run, runs):
    """SIGTERM to the ranks (a `kill` of the training processes): they finish the iteration,
    save it and exit 0 with their DataLoader workers, and so does torchrun."""
    zero_run.check()
    output = zero_run.output
    assert zero_run.workers == [2, 2], f"expected 2 DataLoader workers per rank: {zero_run.workers}"
    exits = {p.name: p.read_text() for p in sorted((runs / "dp2" / "exits").iterdir())}
    assert exits == {"rank0": "0", "rank1": "0"}, f"{exits}\n{output[-5000:]}"
    assert "DataLoader worker" not in output and "Traceback" not in output, output[-5000:]
    stopped = max(zero_run.losses)
    assert 3 <= stopped < 18, f"SIGTERM landed at iteration {stopped}"
    assert f"exiting at iteration {stopped} (signal)" in output
    _assert_close(zero_run.losses, ref_run.losses, range(1, stopped + 1))
    _assert_close(_grad_norms(zero_run), _grad_norms(ref_run), range(1, stopped + 1))
    ckpt = runs / "dp2" / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    kept = sorted(p.name for p in ckpt.glob("iter_*"))
    assert len(kept) == 2 and kept[-1] == f"iter_{stopped:07d}", kept  # --ckpt-keep-last 2
    assert (ckpt / kept[-1] / "common.json").is_file() and not list(ckpt.glob("*.tmp"))
    assert not (ckpt / "save.lock").exists()  # the run released --save on its way out


def test_tensor_parallel_checkpoint_resumes_at_one_rank(launcher, base_args, tp_run, runs):
    """(At PP=2 x 2 chunks: test_interleaved_chunks_load_a_single_stage_checkpoint.)"""
    d = runs / "from_tp2"
    args = [*base_args, "--load", str(runs / "tp2" / "ckpt"), "--ckpt-step", "10"]
    run = launcher(1, [*args, "--exit-interval", "13"], d).check()
    assert "RNG states not restored" in run.output  # the layout changed
    assert sorted(run.losses) == [11, 12, 13]
    # Iterations 12 and 13 depend on the resharded Adam moments as well as the weights.
    _assert_close(run.losses, tp_run.losses, [11, 12, 13])


def test_distributed_optimizer_states_reshard(launcher, base_args, zero_run, ref_run, runs):
    """ZeRO-1 at DP=2 -> plain AdamW at TP=2 (each rank now needs every state, as TP shards)."""
    zero_run.check()
    stopped = max(zero_run.losses)
    d = runs / "from_dp2"
    args = [*base_args, "--tensor-model-parallel-size", "2", "--load", str(runs / "dp2" / "ckpt")]
    run = launcher(2, [*args, "--exit-interval", str(stopped + 3)], d).check()
    assert sorted(run.losses) == [stopped + 1, stopped + 2, stopped + 3]
    _assert_close(run.losses, ref_run.losses, sorted(run.losses))


@pytest.fixture(scope="module")
def interleaved_run(launcher, base_args, tp_run, runs):
    """PP=2 x 2 model chunks per rank (interleaved 1F1B) resuming the TP=2 run's single-stage
    checkpoint at iteration 10 (its TP shards joined, its layers cut into chunks) and saving
    its chunks at 12 and 14."""
    d = runs / "vp2"
    args = [*base_args, "--pipeline-model-parallel-size", "2"]
    args += ["--num-layers-per-virtual-pipeline-stage", "1", "--exit-interval", "14"]
    args += ["--load", str(runs / "tp2" / "ckpt"), "--ckpt-step", "10"]
    return launcher(2, [*args, *_ckpt(d, "--save-interval", "2")], d).check()


def test_interleaved_chunks_load_a_single_stage_checkpoint(interleaved_run, tp_run, runs):
    run = interleaved_run
    assert "model chunks per pipeline rank: 2" in run.output
    assert "loaded checkpoint" in run.output and "RNG states not restored" in run.output
    assert sorted(run.losses) == [11, 12, 13, 14]
    # Iterations 12 on depend on the resharded Adam moments as well as the weights.
    _assert_close(run.losses, tp_run.losses, [11, 12, 13, 14])
    _assert_close(_grad_norms(run), _grad_norms(tp_run), [11, 12, 13, 14])
    ckpt = runs / "vp2" / "ckpt"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000012", "iter_0000014"]
    layout = json.loads((ckpt / "iter_0000012" / "common.json").read_text())["layout"]
    assert layout == {"tp": 1, "pp": 2, "cp": 1, "dp": 1}, layout


def test_interleaved_checkpoint_resumes_without_chunks_at_tp2(
    launcher, base_args, interleaved_run, tp_run, runs
):
    """Chunks saved by PP=2 x 2 load into one unchunked TP=2 stage (each TP rank now holds half
    of every layer of both ranks' chunks), Adam moments included."""
    d = runs / "from_vp2"
    args = [*base_args, "--tensor-model-parallel-size", "2", "--exit-interval", "14"]
    run = launcher(2, [*args, "--load", str(runs / "vp2" / "ckpt"), "--ckpt-step", "12"], d)
    run.check()
    assert "model chunks per pipeline rank" not in run.output
    assert sorted(run.losses) == [13, 14]
    _assert_close(run.losses, interleaved_run.losses, [13, 14])
    _assert_close(run.losses, tp_run.losses, [13, 14])


def test_tied_embeddings_under_pipeline_parallelism(launcher, base_args, runs):
    """TIED arm: the last stage's output head is a copy of the first stage's table whose
    gradients are summed over the embedding group; PP=2 must equal one rank."""
    args = [*base_args, "--embedding-type", "tied", "--exit-interval", "3"]
    single = launcher(1, args, runs / "tied1").check()
    piped = launcher(2, [*args, "--pipeline-model-parallel-size", "2"], runs / "tied_pp2").check()
    _assert_close(piped.losses, single.losses, [1, 2, 3])


def test_nonfinite_loss_stops_and_is_never_saved(launcher, base_args, runs):
    d = runs / "nan"
    # lr 1e30: the first step blows the weights up, the second iteration's loss is NaN.
    args = [*base_args, "--lr", "1e30", "--min-lr", "0", "--lr-warmup-iters", "0"]
    run = launcher(1, [*args, *_ckpt(d, "--save-interval", "1")], d)
    assert run.returncode == 1, run.output[-3000:]
    error = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "iteration 2" in error[0] and "rank(s) [0]" in error[0], error
    # one rank, no data parallelism: its gradients are checked once the norm is not finite
    assert "non-finite gradients on rank(s) [0]" in error[0], error
    assert (d / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (d / "ckpt" / "iter_0000002").exists()


def test_bf16_autocast_on_cpu(launcher, base_args, ref_run, runs):
    """--bf16 runs under CPU autocast with fp32 master weights: close to, not equal to, fp32."""
    run = launcher(1, [*base_args, "--bf16", "--exit-interval", "3"], runs / "bf16").check()
    _assert_close(run.losses, ref_run.losses, [1, 2, 3], rtol=1e-2)
    assert run.losses != {i: ref_run.losses[i] for i in (1, 2, 3)}
