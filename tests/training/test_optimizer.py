"""Parameter groups and dynamic loss scaling (training.optimizer)."""

from __future__ import annotations

import torch

from megatron_ext.training.optimizer import LossScaler, param_groups


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
