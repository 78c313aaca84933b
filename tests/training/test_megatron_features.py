"""Megatron-LM training features, piece by piece: decoupled learning rates, parameter-norm /
zero-gradient logging (against float64 references), recomputation on CPU, --kv-channels /
--rotary-percent, --async-save's atomicity (the batch-size ramp-up:
tests/training/test_batch_rampup.py; --grad-reduce-in-bf16: tests/training/test_data_parallel.py).
One set of two spawned gloo ranks runs the checks that need process groups."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ext.training.metrics import format_train_line
from megatron_ext.training.run_extras import memory_stats
from tests.support.distributed import run_distributed

pytestmark = pytest.mark.integration


def test_model_config_kv_channels_and_rotary_percent():
    from megatron_ext.config.model import ModelConfig

    base = dict(vocab_size=256, num_layers=1, hidden_size=64, num_attention_heads=4)
    assert ModelConfig(**base, head_dim=32).kv_channels == 32
    assert ModelConfig(**base).kv_channels == 16
    with pytest.raises(ValueError, match="--rotary-percent must be in"):
        ModelConfig(**base, rotary_percent=0.0)
    with pytest.raises(ValueError, match="even number of rotary channels"):
        ModelConfig(**base, head_dim=10, rotary_percent=0.5)


def test_memory_and_log_line():
    stats = memory_stats()
    assert all(v > 0 for v in stats.values()) and stats
    line = format_train_line(
        dict(iteration=5, train_iters=10, consumed_samples=40, consumed_tokens=1280,
             elapsed=3725.0, eta=61.0, iteration_ms=12.0, tokens_per_sec=1.0, lr=1e-3,
             global_batch_size=8, loss=2.0, skipped=0, nonfinite=0,
             extras={"params-norm": 12.5, "num-zeros": 3.0})
    )  # fmt: skip
    for field in ("elapsed: 1:02:05", "ETA: 0:01:01", "consumed tokens:           1280",
                  "params norm: 12.500", "num zeros: 3"):  # fmt: skip
        assert field in line, line


# ---------------------------------------------------------------- two gloo ranks (DP=2)


def _tiny(**changes):
    from megatron_ext.config.model import EmbeddingConfig, ModelConfig

    lev = dict(seed_dim=16, rank=4, num_heads=2, num_knots=5)
    config = dict(
        vocab_size=128, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
        embedding=EmbeddingConfig(embedding_type="lev", lev=lev),
    )  # fmt: skip
    config.update(changes)
    return ModelConfig(**config)


def _loss_and_grads(model, tokens):
    model.zero_grad()
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    losses = model(tokens, positions, None, labels=tokens.roll(-1, 1))
    losses.float().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_decoupled_lr_and_norms():
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.config.run import OptimizerConfig
    from megatron_ext.models import build_model
    from megatron_ext.parallel import ProcessGroups
    from megatron_ext.training.optimizer import Optimizer, build_scheduler
    from megatron_ext.training.unique_params import num_zeros_in_grad, params_norm

    torch.manual_seed(0)
    model = build_model(_tiny(), parallel=ParallelConfig(), precision=PrecisionConfig())
    cfg = OptimizerConfig(
        lr=1.5e-4, min_lr=1e-5, lr_decay_style="cosine", lr_warmup_steps=40, lr_decay_steps=400,
        start_weight_decay=0.1, end_weight_decay=0.1, wd_incr_steps=400,
    )  # fmt: skip
    optimizer = Optimizer(model, cfg, zero_group=None, decoupled=(5e-4, 4.5e-5))
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        decoupled = group["name"].startswith("decoupled")
        for param in group["params"]:
            name = names[id(param)]
            assert decoupled == name.startswith(("embedding.", "output_layer.")), name
    lev = [n for n in names.values() if "spline_delta" in n]
    assert lev, "the LEV generator is part of the model"
    scheduler = build_scheduler(optimizer, cfg)

    def lrs():
        return {g["name"]: g["lr"] for g in optimizer.param_groups}

    scheduler.step(20)  # half-way through the warm-up
    assert math.isclose(lrs()["decoupled_decay"], 5e-4 / 2, rel_tol=1e-12)
    assert math.isclose(lrs()["decay"], 1.5e-4 / 2, rel_tol=1e-12)
    scheduler.step(200)  # cosine decay at (220 - 40) / 360 = 1/2
    coeff = 0.5 * (math.cos(math.pi * 0.5) + 1.0)
    assert math.isclose(lrs()["decoupled_no_decay"], 4.5e-5 + coeff * (5e-4 - 4.5e-5))
    assert math.isclose(lrs()["no_decay"], 1e-5 + coeff * (1.5e-4 - 1e-5))
    scheduler.step(1000)
    assert math.isclose(lrs()["decoupled_decay"], 4.5e-5) and math.isclose(lrs()["decay"], 1e-5)

    params = list(model.parameters())
    pg = ProcessGroups.from_megatron()
    reference = math.sqrt(sum(float(p.detach().double().square().sum()) for p in params))
    assert math.isclose(params_norm(params, pg), reference, rel_tol=1e-12)
    for i, p in enumerate(params):
        p.grad = torch.ones_like(p)
        p.grad.view(-1)[: i + 1] = 0.0
    assert num_zeros_in_grad(params, pg) == sum(min(i + 1, p.numel()) for i, p in enumerate(params))


def _check_recompute_on_cpu():
    """Recomputation gives the gradients of the plain backward, with dropout (0.1) drawing the
    same masks again: the streams are reseeded before each model's step."""
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.models import build_model
    from megatron_ext.models.local_modules import SDPACoreAttention
    from megatron_ext.parallel import set_random_seed
    from megatron_ext.rng import device_rng

    dropout = dict(hidden_dropout=0.1, attention_dropout=0.1)

    def loss_and_grads(model, tokens):
        set_random_seed(5)
        with device_rng():
            return _loss_and_grads(model, tokens)

    torch.manual_seed(1)
    reference = build_model(
        _tiny(**dropout), parallel=ParallelConfig(), precision=PrecisionConfig()
    )
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    expected = loss_and_grads(reference, tokens)
    variants = [
        dict(recompute_granularity="selective"),
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    ]
    for variant in variants:
        model = build_model(
            _tiny(**variant, **dropout), parallel=ParallelConfig(), precision=PrecisionConfig()
        )
        model.load_state_dict(reference.state_dict())
        calls = {"attention": 0}
        for module in model.modules():
            if isinstance(module, SDPACoreAttention):
                inner = module._attend

                def counted(*args, _inner=inner, **kw):
                    calls["attention"] += 1
                    return _inner(*args, **kw)

                module._attend = counted
        grads = loss_and_grads(model, tokens)
        assert grads.keys() == expected.keys()
        for name in grads:
            assert torch.equal(grads[name], expected[name]), (variant, name)
        # Forward once per layer, plus the recomputation in backward.
        recomputed = {"selective": 2, "uniform": 2, "block": 1}[
            variant.get("recompute_method", "selective")
        ]
        assert calls["attention"] == 2 + recomputed, (variant, calls)


def _check_kv_channels_and_rotary_percent():
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.models import build_model

    model = build_model(
        _tiny(head_dim=16, rotary_percent=0.5),
        parallel=ParallelConfig(),
        precision=PrecisionConfig(),
    )
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.shape == ((4 + 2 * 4) * 16, 32)  # heads + K and V of 4 groups, 16 channels each
    assert model.rotary_pos_emb(16).shape[-1] == 8  # half of the 16 channels rotate
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    grads = _loss_and_grads(model, tokens)
    assert all(torch.isfinite(g).all() for g in grads.values())


def _check_async_save(root: str):
    import torch.distributed as dist

    from megatron_ext.checkpoint.format import (
        TrainState,
        load_checkpoint,
        read_latest_iteration,
        save_checkpoint,
    )
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.models import build_model
    from megatron_ext.parallel import ProcessGroups

    pg = ProcessGroups.from_megatron()
    torch.manual_seed(5)
    model = build_model(_tiny(), parallel=ParallelConfig(), precision=PrecisionConfig())
    at_save = [p.detach().clone() for p in model.parameters()]
    pending = save_checkpoint(root, TrainState(iteration=5), model, pg=pg, async_save=True)
    with torch.no_grad():  # training goes on while the staged copy is written
        for p in model.parameters():
            p.add_(1.0)
    # The latest marker moves only when the checkpoint is finished (every rank's write done).
    assert read_latest_iteration(root) is None
    dist.barrier()
    assert pending.wait().endswith("iter_0000005")
    assert read_latest_iteration(root) == 5
    restored = build_model(_tiny(), parallel=ParallelConfig(), precision=PrecisionConfig())
    assert load_checkpoint(root, restored, pg=pg, load_rng=False).iteration == 5
    for expected, q in zip(at_save, restored.parameters()):
        assert torch.equal(expected, q)  # the values at save time, not the later ones


def _checks(tmp: str):
    _check_decoupled_lr_and_norms()
    _check_recompute_on_cpu()
    _check_kv_channels_and_rotary_percent()
    _check_async_save(tmp)
    return True


def test_features_on_two_gloo_ranks(tmp_path):
    assert run_distributed(_checks, world_size=2, args=(str(tmp_path / "ckpt"),)) == [True, True]
