"""The on-paper memory of `models.memory` against bytes that autograd really saves on CPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
from megatron_ext.config.model import MODEL_SIZE_PRESETS, ModelConfig
from megatron_ext.models import param_table
from megatron_ext.models.memory import (
    TrainingPlan,
    estimate_export_memory,
    estimate_memory,
    estimate_save_memory,
    flops_per_token,
)
from tests.support.distributed import call_in_file, run_distributed

pytestmark = pytest.mark.integration

ARMS = ("tied", "untied", "albert", "flat-mlp", "factored-mlp", "lev")
SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2)
LEV = dict(seed_dim=16, rank=8, num_heads=2, num_knots=6)
VOCAB, SEQ, BATCH = 300, 16, 3


def _config(arm: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        seq_length=SEQ,
        ffn_hidden_size=48,
        embedding=dict(embedding_type=arm, lev=dict(LEV)),
        **SHAPE,
    )


def _measure(arms, autocast_bf16: bool, tp: int, sp: bool, batch: int = BATCH) -> dict:
    """Bytes saved for backward by one forward + loss of each arm (this rank), micro-batch
    `batch` x SEQ."""
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.models import build_model
    from tests.support.memory import saved_tensor_bytes

    sizes = {}
    for arm in arms:
        torch.manual_seed(0)
        parallel = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)
        model = build_model(_config(arm), parallel=parallel, precision=PrecisionConfig())
        # Distinct ids: LEV's dedup then evaluates exactly T ids (unique_fraction = 1).
        ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[: batch * SEQ]
        ids = ids.view(batch, SEQ).clone()  # its own storage, not a view of all V ids
        pos = torch.arange(SEQ).expand(batch, SEQ)
        ctx = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if autocast_bf16
            else contextlib.nullcontext()
        )
        with ctx:
            size, loss = saved_tensor_bytes(
                lambda: model(ids, pos, None, labels=ids), exclude=model.parameters()
            )
        loss.float().sum().backward()
        sizes[arm] = size
    return sizes


def _measure_cases(cases) -> list:
    return [_measure(*case) for case in cases]


# LEV projects its seeds by digit when a micro-batch has more distinct ids (BATCH * SEQ = 48)
# than codebook rows (k * b = 3 * 7 = 21); the last case (16 ids) takes the per-id path.
ONE_RANK_CASES = [(ARMS, False, 1, False), (ARMS, True, 1, False), (("lev",), False, 1, False, 1)]
FLOP_ARMS = ("untied", "albert")


def _one_rank_figures(cases, arms) -> dict:
    return dict(measured=_measure_cases(cases), flops=_count_flops_many(arms))


@pytest.fixture(scope="module")
def one_rank():
    """What one spawned rank measured: `_measure_cases(ONE_RANK_CASES)` and
    `_count_flops_many(FLOP_ARMS)` (one process for both tests that need a single rank)."""
    args = (__file__, "_one_rank_figures", ONE_RANK_CASES, FLOP_ARMS)
    return run_distributed(call_in_file, 1, args=args)[0]


def test_activation_figure_equals_the_measured_local_path(one_rank):
    cases, measured = ONE_RANK_CASES, one_rank["measured"]
    for (arms, bf16, _, _, *batch), sizes in zip(cases, measured):
        precision = PrecisionConfig(bf16=bf16)
        layout = TrainingPlan(precision=precision, micro_batch_size=(batch or [BATCH])[0])
        for arm in arms:
            estimate = estimate_memory(_config(arm), layout).activations
            assert estimate == sizes[arm], (arm, bf16, estimate, sizes[arm])


def test_activation_figure_under_tensor_and_sequence_parallelism():
    arms = ("untied", "lev")
    cases = [(arms, True, 2, False), (arms, True, 2, True)]
    measured = run_distributed(call_in_file, 2, tp=2, args=(__file__, "_measure_cases", cases))
    for i, (_, _, tp, sp) in enumerate(cases):
        parallel = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)
        layout = TrainingPlan(parallel=parallel, micro_batch_size=BATCH)
        for arm in arms:
            estimate = estimate_memory(_config(arm), layout).activations
            assert [estimate] * 2 == [m[i][arm] for m in measured], (arm, sp, estimate, measured)


def _count_flops(arm) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.models import build_model

    torch.manual_seed(0)
    model = build_model(_config(arm), parallel=ParallelConfig(), precision=PrecisionConfig())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    with FlopCounterMode(display=False) as counter:
        model(ids, pos, None, labels=ids).float().sum().backward()
    return counter.get_total_flops()


def test_flops_per_token_equals_torch_flop_counter(one_rank):
    # torch counts the matmuls, forward and backward, but not the CPU SDPA kernel: the
    # attention term (2 * 2 * s * D per layer forward, x3 with backward) is added here.
    arms, counted = FLOP_ARMS, one_rank["flops"]
    attention = 3 * SHAPE["num_layers"] * 4 * SEQ * SHAPE["hidden_size"]
    for arm in arms:
        assert flops_per_token(_config(arm)) * BATCH * SEQ == counted[arm] + attention * BATCH * SEQ


def _count_flops_many(arms) -> dict:
    return {arm: _count_flops(arm) for arm in arms}


def test_optimizer_state_bytes_and_a_1_2b_run_on_8_gpus():
    cfg = ModelConfig(
        vocab_size=200064, seq_length=4096, embedding=dict(embedding_type="lev"),
        **MODEL_SIZE_PRESETS["1.2b"],
    )  # fmt: skip
    dp8 = ParallelConfig(data_parallel_size=8)
    portable = estimate_memory(cfg, TrainingPlan(parallel=dp8))
    assert portable.weights == portable.grads == 4 * portable.parameters
    assert portable.optimizer == 8 * portable.parameters
    distopt = ParallelConfig(data_parallel_size=8, use_distributed_optimizer=True)
    megatron = estimate_memory(cfg, TrainingPlan(parallel=distopt, engine="megatron"))
    assert (megatron.weights, megatron.grads) == (2 * megatron.parameters, 4 * megatron.parameters)
    assert megatron.optimizer == int(12 / 8 * megatron.parameters)
    # TP=2 halves most weights; recompute keeps layer inputs only (the [T, V] logits remain).
    tp2_dp4 = ParallelConfig(tensor_model_parallel_size=2, data_parallel_size=4)
    tp2 = estimate_memory(cfg, TrainingPlan(parallel=tp2_dp4))
    assert tp2.parameters < 0.55 * portable.parameters
    assert portable.activations_recompute < portable.activations / 2
    assert 1.2e9 < portable.parameters < 1.3e9


def test_count_params_memory_cli(capsys):
    argv = ["--memory", "--scales", "1.2b", "--vocab-sizes", "200064", "--arms", "lev", "tied"]
    argv += ["--data-parallel-size", "8", "--micro-batch-size", "2", "--format", "csv"]
    assert param_table.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split(",") == list(param_table.MEMORY_COLUMNS)
    rows = [dict(zip(param_table.MEMORY_COLUMNS, line.split(","))) for line in lines[1:]]
    assert [r["arm"] for r in rows] == ["lev", "tied"]
    lev, tied = rows
    # LEV costs about 0.2% more parameters and FLOPs than TIED, and fits an 80 GB GPU.
    assert 0 < float(lev["gflop_per_token"]) / float(tied["gflop_per_token"]) - 1 < 0.01
    assert float(lev["total_recompute_gib"]) < float(lev["total_gib"]) < 80
    assert (
        param_table.main(["--memory", "--scales", "1.2b", "--tensor-model-parallel-size", "3"]) == 2
    )
    assert "not divisible by --tensor-model-parallel-size 3" in capsys.readouterr().err
    # The run's own spellings (issue 47): --no-bf16 and --ddp-impl, not --precision / --engine.
    fp32 = ["--memory", "--scales", "1.2b", "--vocab-sizes", "200064", "--arms", "tied"]
    assert param_table.main([*fp32, "--no-bf16", "--ddp-impl", "megatron", "--format", "csv"]) == 0
    (row,) = capsys.readouterr().out.strip().splitlines()[1:]
    assert " fp32 megatron" in row


def test_flops_per_token_agrees_with_the_training_log_formula():
    # The loop's MFU (metrics.flops_per_iteration) is this formula times the batch's tokens.
    from megatron_ext.training.metrics import flops_per_iteration

    cfg = ModelConfig(vocab_size=200064, seq_length=4096, **MODEL_SIZE_PRESETS["1.2b"])
    tied = cfg.replace(embedding=dict(embedding_type="tied"))
    assert flops_per_iteration(tied, 1) == flops_per_token(tied) * cfg.seq_length
    assert flops_per_iteration(cfg, 1) == flops_per_token(cfg) * cfg.seq_length
    assert flops_per_token(cfg) > flops_per_token(tied)  # LEV's generator adds its own FLOPs


def test_save_and_export_plans_of_the_1_2b_shape():
    # The shape benchmarks/scale_1p2b.py measures: 8 of 16 layers at TP=2, o200k padded for TP=2.
    from megatron_ext.models import count_parameters

    cfg = ModelConfig(
        vocab_size=200192, seq_length=512, embedding=dict(embedding_type="lev"),
        **{**MODEL_SIZE_PRESETS["1.2b"], "num_layers": 8},
    )  # fmt: skip
    layout = TrainingPlan(
        parallel=ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    )
    mem = estimate_memory(cfg, layout)
    assert estimate_save_memory(cfg, layout) == mem.total  # the step's, kept by the allocator
    weights = 4 * count_parameters(cfg).total
    table, qkv = 4 * 200019 * 2048, 4 * 2048 * 128 * (16 + 2 * 16)
    # float32: the table and the split QKV outweigh the reader's copy of the [V, D] head.
    assert estimate_export_memory(cfg, exported_vocab=200019) == weights + table + 8 * qkv
    assert table + 8 * qkv > 4 * 200192 * 2048
    # bfloat16: half the table, plus the bf16 cast of every other parameter.
    rest = count_parameters(cfg).total - count_parameters(cfg).input_embedding
    bf16 = estimate_export_memory(cfg, exported_vocab=200019, dtype_bytes=2)
    assert bf16 == weights + table // 2 + 8 * qkv + 2 * rest
    # TIED in float32: the exported table is the embedding weight itself, no copy.
    tied = cfg.replace(embedding=dict(embedding_type="tied"))
    tied_weights = 4 * count_parameters(tied).total
    assert estimate_export_memory(tied, exported_vocab=200019) == tied_weights + 4 * 200192 * 2048
