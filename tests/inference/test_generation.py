"""KV-cache generation on freshly built models of every arm (one single-rank worker):

- the cached decode step gives the logits of a full forward over the whole prefix (float64
  models, so the comparison is about the cache, not rounding);
- greedy and seeded sampling give the same tokens with and without the cache;
- a batch of prompts of different lengths gives what each prompt gives alone;
- the sampling filters (top-k, top-p, vocabulary padding, stop ids) behave as documented;
- LEV embeds from its materialised eval table and its configuration is restored afterwards.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed

pytestmark = pytest.mark.integration

ARMS = ("tied", "untied", "albert", "flat-mlp", "factored-mlp", "lev")
VOCAB = 160
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [42]]


def _config(arm: str, **overrides):
    """The tiny 2-layer model of these tests and test_lean_decode's, `overrides` on top."""
    from megatron_ext.config.model import ModelConfig

    fields = dict(
        vocab_size=VOCAB, num_layers=2, hidden_size=32, num_attention_heads=4,
        num_query_groups=2, ffn_hidden_size=64, seq_length=64,
        embedding=dict(embedding_type=arm, lev=dict(seed_dim=8, rank=4, num_heads=2,
                                                    num_knots=5)),
    )  # fmt: skip
    fields.update(overrides)
    return ModelConfig(**fields)


def _model(arm: str, dtype=torch.float64):
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.models import build_model

    torch.manual_seed(0)
    model = build_model(
        _config(arm), parallel=ParallelConfig(), precision=PrecisionConfig(params_dtype=dtype)
    ).eval()
    # A random model is nearly uniform; larger output weights give decisive, varied tokens.
    if model.output_layer.weight is not None:
        with torch.no_grad():
            model.output_layer.weight.mul_(40.0)
    return model


def _checks() -> dict:
    from megatron.core.inference.contexts import StaticInferenceContext

    from megatron_ext.inference.generation import (
        SamplingConfig,
        generate,
        next_token_logits,
        sample,
    )

    res: dict = {"cache_logits": {}, "same": {}, "batched": {}}
    for arm in ARMS:
        model = _model(arm)
        tokens = torch.tensor([PROMPTS[2] + [3, 1, 4, 1, 5]])
        context = StaticInferenceContext(1, tokens.size(1))
        cached = [next_token_logits(model, tokens[:, :4], context)]
        for position in range(4, tokens.size(1)):
            cached.append(next_token_logits(model, tokens[:, position : position + 1], context))
        with torch.no_grad():
            full = model(tokens, None, None, runtime_gather_output=True)[0]
        res["cache_logits"][arm] = max(
            (c[0].double() - full[3 + i].double()).abs().max().item() for i, c in enumerate(cached)
        )
        greedy = SamplingConfig(max_new_tokens=12)
        sampled = SamplingConfig(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=5)
        res["same"][arm] = (
            generate(model, PROMPTS, greedy),
            generate(model, PROMPTS, SamplingConfig(max_new_tokens=12, use_cache=False)),
            generate(model, PROMPTS, sampled),
            generate(model, PROMPTS, SamplingConfig(**{**sampled.__dict__, "use_cache": False})),
        )
        res["batched"][arm] = (
            generate(model, PROMPTS, greedy),
            [generate(model, [p], greedy)[0] for p in PROMPTS],
        )

    model = _model("lev", torch.float32)
    lev = model.embedding.word_embeddings
    res["lev_table_before"] = lev._table is None
    generate(model, PROMPTS[:1], SamplingConfig(max_new_tokens=4))
    res["lev_table_after"] = lev._table is not None and tuple(lev._table.shape)
    res["lev_config_restored"] = lev.lev_config.eval_table is False

    # Stop ids end a row (the stop token is not returned); other rows carry on.
    free = generate(model, PROMPTS, SamplingConfig(max_new_tokens=8))
    stop = free[0][2]
    res["stop"] = (free, generate(model, PROMPTS, SamplingConfig(8, stop_token_ids=(stop,))), stop)

    # Sampling filters on hand-made logits.
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, -1.0, 10.0]])
    gen = torch.Generator().manual_seed(0)
    draws = lambda cfg: {int(sample(logits, cfg, gen)) for _ in range(300)}  # noqa: E731
    res["top_k"] = draws(SamplingConfig(1, temperature=1.0, top_k=3))
    logits = torch.tensor([[0.0, 5.0, 4.9, 3.0, -1.0, 0.0]])
    res["top_p"] = draws(SamplingConfig(1, temperature=1.0, top_p=0.6))
    res["all"] = draws(SamplingConfig(1, temperature=50.0))
    # Make the padding rows (ids >= VOCAB - 32) of the head win the first step.
    model = _model("untied")
    logits = next_token_logits(model, torch.tensor([[1, 2]]))[0]
    best = int(logits.argmax())
    with torch.no_grad():
        weight = model.output_layer.weight
        weight[VOCAB - 32 :] = weight[best] * 1000.0 * torch.sign(logits[best])
    res["padding"] = (
        generate(model, [[1, 2]], SamplingConfig(5))[0][0],
        generate(model, [[1, 2]], SamplingConfig(5), vocab_size=VOCAB - 32),
    )
    return res


@pytest.fixture(scope="module")
def results() -> dict:
    return run_distributed(_checks, 1)[0]


@pytest.mark.parametrize("arm", ARMS)
def test_cached_decode_equals_full_forward(results, arm):
    assert results["cache_logits"][arm] < 1e-10


@pytest.mark.parametrize("arm", ARMS)
def test_cache_and_recompute_give_the_same_tokens(results, arm):
    greedy, greedy_nocache, sampled, sampled_nocache = results["same"][arm]
    assert greedy == greedy_nocache and sampled == sampled_nocache
    assert all(len(row) == 12 for row in greedy)
    assert sampled != greedy  # the sampler really samples


@pytest.mark.parametrize("arm", ARMS)
def test_batch_equals_each_prompt_alone(results, arm):
    batched, alone = results["batched"][arm]
    assert batched == alone


def test_lev_generates_from_its_eval_table(results):
    assert results["lev_table_before"]
    assert results["lev_table_after"] == (VOCAB, 32)
    assert results["lev_config_restored"]


def test_stop_ids_end_only_their_row(results):
    free, stopped, stop = results["stop"]
    assert len(stopped[0]) <= 2
    for row_free, row_stopped in zip(free, stopped):
        cut = row_free.index(stop) if stop in row_free else len(row_free)
        assert row_stopped == row_free[:cut]


def test_sampling_filters(results):
    assert results["top_k"] <= {5, 1, 2} and len(results["top_k"]) > 1
    assert results["top_p"] <= {1, 2} and len(results["top_p"]) == 2
    assert len(results["all"]) == 6
    unrestricted_first, restricted = results["padding"]
    assert unrestricted_first >= VOCAB - 32
    assert all(t < VOCAB - 32 for row in restricted for t in row)


def test_sampling_config_validates_itself():
    from megatron_ext.inference.generation import SamplingConfig

    for bad in (dict(max_new_tokens=-1), dict(max_new_tokens=1, temperature=-1.0),
                dict(max_new_tokens=1, top_k=-2), dict(max_new_tokens=1, top_p=0.0)):  # fmt: skip
        with pytest.raises(ValueError):
            SamplingConfig(**bad)
