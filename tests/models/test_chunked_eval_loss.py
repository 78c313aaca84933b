"""The scoring forward's head and loss in row chunks (`chunked_head_cross_entropy`): the same
per-token losses as the [s, b, V] logits path, on one rank; over two vocab shards the model keeps
the vocab-parallel path."""

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.tensor_parallel import chunked_head_cross_entropy, vocab_parallel_cross_entropy

SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)
VOCAB, SEQ = 200, 32
FLOAT32 = dict(rtol=1.3e-6, atol=1e-5)  # torch.testing's float32 tolerances


def _float64_losses(hidden, weight, target):
    logits = F.linear(hidden.double(), weight.double())
    picked = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return torch.logsumexp(logits, dim=-1) - picked


@pytest.mark.parametrize("rows", [1, 7, 48, 1000])
def test_chunks_match_the_full_logits_path_and_float64(rows):
    torch.manual_seed(0)
    hidden = torch.randn(16, 3, 32)  # [s, b, h]
    weight = torch.randn(100, 32) * 0.5  # [V, h]
    target = torch.randint(0, 100, (16, 3))
    with torch.no_grad():
        got = chunked_head_cross_entropy(hidden, weight, target, rows=rows)
        want = vocab_parallel_cross_entropy(F.linear(hidden, weight), target, None)
    assert got.shape == (16, 3) and got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got.double(), _float64_losses(hidden, weight, target), **FLOAT32)


def test_chunks_refuse_autograd():
    with pytest.raises(RuntimeError, match="forward-only"):
        chunked_head_cross_entropy(torch.randn(2, 1, 4), torch.randn(5, 4), torch.zeros(2, 1))


def _one_rank_eval_losses() -> dict:
    """Per arm: whether the scoring forward took the chunks (and the autograd one did not),
    and the largest difference of its losses from the logits path and from float64."""
    import megatron_ext.models.leviathan_model as leviathan_model
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.config.model import ModelConfig
    from megatron_ext.models import build_model

    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return chunked_head_cross_entropy(*args, **kwargs)

    leviathan_model.chunked_head_cross_entropy = spy
    tokens = torch.randint(0, VOCAB, (3, SEQ + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).expand(3, -1)
    report = {}
    for arm in ("tied", "untied"):
        torch.manual_seed(0)
        config = ModelConfig(
            vocab_size=VOCAB, seq_length=SEQ, embedding=dict(embedding_type=arm), **SHAPE
        )
        model = build_model(config, parallel=ParallelConfig(), precision=PrecisionConfig())
        model.eval()
        calls.clear()
        with torch.no_grad():
            chunked = model(inputs, positions, None, labels=labels)
            logits = model(inputs, positions, None)  # [b, s, V]
        took = len(calls)
        full = model(inputs, positions, None, labels=labels)  # autograd: the logits path
        want = F.cross_entropy(
            logits.double().flatten(0, 1), labels.flatten(), reduction="none"
        ).view(3, SEQ)
        report[arm] = {
            "calls": (took, len(calls), full.requires_grad, tuple(chunked.shape)),
            "vs_logits_path": torch.allclose(chunked, full.detach(), **FLOAT32),
            "vs_float64": torch.allclose(chunked.double(), want, **FLOAT32),
        }
    return report


@pytest.mark.integration
def test_eval_forward_takes_the_chunks_with_the_same_losses():
    from tests.support.distributed import run_distributed

    report = run_distributed(_one_rank_eval_losses, 1)[0]
    for arm, checks in report.items():
        assert checks["calls"] == (1, 1, True, (3, SEQ)), arm
        assert checks["vs_logits_path"] and checks["vs_float64"], (arm, checks)


def _two_shard_eval_losses() -> list[bool]:
    import megatron_ext.megatron_import  # noqa: F401

    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.config.model import ModelConfig
    from megatron_ext.models import build_model
    from megatron_ext.parallel import ProcessGroups
    from megatron_ext.tensor_parallel import gather_from_tensor_model_parallel_region

    pg = ProcessGroups.from_megatron()
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=VOCAB, seq_length=SEQ, embedding=dict(embedding_type="untied"), **SHAPE
    )
    model = build_model(
        config, parallel=ParallelConfig(tensor_model_parallel_size=2), precision=PrecisionConfig(),
        pg=pg,
    ).eval()  # fmt: skip
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).expand(2, -1)
    with torch.no_grad():
        hidden_probe = model._chunked_eval_loss(torch.zeros(1, 1, 1), {})
        losses = model(inputs, positions, None, labels=labels)
        logits = gather_from_tensor_model_parallel_region(model(inputs, positions, None), pg.tp)
    logits = logits[..., :VOCAB] if logits.size(-1) > VOCAB else logits
    want = F.cross_entropy(logits.double().flatten(0, 1), labels.flatten(), reduction="none")
    close = torch.allclose(losses.double(), want.view(2, SEQ), **FLOAT32)
    return [hidden_probe, close]


@pytest.mark.integration
def test_two_vocab_shards_keep_the_vocab_parallel_loss():
    from tests.support.distributed import run_distributed

    assert run_distributed(_two_shard_eval_losses, 2, tp=2) == [[False, True]] * 2
