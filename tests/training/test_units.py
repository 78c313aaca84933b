"""Single-process pieces of the loop: the data sampler, parameter groups, loss scaling, FLOPs
and the log line."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.training.data import PretrainingSampler
from megatron_ext.training.metrics import flops_per_iteration, format_train_line
from megatron_ext.training.optimizer import LossScaler, param_groups


def _global_batches(dp: int, mbs: int, gbs: int, consumed: int = 0, total: int = 64):
    """Sample indices of each global batch, gathered over the DP ranks' micro-batches."""
    per_rank = [list(PretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
    flat = [idx for step in zip(*per_rank) for batch in step for idx in batch]
    return [sorted(flat[i : i + gbs]) for i in range(0, len(flat) - gbs + 1, gbs)]


@pytest.mark.parametrize("dp,mbs", [(1, 2), (2, 2), (4, 1), (2, 4)])
def test_global_batch_is_the_same_at_every_dp_and_micro_batch_split(dp, mbs):
    assert _global_batches(dp, mbs, 8) == _global_batches(1, 8, 8)


def test_sampler_resumes_at_consumed_samples():
    full = _global_batches(2, 2, 8)
    assert _global_batches(2, 2, 8, consumed=24) == full[3:]
    assert len(PretrainingSampler(64, 24, 2, 0, 2)) == 10


def test_param_groups_exclude_norms_biases_and_1d():
    model = torch.nn.Module()
    model.linear = torch.nn.Linear(4, 4)
    model.norm = torch.nn.LayerNorm(4)
    model.seed_norm_weight = torch.nn.Parameter(torch.ones(2, 4))  # LEV's 2-D per-head norm
    decay, no_decay = param_groups(model)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert decay["wd_mult"] == 1.0 and no_decay["wd_mult"] == 0.0
    assert len(no_decay["params"]) == 4


def test_dynamic_loss_scale():
    scaler = LossScaler(initial_scale=1024.0, min_scale=256.0, window=3, hysteresis=2)
    scaler.update(True)
    assert scaler.scale == 1024.0  # hysteresis: the first overflow is forgiven
    scaler.update(True)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 1024.0
    for _ in range(6):
        scaler.update(True)
    assert scaler.scale == 256.0  # never below --min-loss-scale
    state = scaler.state_dict()
    other = LossScaler()
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert LossScaler(static_scale=8.0).scale == 8.0


def test_flops_match_six_n_d_for_short_sequences():
    """Without the attention term, training FLOPs are 6 x (GEMM parameters) x tokens."""
    h, ffn, v, layers, gbs, s = 256, 512, 1000, 3, 4, 1
    flops = flops_per_iteration(
        global_batch_size=gbs,
        seq_length=s,
        num_layers=layers,
        hidden_size=h,
        ffn_hidden_size=ffn,
        num_attention_heads=8,
        num_query_groups=8,
        vocab_size=v,
    )
    gemm_params = layers * (4 * h * h + 3 * h * ffn) + h * v
    attention = 3 * layers * 4 * s * h * gbs * s
    assert flops == 6 * gemm_params * gbs * s + attention


def test_log_line_has_megatron_fields():
    line = format_train_line(
        dict(
            iteration=10,
            train_iters=100,
            consumed_samples=80,
            iteration_ms=12.5,
            tflops=1.5,
            mfu=0.4,
            tokens_per_sec=2048.0,
            lr=3e-4,
            global_batch_size=8,
            loss=5.5,
            loss_scale=None,
            grad_norm=0.9,
            skipped=0,
            nonfinite=0,
        )
    )
    for text in (
        "iteration       10/     100",
        "consumed samples:           80",
        "elapsed time per iteration (ms): 12.5",
        "throughput per GPU (TFLOP/s/GPU): 1.5",
        "MFU: 40.0%",
        "learning rate: 3.000000E-04",
        "lm loss: 5.500000E+00",
        "grad norm: 0.900",
    ):
        assert text in line
