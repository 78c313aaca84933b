"""Parameter groups and dynamic loss scaling (training.optimizer)."""

from __future__ import annotations

import pytest
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


def _lev_model(**lev_kwargs):
    from megatron.core.transformer import TransformerConfig

    from megatron_ext.lev import LEVConfig, LEVEmbedding

    tc = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True
    )
    model = torch.nn.Module()
    model.embedding = LEVEmbedding(
        LEVConfig(vocab_size=50, hidden_size=8, seed_dim=4, num_knots=4, rank=2, **lev_kwargs),
        config=tc,
    )
    model.head = torch.nn.Linear(8, 50, bias=False)
    model.final_norm = torch.nn.LayerNorm(8)
    return model


def _names(model, group) -> set[str]:
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_lev_weight_decay_groups():
    model = _lev_model()
    decay, no_decay = param_groups(model)
    assert _names(model, decay) == {
        "embedding.codebooks",
        "embedding.seed_proj",
        "embedding.spline_delta",
        "embedding.out_proj",
        "head.weight",
    }
    model = _lev_model(weight_decay_groups=("seed_norm", "codebooks"))
    decay, no_decay = param_groups(model)
    assert _names(model, decay) == {
        "embedding.codebooks",
        "embedding.seed_norm_weight",
        "embedding.seed_norm_bias",
        "head.weight",
    }
    assert "embedding.out_proj" in _names(model, no_decay)


def test_lev_lr_multiplier_follows_the_schedule():
    from megatron_ext.config.arguments import OptimizerConfig
    from megatron_ext.training.optimizer import Optimizer, build_scheduler

    cfg = OptimizerConfig(
        lr=1e-3, min_lr=1e-4, lr_warmup_steps=4, lr_decay_steps=20,
        start_weight_decay=0.1, end_weight_decay=0.1,
    )  # fmt: skip
    model = _lev_model(lr_mult=0.25, weight_decay_groups=("out_proj",))
    optimizer = Optimizer(model, cfg)
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert set(groups) == {"decay", "no_decay", "decay_lev", "no_decay_lev"}
    assert _names(model, groups["decay_lev"]) == {"embedding.out_proj"}
    assert _names(model, groups["decay"]) == {"head.weight"}
    scheduler = build_scheduler(optimizer, cfg)
    for _ in range(25):
        scheduler.step(1)
        base = groups["decay"]["lr"]
        assert groups["no_decay"]["lr"] == base
        assert groups["decay_lev"]["lr"] == groups["no_decay_lev"]["lr"]
        assert groups["decay_lev"]["lr"] == pytest.approx(0.25 * base, rel=1e-12)
    assert base == pytest.approx(1e-4)  # decayed to --min-lr, LEV to 0.25 x --min-lr
    assert (
        groups["decay_lev"]["weight_decay"] == 0.1 and groups["no_decay_lev"]["weight_decay"] == 0
    )
    # Without a multiplier the groups are the two of Megatron's rule.
    plain = Optimizer(_lev_model(), cfg)
    assert [g["name"] for g in plain.param_groups] == ["decay", "no_decay"]
