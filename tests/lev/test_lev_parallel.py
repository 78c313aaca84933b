"""TP=2 (with and without sequence parallelism) equals TP=1: init, outputs, every gradient.

All multi-process checks run in ONE run_distributed call (one set of gloo ranks). Each
rank builds a TP=1 reference on a single-rank group beside the TP=2 modules, so the comparison
needs no files. The rank function lives in this file and is reached through `call_in_file`,
which works whatever pytest's import mode. Everything runs in float64: the layouts sum the
same terms in different orders, so float32 would compare rounding, not the code.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.distributed import call_in_file, run_distributed

pytestmark = pytest.mark.integration

VOCAB, HIDDEN, BATCH, SEQ, HEADS = 300, 8, 2, 16, 4


def _transformer_config(tp: int, sp: bool = False):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        use_cpu_initialization=True,
        params_dtype=torch.float64,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
    )


def _close(a, b, what, tol=1e-12):
    assert a.dtype == torch.float64, what
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _check_tp2(seed: int):
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_ext.lev import LEV_PARAMETER_NAMES, LEVConfig, LEVEmbedding
    from megatron_ext.parallel import ProcessGroups

    pg = ProcessGroups.from_megatron()
    rank, tp_group = pg.tp_rank, pg.tp
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    local = slice(rank * HEADS // 2, (rank + 1) * HEADS // 2)
    report = {}
    variants = {
        "sum+dedup": dict(dedup=True),
        # --lev-init-output-std rescales out_proj identically at every TP size.
        "concat+nodedup+out-std": dict(codebook_combine="concat", init_output_std=0.05),
    }
    for variant, extra in variants.items():
        cfg = LEVConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            seed_dim=4,
            num_knots=5,
            rank=3,
            num_heads=HEADS,
            **{"dedup": False, **extra},
        )
        torch.manual_seed(seed)
        ref = LEVEmbedding(cfg, config=_transformer_config(1), tp_group=singles[dist.get_rank()])
        torch.manual_seed(seed)
        tp = LEVEmbedding(cfg, config=_transformer_config(2), tp_group=tp_group)
        torch.manual_seed(seed)
        sp = LEVEmbedding(
            cfg,
            config=_transformer_config(2, sp=True),
            tp_group=tp_group,
            reduce_scatter_embeddings=True,
        )
        assert ref.tp_size == 1 and tp.tp_size == 2 and tp.num_local_heads == HEADS // 2

        # Same seed -> TP=2 holds exactly the TP=1 parameters, split by heads.
        for name in LEV_PARAMETER_NAMES:
            full = getattr(ref, name)
            for module in (tp, sp):
                shard = getattr(module, name)
                expected = full if name == "codebooks" else full[local]
                assert torch.equal(shard, expected), f"{variant}: init of {name} differs"

        # Make every parameter non-trivial (same values everywhere), then compare forward and
        # backward. ids and the loss weights are identical on every rank.
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            ref.spline_delta.copy_(0.5 * torch.randn(ref.spline_delta.shape, generator=gen))
            ref.seed_norm_weight.add_(0.3 * torch.randn(ref.seed_norm_weight.shape, generator=gen))
            ref.seed_norm_bias.add_(0.3 * torch.randn(ref.seed_norm_bias.shape, generator=gen))
            for module in (tp, sp):
                for name in LEV_PARAMETER_NAMES:
                    full = getattr(ref, name)
                    getattr(module, name).copy_(full if name == "codebooks" else full[local])
        ids = torch.randint(0, 20, (BATCH, SEQ), generator=gen)  # repeats: dedup matters
        ids[0, 0], ids[1, -1] = 0, VOCAB - 1
        # At most 21 distinct ids = k*b codebook rows: the seeds are projected per id with
        # dedup; without it the 32 ids are more than 21 and projected by digit (lev.kernels).
        distinct = len(ids.unique()) if cfg.dedup else ids.numel()
        assert (distinct > cfg.num_digits * cfg.base) == (not cfg.dedup), variant
        weight = torch.randn(BATCH, SEQ, HIDDEN, generator=gen, dtype=torch.float64)

        out_ref = ref(ids)
        (out_ref * weight).sum().backward()
        out_tp = tp(ids)
        assert out_tp.shape == (BATCH, SEQ, HIDDEN)
        (out_tp * weight).sum().backward()
        out_sp = sp(ids)
        chunk = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
        assert out_sp.shape == (SEQ // 2, BATCH, HIDDEN)
        # Each rank's loss covers its sequence shard; the reduce-scatter's backward gathers.
        (out_sp * weight.transpose(0, 1)[chunk]).sum().backward()

        _close(out_tp, out_ref, f"{variant} TP=2 output")
        _close(out_sp, out_ref.transpose(0, 1)[chunk], f"{variant} TP=2+SP output")
        for name in LEV_PARAMETER_NAMES:
            full_grad = getattr(ref, name).grad
            expected = full_grad if name == "codebooks" else full_grad[local]
            _close(getattr(tp, name).grad, expected, f"{variant} TP=2 grad of {name}")
            _close(getattr(sp, name).grad, expected, f"{variant} TP=2+SP grad of {name}")

        if cfg.dedup:
            # Global-batch dedup (the portable engine's iteration) over two micro-batches under
            # TP and SP: LEV's one backward gives the TP=1 per-micro-batch gradients.
            # The second micro-batch repeats some ids and brings new ones, the third none.
            micro_batches = (ids, torch.randint(10, 40, (BATCH, SEQ), generator=gen), ids)
            outputs = {}
            for module in (ref, tp, sp):
                module.zero_grad()
                if module is not ref:
                    module.begin_global_batch()
                for micro_batch in micro_batches:
                    out = module(micro_batch)
                    if module is sp:
                        (out * weight.transpose(0, 1)[chunk]).sum().backward()
                        out = out.transpose(0, 1)
                    else:
                        (out * weight).sum().backward()
                    outputs.setdefault(module, []).append(out.detach())
                if module is not ref:
                    module.end_global_batch()
            for k, expected in enumerate(outputs[ref]):
                _close(outputs[tp][k], expected, f"{variant} TP=2 global-batch output {k}")
                _close(outputs[sp][k], expected[:, chunk], f"{variant} SP global-batch output {k}")
            for name in LEV_PARAMETER_NAMES:
                full_grad = getattr(ref, name).grad
                expected = full_grad if name == "codebooks" else full_grad[local]
                for module, what in ((tp, "TP=2"), (sp, "TP=2+SP")):
                    got = getattr(module, name).grad
                    _close(got, expected, f"{variant} {what} global-batch grad of {name}")

        # Eval table under TP: this rank's partial table, reduced like the training path.
        for module in (tp, sp):
            module.lev_config = dataclasses.replace(cfg, eval_table=True)
            module.eval()
            with torch.no_grad():
                out = module(ids)
            assert module._table is not None
            expected = out_tp if module is tp else out_sp
            _close(out, expected.detach(), f"{variant} eval table")
        report[variant] = out_tp.detach().sum().item()

    # Distributed-checkpoint view of the TP=2 module.
    sharded = tp.sharded_state_dict(
        prefix="embedding.word_embeddings.", metadata={"dp_cp_group": pg.dp_cp}
    )
    assert sorted(sharded) == sorted(f"embedding.word_embeddings.{n}" for n in LEV_PARAMETER_NAMES)
    for name in LEV_PARAMETER_NAMES:
        st = sharded[f"embedding.word_embeddings.{name}"]
        assert isinstance(st, ShardedTensor)
        param = getattr(tp, name)
        assert st.data is param
        if name == "codebooks":
            assert st.global_shape == tuple(param.shape) and st.global_offset == (0, 0, 0)
            assert st.replica_id[1] == rank  # replicated across TP: only rank 0 is the main copy
        else:
            assert st.global_shape[0] == HEADS and st.global_shape[1:] == tuple(param.shape[1:])
            assert st.global_offset[0] == rank * HEADS // 2
            assert st.replica_id[1] == 0
    report["partition_dims"] = tp.tp_partition_dims()
    return report


def test_tp2_equals_tp1_with_and_without_sequence_parallel():
    reports = run_distributed(call_in_file, 2, tp=2, args=(__file__, "_check_tp2", 1234))
    assert reports[0] == reports[1]
    assert reports[0]["partition_dims"]["codebooks"] is None
    assert reports[0]["partition_dims"]["out_proj"] == 0
