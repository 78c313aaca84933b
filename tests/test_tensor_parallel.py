"""The one sequence-split check that LEV, the digit-seed arm and the portable reduce-scatter use,
and the vocab-parallel cross entropy of the model's loss."""

import pytest

from megatron_ext.tensor_parallel import check_sequence_split


def test_sequence_split_names_the_flag_to_change():
    check_sequence_split(32, 4)
    with pytest.raises(
        ValueError, match="length 33 is not divisible by the tensor-parallel size 2"
    ):
        check_sequence_split(33, 2)
    with pytest.raises(ValueError, match="change --seq-length"):
        check_sequence_split(5, 4)


def _cross_entropies(shard_of_rank: bool) -> list[bool]:
    """Ours against megatron's vocab-parallel cross entropy on this rank's shard of the same
    logits: loss, logits gradient, and the forward without autograd, each bit for bit."""
    import megatron_ext.megatron_import  # noqa: F401

    import torch
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mcore_tp

    from megatron_ext.tensor_parallel import vocab_parallel_cross_entropy

    group = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(0)
    logits = torch.randn(16, 3, 40) * 4  # [s, b, V]
    target = torch.randint(0, 40, (16, 3))
    if shard_of_rank:
        logits = logits.chunk(group.size(), dim=-1)[group.rank()].contiguous()
    grad = torch.randn(16, 3)
    theirs, ours = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want = mcore_tp.vocab_parallel_cross_entropy(theirs * 1.0, target)
    got = vocab_parallel_cross_entropy(ours * 1.0, target, group)
    want.backward(grad)
    got.backward(grad)
    with torch.inference_mode():
        evaluated = vocab_parallel_cross_entropy(logits.clone(), target, group)
    return [
        torch.equal(got, want),
        torch.equal(ours.grad, theirs.grad),
        torch.equal(evaluated, want.detach()),
    ]


def test_cross_entropy_without_a_group_is_torchs():
    """One shard (group None): torch's cross entropy to float rounding, and the forward
    without autograd (which skips the softmax) gives the same losses bit for bit."""
    import torch
    import torch.nn.functional as F

    from megatron_ext.tensor_parallel import vocab_parallel_cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(16, 3, 40) * 4
    target = torch.randint(0, 40, (16, 3))
    ours, peer = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(ours * 1.0, target, None)
    want = F.cross_entropy(peer.flatten(0, 1), target.flatten(), reduction="none").view(16, 3)
    torch.testing.assert_close(loss, want)
    loss.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(ours.grad, peer.grad)
    with torch.no_grad():
        assert torch.equal(vocab_parallel_cross_entropy(logits.clone(), target, None), loss)


@pytest.mark.integration
def test_cross_entropy_is_megatrons_bit_for_bit():
    from tests.support.distributed import run_distributed

    assert run_distributed(_cross_entropies, 1, args=(False,)) == [[True, True, True]]


@pytest.mark.integration
def test_cross_entropy_is_megatrons_bit_for_bit_over_two_vocab_shards():
    from tests.support.distributed import run_distributed

    reports = run_distributed(_cross_entropies, 2, tp=2, args=(True,))
    assert reports == [[True, True, True]] * 2


def _sequence_parallel_round_trip() -> list:
    """Gather [s/tp, b, h] shards and reduce-scatter a full [s, b, h] back, with every warning
    an error (torch 2.13 warns on each call of its old collective names)."""
    import warnings

    import megatron_ext.megatron_import  # noqa: F401

    import torch
    from megatron.core import parallel_state

    from megatron_ext.tensor_parallel import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    group = parallel_state.get_tensor_model_parallel_group()
    rank, size = group.rank(), group.size()
    full = torch.arange(8 * 2 * 3, dtype=torch.float32).view(8, 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gathered = gather_from_sequence_parallel_region(full.chunk(size)[rank].clone(), group)
        scattered = reduce_scatter_to_sequence_parallel_region(full.clone(), group)
    return [torch.equal(gathered, full), torch.equal(scattered, size * full.chunk(size)[rank])]


@pytest.mark.integration
def test_sequence_parallel_collectives_gather_and_reduce_scatter_without_warnings():
    from tests.support.distributed import run_distributed

    assert run_distributed(_sequence_parallel_round_trip, 2, tp=2) == [[True, True]] * 2


def _layout_attributes(perform_initialization: bool) -> dict:
    """Every parameter's tensor-parallel attributes of each arm's model, built with or without
    drawing its initial values (a model about to be loaded, `inference.loading.load_model`)."""
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.config.model import ModelConfig
    from megatron_ext.models import build_model

    out = {}
    for arm in ("tied", "untied", "lev"):
        cfg = ModelConfig(
            vocab_size=64, seq_length=8, num_layers=2, hidden_size=32, num_attention_heads=4,
            ffn_hidden_size=48, embedding=dict(embedding_type=arm, lev=dict(seed_dim=8, rank=4,
            num_heads=2, num_knots=4)), perform_initialization=perform_initialization,
        )  # fmt: skip
        model = build_model(
            cfg, parallel=ParallelConfig(tensor_model_parallel_size=2), precision=PrecisionConfig()
        )
        for name, p in model.named_parameters():
            out[f"{arm}.{name}"] = tuple(
                getattr(p, a, None)
                for a in ("tensor_model_parallel", "partition_dim", "partition_stride")
            )
    return out


@pytest.mark.integration
def test_a_model_built_to_be_loaded_keeps_its_tensor_parallel_layout():
    """megatron sets a weight's layout attributes only while drawing it; the portable layers
    set them when the draw is skipped, so the checkpoint layout (and grad-norm counting) sees
    the same model: SwiGLU's fc1 with stride 2, the row-parallel projections on dim 1."""
    from tests.support.distributed import run_distributed

    drawn, skipped = (run_distributed(_layout_attributes, 2, tp=2, args=(f,)) for f in (1, 0))
    assert skipped == drawn
    layout = drawn[0]
    assert layout["lev.decoder.layers.0.mlp.linear_fc1.weight"] == (True, 0, 2)
    assert layout["lev.decoder.layers.0.self_attention.linear_proj.weight"] == (True, 1, 1)
    assert layout["tied.embedding.word_embeddings.weight"] == (True, 0, 1)
    assert layout["untied.output_layer.weight"] == (True, 0, 1)
