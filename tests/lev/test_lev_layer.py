"""LEVEmbedding on one process: contract, errors, dedup, eval table, saved memory.

Paths that must compute the same numbers (dedup or not, eval table or per token) are compared
in float64 at 1e-12: in float32 their different summation orders differ by CPU (one machine
gave 1.9e-6 where 1e-6 was allowed), which says nothing about the code.
"""

import dataclasses

import pytest
import torch

from megatron_ext.lev import LEV_PARAMETER_NAMES, LEV_TP_PARTITION_DIMS, LEVEmbedding
from tests.support.memory import saved_tensor_bytes

F64 = torch.float64
EXACT = dict(rtol=1e-12, atol=1e-12)  # float64 comparisons of the same math


def test_parameters_names_shapes_order_and_tp_attributes(lev):
    cfg = lev.tiny_config()
    module = lev.make_lev(cfg)
    names = [n for n, _ in module.named_parameters()]
    assert (
        names
        == list(LEV_PARAMETER_NAMES)
        == [
            "codebooks",
            "seed_proj",
            "seed_norm_weight",
            "seed_norm_bias",
            "spline_delta",
            "out_proj",
        ]
    )
    k, b, d, kappa, r, h, D = 3, cfg.base, 4, 5, 3, 2, 6
    assert {n: tuple(p.shape) for n, p in module.named_parameters()} == {
        "codebooks": (k, b, d),
        "seed_proj": (h, d, d),
        "seed_norm_weight": (h, d),
        "seed_norm_bias": (h, d),
        "spline_delta": (h, d, kappa, r),
        "out_proj": (h, r, D),
    }
    for name, p in module.named_parameters():
        if name == "codebooks":
            assert p.tensor_model_parallel is False
        else:
            assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (True, 0, 1)
    assert module.tp_partition_dims() == LEV_TP_PARTITION_DIMS
    assert "table" not in str(module.state_dict().keys())


def test_initialisation_follows_the_spec(lev):
    cfg = lev.tiny_config(vocab_size=5000, hidden_size=256, seed_dim=32, rank=16, num_heads=4)
    torch.manual_seed(0)
    module = LEVEmbedding(cfg, config=lev.transformer_config(256))
    assert module.codebooks.std().item() == pytest.approx(0.02, rel=0.1)
    assert module.seed_proj.std().item() == pytest.approx(0.02, rel=0.1)
    assert module.spline_delta.std().item() == pytest.approx(0.1, rel=0.1)
    assert module.out_proj.std().item() == pytest.approx(0.02 / 2, rel=0.1)
    assert torch.equal(module.seed_norm_weight, torch.ones(4, 32))
    assert torch.equal(module.seed_norm_bias, torch.zeros(4, 32))
    # Same seed, same parameters.
    torch.manual_seed(0)
    again = LEVEmbedding(cfg, config=lev.transformer_config(256))
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), again.parameters()))


def test_params_dtype_and_perform_initialization(lev):
    cfg = lev.tiny_config()
    module = LEVEmbedding(cfg, config=lev.transformer_config(6, dtype=torch.bfloat16))
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    out = module(torch.tensor([[1, 2, 3]]))
    assert out.dtype == torch.bfloat16 and out.shape == (1, 3, 6)
    tc = lev.transformer_config(6)
    tc.perform_initialization = False
    state = torch.get_rng_state()
    LEVEmbedding(cfg, config=tc)
    assert torch.equal(state, torch.get_rng_state())  # nothing drawn


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("bad", [-1, 50, 10**6])
def test_out_of_range_ids_raise_clearly(lev, dedup, bad):
    module = lev.make_lev(lev.tiny_config(dedup=dedup))
    ids = torch.tensor([[3, 4], [bad, 0]])
    with pytest.raises(ValueError, match=rf"token id {bad}, outside the valid range \[0, 50\)"):
        module(ids)


def test_bad_input_shapes_and_types(lev):
    module = lev.make_lev(lev.tiny_config())
    with pytest.raises(ValueError, match=r"\[b, s\]"):
        module(torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="integer"):
        module(torch.tensor([[1.0, 2.0]]))


def test_dedup_equals_no_dedup(lev):
    cfg = lev.tiny_config(vocab_size=300, hidden_size=16, seed_dim=8, rank=4, num_heads=2)
    module = lev.make_lev(cfg, dtype=F64, spread=0.3)
    ids = torch.randint(0, 40, (4, 25))  # many repeats
    weight = torch.randn(4, 25, 16, dtype=F64)
    results = []
    for dedup in (True, False):
        module.lev_config = dataclasses.replace(cfg, dedup=dedup)
        module.zero_grad()
        out = module(ids)
        (out * weight).sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in module.parameters()]))
    (out_a, grads_a), (out_b, grads_b) = results
    assert out_a.dtype == F64
    torch.testing.assert_close(out_a, out_b, **EXACT)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, **EXACT)


def test_global_batch_dedup_equals_per_micro_batch(lev, monkeypatch):
    # begin/end_global_batch (the portable engine's iteration): three micro-batches evaluate
    # LEV once per distinct id of all three and run one backward, for all of those ids at
    # once; the outputs are the same numbers and the gradients the same sums as per-micro-batch
    # evaluation.
    cfg = lev.tiny_config(vocab_size=300, hidden_size=16, seed_dim=8, rank=4, num_heads=2)
    module = lev.make_lev(cfg, dtype=F64, spread=0.3)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 60, (2, 20), generator=gen) for _ in range(3)]
    weights = [torch.randn(2, 20, 16, generator=gen, dtype=F64) for _ in batches]
    evaluated = []  # the ids of each LEV evaluation
    deferred = []  # the ids of each graph built from modes computed before (the backward)
    modes_of = module._modes

    def counting(ids, modes=None):
        (evaluated if modes is None else deferred).append(ids)
        return modes_of(ids, modes)

    monkeypatch.setattr(module, "_modes", counting)

    def iteration(global_batch: bool):
        module.zero_grad()
        evaluated.clear()
        deferred.clear()
        if global_batch:
            module.begin_global_batch()
        outputs = []
        for ids, weight in zip(batches, weights):
            out = module(ids)
            (out * weight).sum().backward()
            outputs.append(out.detach())
        if global_batch:
            assert all(p.grad is None for p in module.parameters())  # LEV's backward waits
            module.end_global_batch()
        return outputs, [p.grad.clone() for p in module.parameters()], list(evaluated)

    outs, grads, per_micro_batch = iteration(False)
    assert deferred == []
    outs_g, grads_g, per_global_batch = iteration(True)
    assert len(deferred) == 1 and torch.equal(deferred[0], torch.cat(per_global_batch))
    assert sum(len(ids) for ids in per_micro_batch) == sum(len(b.unique()) for b in batches)
    seen = torch.cat(per_global_batch)
    assert (
        len(seen)
        == len(seen.unique())
        == len(torch.cat(batches).unique())
        < len(torch.cat(per_micro_batch))
    )
    for a, b in zip(outs, outs_g):
        torch.testing.assert_close(a, b, **EXACT)
    for ga, gb in zip(grads, grads_g):
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)
    # Back to per-micro-batch evaluation after end_global_batch, and after an abort.
    module.begin_global_batch()
    module(batches[0])
    module.abort_global_batch()
    evaluated.clear()
    module(batches[0]).sum().backward()
    assert len(evaluated) == 1 and module._global_batch is None


def test_global_batch_rows_that_get_no_gradient_add_nothing(lev):
    # A micro-batch whose output takes no part in the loss leaves its new rows without a
    # gradient: the one backward counts them as zeros.
    cfg = lev.tiny_config(vocab_size=300, hidden_size=16, seed_dim=8, rank=4, num_heads=2)
    module = lev.make_lev(cfg, dtype=F64, spread=0.3)
    first, second = torch.arange(0, 40).view(2, 20), torch.arange(30, 70).view(2, 20)
    weight = torch.randn(2, 20, 16, dtype=F64)
    (module(first) * weight).sum().backward()
    expected = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    module.begin_global_batch()
    (module(first) * weight).sum().backward()
    module(second)  # ids 40-69 are new rows; nothing flows back into them
    module.end_global_batch()
    for name, p, g in zip(LEV_PARAMETER_NAMES, module.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14, msg=name)


def test_global_batch_dedup_is_off_without_dedup_or_grad(lev):
    cfg = lev.tiny_config(vocab_size=300, hidden_size=16, seed_dim=8, rank=4, num_heads=2)
    for flags in (dict(dedup=False), dict(dedup_global_batch=False)):
        module = lev.make_lev(dataclasses.replace(cfg, **flags), dtype=F64)
        assert not module.defers_gradients
        module.begin_global_batch()
        assert module._global_batch is None
    module = lev.make_lev(cfg, dtype=F64)
    module.begin_global_batch()
    ids = torch.randint(0, 60, (2, 20))
    with torch.no_grad():  # evaluation inside a training step: computed directly, not kept
        out = module(ids)
    assert module._global_batch.count == 0
    torch.testing.assert_close(out, module(ids).detach(), **EXACT)
    module.end_global_batch()


def test_reduce_scatter_layout_on_one_rank(lev):
    cfg = lev.tiny_config()
    plain = lev.make_lev(cfg, dtype=F64)
    scattered = lev.make_lev(cfg, dtype=F64, reduce_scatter_embeddings=True)
    ids = torch.randint(0, 50, (3, 8))
    out = scattered(ids)
    assert out.shape == (8, 3, 6) and out.is_contiguous()
    torch.testing.assert_close(out, plain(ids).transpose(0, 1), **EXACT)


def _per_token(module, ids):
    """Embeddings evaluated without the table (train-mode path), for comparison."""
    with torch.no_grad():
        return module.partial_embeddings(ids.reshape(-1)).view(*ids.shape, -1)


def test_eval_table_matches_and_refreshes_after_optimizer_step(lev):
    cfg = lev.tiny_config(vocab_size=200, eval_table=True)
    module = lev.make_lev(cfg, dtype=F64, spread=0.3)
    ids = torch.randint(0, 200, (3, 10))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)

    module.eval()
    with torch.no_grad():
        out = module(ids)
    table = module._table
    assert table is not None and table.shape == (200, 6)
    torch.testing.assert_close(out, _per_token(module, ids), **EXACT)
    torch.testing.assert_close(table, _per_token(module, torch.arange(200)), **EXACT)
    with torch.no_grad():
        module(ids)
    assert module._table is table  # parameters unchanged: reused

    module.train()
    assert module._table is None
    module(ids).square().sum().backward()
    opt.step()
    module.eval()
    with torch.no_grad():
        out2 = module(ids)
    assert not torch.allclose(out2, out)
    torch.testing.assert_close(out2, _per_token(module, ids), **EXACT)

    # A step taken while the table exists (no train() call in between) is seen too.
    module.train()
    module.zero_grad()
    module(ids).square().sum().backward()
    module.eval()
    with torch.no_grad():
        module(ids)
    stale = module._table
    opt.step()
    with torch.no_grad():
        out3 = module(ids)
    assert module._table is not stale
    torch.testing.assert_close(out3, _per_token(module, ids), **EXACT)


def test_eval_table_sees_load_state_dict_and_data_writes(lev):
    cfg = lev.tiny_config(eval_table=True)
    module = lev.make_lev(cfg, dtype=F64, spread=0.3).eval()
    other = lev.make_lev(cfg, dtype=F64, seed=1, spread=0.3)
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        module(ids)
        module.load_state_dict(other.state_dict())
        torch.testing.assert_close(module(ids), _per_token(other, ids), **EXACT)
        module.out_proj.data.mul_(2.0)  # .data bypasses the version counter
        torch.testing.assert_close(module(ids), _per_token(module, ids), **EXACT)


def test_pinned_eval_table_checks_once(lev, monkeypatch):
    cfg = lev.tiny_config(eval_table=True)
    module = lev.make_lev(cfg, dtype=F64, spread=0.3).eval()
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        module(ids)
        module.out_proj.data.mul_(2.0)  # the table is stale on entry: dropped there
        with module.pinned_eval_table():
            out = module(ids)
            table = module._table
            monkeypatch.setattr(module, "_table_fresh", lambda dtype: pytest.fail("checked"))
            assert torch.equal(module(ids), out) and module._table is table
        monkeypatch.undo()
        torch.testing.assert_close(out, _per_token(module, ids), **EXACT)
        assert not module._table_pinned


def test_eval_table_not_used_when_gradients_are_needed(lev):
    module = lev.make_lev(lev.tiny_config(eval_table=True)).eval()
    out = module(torch.tensor([[1, 2]]))
    assert module._table is None
    out.sum().backward()
    assert module.out_proj.grad is not None


def test_fused_path_saves_little(lev):
    cfg = lev.tiny_config(
        vocab_size=4096,
        hidden_size=64,
        seed_dim=32,
        num_knots=8,
        rank=16,
        num_heads=4,
        dedup=False,
    )
    module = lev.make_lev(cfg, spread=0.1)
    ids = torch.randint(0, 4096, (4, 64))
    n = ids.numel()
    sizes = {}
    for fused in (True, False):
        module.lev_config = dataclasses.replace(cfg, kernel="auto" if fused else "reference")
        sizes[fused], out = saved_tensor_bytes(lambda: module(ids), exclude=module.parameters())
        out.sum().backward()
    # Seeds [N, d] + modes [N, h*r] in float32, plus the int64 ids, digits and gather index.
    bound = 4 * n * (32 + 4 * 16) + 8 * n * (3 + 2)
    assert sizes[True] <= bound, sizes
    # The naive path keeps at least phi [h, N, d, r] and the basis [h, N, d, kappa].
    assert sizes[False] >= 4 * 4 * n * 32 * (16 + 8)


@pytest.mark.parametrize("target", [0.02, 0.5])
def test_init_output_std_rescales_out_proj_to_the_measured_std(lev, target):
    """The std of the whole [V, D] table, measured by running the module on every id, is the
    requested value; every other parameter is the spec's init of the same seed."""
    kw = dict(vocab_size=300, hidden_size=16, seed_dim=8, num_knots=6, rank=4, num_heads=2)
    tc = lev.transformer_config(16)
    torch.manual_seed(3)
    spec = LEVEmbedding(lev.tiny_config(**kw), config=tc)
    torch.manual_seed(3)
    scaled = LEVEmbedding(lev.tiny_config(**kw, init_output_std=target), config=tc)
    with torch.no_grad():
        table = scaled(torch.arange(300).view(1, -1))[0].double()
    assert table.std().item() == pytest.approx(target, rel=1e-5)
    for name in LEV_PARAMETER_NAMES[:-1]:
        assert torch.equal(getattr(spec, name), getattr(scaled, name)), name
    ratio = scaled.out_proj / spec.out_proj
    assert torch.allclose(ratio, ratio.flatten()[0].expand_as(ratio), rtol=1e-5)


def test_init_output_std_with_a_large_vocabulary_measures_a_sample(lev):
    """Above 8192 ids the std is measured on 8192 evenly spaced ids: the full table's std is
    then within a few percent of the request."""
    from megatron_ext.lev.layer import std_probe_ids

    assert std_probe_ids(300).tolist() == list(range(300))
    probe = std_probe_ids(20_000)
    assert len(probe) == len(set(probe.tolist())) == 8192 and probe.max() == 19_999
    cfg = lev.tiny_config(
        vocab_size=20_000, hidden_size=8, seed_dim=8, num_knots=6, rank=4, init_output_std=0.03
    )
    torch.manual_seed(0)
    module = LEVEmbedding(cfg, config=lev.transformer_config(8))
    with torch.no_grad():
        table = module(torch.arange(20_000).view(1, -1))[0].double()
    assert table.std().item() == pytest.approx(0.03, rel=0.03)


def test_without_a_group_it_is_whole_and_says_so(lev):
    """tp_group=None means no tensor parallelism (nothing is read from megatron's globals): a
    TP>1 config without its group, and a checkpoint view without its DP x CP group, are refused."""
    cfg = lev.tiny_config()
    module = LEVEmbedding(cfg, config=lev.transformer_config(6))
    assert module.tp_group is None and (module.tp_size, module.tp_rank) == (1, 0)
    assert module.num_local_heads == cfg.num_heads
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 but the TP group has 1"):
        LEVEmbedding(cfg, config=lev.transformer_config(6, tp=2))
    with pytest.raises(ValueError, match="dp_cp_group"):
        module.sharded_state_dict(prefix="embedding.word_embeddings.")
