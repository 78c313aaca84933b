"""score_batches (the compute path of tools/evaluate.py perplexity) checks a LEV model's eval
table once per pass, not once per batch, and still gives the per-token losses of a plain
forward of each batch (float64 model; the scorer rounds each token's loss to float32)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.distributed import run_distributed

pytestmark = pytest.mark.integration


def _checks() -> dict:
    import torch

    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.config.model import ModelConfig
    from megatron_ext.evaluation.perplexity import LossTotals, pack_stream
    from megatron_ext.evaluation.scoring import ModelScorer, score_batches
    from megatron_ext.inference.loading import init_inference_parallel
    from megatron_ext.lev.layer import LEVEmbedding
    from megatron_ext.models import build_model

    pg = init_inference_parallel(1, 1)
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=160, num_layers=2, hidden_size=32, num_attention_heads=4,
        ffn_hidden_size=64, seq_length=16,
        embedding=dict(embedding_type="lev", lev=dict(seed_dim=8, rank=4, num_heads=2,
                                                      num_knots=5, eval_table=True)),
    )  # fmt: skip
    model = build_model(
        config,
        parallel=ParallelConfig(),
        precision=PrecisionConfig(params_dtype=torch.float64),
        pg=pg,
    ).eval()
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 160, size=n) for n in (20, 7, 33, 12, 25)]
    batches = list(pack_stream(documents, 16, 2))
    checks = {"n": 0}
    original = LEVEmbedding._table_fresh

    def counting(self, *args, **kwargs):
        checks["n"] += 1
        return original(self, *args, **kwargs)

    LEVEmbedding._table_fresh = counting
    try:
        scorer = ModelScorer(model, 32, 160, pg)
        totals = LossTotals()
        score_batches(scorer, batches, [totals], show_progress=False)
    finally:
        LEVEmbedding._table_fresh = original
    reference, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            losses = model(batch.tokens, batch.position_ids, None, labels=batch.labels)
            mask = batch.loss_mask > 0
            reference += float(losses[mask].sum())
            count += int(mask.sum())
    return {
        "checks": checks["n"], "batches": len(batches), "loss": totals.loss,
        "reference": reference / count, "tokens": totals.tokens, "count": count,
    }  # fmt: skip


def test_one_table_check_per_pass_and_same_losses():
    result = run_distributed(_checks, 1)[0]
    assert result["batches"] >= 3
    assert result["checks"] <= 1  # once on entry at most (none before the table exists)
    assert result["tokens"] == result["count"]
    # token_losses hands float32 losses on (the float64 forward rounded once per token).
    assert abs(result["loss"] - result["reference"]) <= 1e-6 * abs(result["reference"])
