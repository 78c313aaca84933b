"""ModelScorer.token_losses applies the output layer itself, a chunk of tokens at a time
(`HEAD_CHUNK`), instead of building the whole logits and megatron's cross entropy: the
per-token losses equal a float64 log-softmax over the full (padded) logits at TP=1, and
megatron's own vocab-parallel cross entropy at TP=2, for the tied and the untied head."""

from __future__ import annotations

import pytest

from megatron_ext.testing.distributed import run_distributed

pytestmark = pytest.mark.integration


def _losses(tp: int) -> dict:
    import torch

    import megatron_ext.evaluation.scoring as scoring
    from megatron_ext.inference.loading import init_inference_parallel
    from megatron_ext.models import ModelConfig, build_model

    pg = init_inference_parallel(tp, 1)
    scoring.HEAD_CHUNK = 7  # several chunks and a ragged last one in a 2 x 16 batch
    out = {}
    for arm in ("tied", "untied"):
        torch.manual_seed(0)
        config = ModelConfig(
            vocab_size=160, num_layers=2, hidden_size=32, num_attention_heads=4,
            ffn_hidden_size=64, seq_length=16, params_dtype=torch.float64,
            tensor_model_parallel_size=tp, embedding=dict(embedding_type=arm),
        )  # fmt: skip
        model = build_model(config, pg=pg).eval()
        head = model.output_layer
        scorer = scoring.ModelScorer(model, 32, 150, pg)
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 150, (2, 16), generator=generator)
        labels = torch.randint(0, 150, (2, 16), generator=generator)
        fused = scorer.token_losses(tokens, labels)
        assert model.output_layer is head  # put back after the pass
        with torch.inference_mode():
            positions = torch.arange(16).expand(2, 16)
            megatron = model(tokens, positions, None, labels=labels).float()
            reference = None
            if tp == 1:  # float64 log-softmax over the whole padded vocabulary, token by token
                logits = model(tokens, positions, None).double()  # [b, s, V]
                reference = torch.empty(2, 16, dtype=torch.float64)
                for i in range(2):
                    for j in range(16):
                        row = logits[i, j]
                        reference[i, j] = torch.logsumexp(row, 0) - row[labels[i, j]]
        out[arm] = (fused, megatron, reference)
    return out


def test_chunked_head_losses_at_tp1_and_tp2():
    import torch

    tp1 = run_distributed(_losses, 1, tp=1, args=(1,))[0]
    tp2 = run_distributed(_losses, 2, tp=2, args=(2,))
    for arm in ("tied", "untied"):
        fused, megatron, reference = tp1[arm]
        assert torch.allclose(fused.double(), reference, rtol=1e-6, atol=0)
        assert torch.allclose(fused, megatron, rtol=1e-6, atol=0)
        for rank in range(2):  # every rank returns the same losses
            fused2, megatron2, _ = tp2[rank][arm]
            assert torch.allclose(fused2, megatron2, rtol=1e-6, atol=0)
            assert torch.allclose(fused2, fused, rtol=1e-6, atol=0)
