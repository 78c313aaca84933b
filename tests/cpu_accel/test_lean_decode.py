"""The lean decode step (`LeanDecoder`) against megatron's path, in one single-rank worker:

- its cached logits (a prefill, single-token steps, and a multi-token chunk after the prefill)
  equal the full forward's and megatron's cached step's (fed as `generate` feeds it) on
  float64 models of every arm and of layer variants
  (grouped or full attention, LayerNorm, a non-gated GELU MLP, partial and interleaved RoPE);
- `generate(step="lean")` gives megatron's tokens (greedy, sampled, mixed prompt lengths, stop
  ids) on float32 models;
- what it does not cover is named, and asking for it there is refused, not run another way.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.inference.test_generation import PROMPTS, VOCAB, _config
from tests.support.distributed import run_distributed

pytestmark = pytest.mark.integration

ARMS = ("tied", "untied", "albert", "flat-mlp", "factored-mlp", "lev")
VARIANTS = {
    "full-attention": dict(num_query_groups=4),
    "layernorm-gelu": dict(
        extra_transformer_config=dict(normalization="LayerNorm", gated_linear_unit=False)
    ),
    "partial-interleaved-rope": dict(
        rotary_percent=0.5, extra_transformer_config=dict(rotary_interleaved=True)
    ),
}


def _model(arm: str, dtype=torch.float64, **overrides):
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.models import build_model

    torch.manual_seed(0)
    model = build_model(
        _config(arm, **overrides),
        parallel=ParallelConfig(),
        precision=PrecisionConfig(params_dtype=dtype),
    ).eval()
    with torch.no_grad():
        # Some arms start with zero blocks (flat-mlp's output); noise makes every weight count.
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
        if model.output_layer.weight is not None:  # decisive, varied tokens
            model.output_layer.weight.mul_(40.0)
    return model


def _logit_gaps(model) -> tuple[float, float, float]:
    """(largest |lean - full forward|, largest |lean - megatron's cached step|, largest |logit|)
    over a prefill, single-token steps and a 4-token chunk after the prefill. megatron's static
    cache is fed as `generate` feeds it (a prefill, then one token at a time): given a chunk
    after the prefill it does not give the full forward's logits, the lean step does."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from megatron_ext.cpu_accel.lean_decode import LeanDecoder
    from megatron_ext.inference.generation import lev_eval_tables, next_token_logits

    tokens = torch.randint(0, VOCAB, (3, 14), generator=torch.Generator().manual_seed(1))
    chunks = [(0, 5), (5, 6), (6, 7), (7, 11), (11, 12), (12, 14)]
    with torch.no_grad(), lev_eval_tables(model):
        full = model(tokens, None, None, runtime_gather_output=True)  # [b, s, V]
        context = StaticInferenceContext(3, 14)
        # Both weight layouts: [in, out] copies (CPU's default) and the model's own (GPU's).
        lean = [LeanDecoder(model, 3, 14, transposed_weights=t) for t in (True, False)]
        to_full = to_megatron = scale = 0.0
        for start, end in chunks:
            # megatron takes a chunk after the prefill one token at a time.
            steps = [(start, end)] if start == 0 else [(p, p + 1) for p in range(start, end)]
            for first, last in steps:
                theirs = next_token_logits(model, tokens[:, first:last], context)
            scale = max(scale, full[:, end - 1].abs().max().item())
            for decoder in lean:
                ours = decoder(tokens[:, start:end])
                to_full = max(to_full, (ours - full[:, end - 1]).abs().max().item())
                to_megatron = max(to_megatron, (ours - theirs).abs().max().item())
    return to_full, to_megatron, scale


def _checks() -> dict:
    from megatron_ext.cpu_accel.lean_decode import lean_decode_unsupported
    from megatron_ext.inference.generation import SamplingConfig, decode_step_for, generate

    res: dict = {"gap": {}, "tokens": {}, "step": {}, "free": {}}
    for arm in ARMS:
        model = _model(arm)
        res["step"][arm] = decode_step_for(model)
        res["gap"][arm] = _logit_gaps(model)
    for name, overrides in VARIANTS.items():
        model = _model("lev", **overrides)
        res["step"][name] = decode_step_for(model)
        res["gap"][name] = _logit_gaps(model)

    greedy = SamplingConfig(max_new_tokens=12)
    sampled = SamplingConfig(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=5)
    for arm in ("tied", "lev"):
        model = _model(arm, torch.float32)
        free = generate(model, PROMPTS, greedy)
        stop = SamplingConfig(max_new_tokens=12, stop_token_ids=(free[0][2],))
        res["free"][arm] = (free, free[0][2])
        res["tokens"][arm] = [
            (generate(model, PROMPTS, cfg, step="lean"), generate(model, PROMPTS, cfg))
            for cfg in (greedy, sampled, stop)
        ]

    # A model changed between two `generate` calls: the lean step uses the new weights.
    model = _model("lev", torch.float32)
    before = generate(model, PROMPTS, greedy, step="lean")
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.mlp.linear_fc2.weight.mul_(-3.0)
        model.output_layer.weight.add_(torch.randn_like(model.output_layer.weight))
    res["changed"] = (
        before,
        generate(model, PROMPTS, greedy, step="lean"),
        generate(model, PROMPTS, greedy),
    )

    model = _model("tied")
    refused = {}
    for field, value in (("qk_layernorm", True), ("tensor_model_parallel_size", 2),
                         ("add_bias_linear", True)):  # fmt: skip
        changed = copy.copy(model)
        changed.config = copy.copy(model.config)
        setattr(changed.config, field, value)
        refused[field] = lean_decode_unsupported(changed)
        if field == "qk_layernorm":
            try:
                generate(changed, PROMPTS, greedy, step="lean")
                refused["generate"] = None
            except ValueError as error:
                refused["generate"] = str(error)
    res["refused"] = refused
    res["no_cache"] = decode_step_for(model, use_cache=False)
    try:
        generate(model, PROMPTS, SamplingConfig(4, use_cache=False), step="lean")
        res["no_cache_lean"] = None
    except ValueError as error:
        res["no_cache_lean"] = str(error)
    return res


@pytest.fixture(scope="module")
def results() -> dict:
    return run_distributed(_checks, 1)[0]


@pytest.mark.parametrize("case", ARMS + tuple(VARIANTS))
def test_lean_logits_equal_megatron_cached_forward(results, case):
    to_full, to_megatron, scale = results["gap"][case]
    assert scale > 0.1  # the logits are not trivially small
    assert to_full < 1e-12 * scale and to_megatron < 1e-12 * scale
    assert results["step"][case][0] == "lean"


@pytest.mark.parametrize("arm", ("tied", "lev"))
def test_lean_generate_gives_megatron_tokens(results, arm):
    for lean, megatron in results["tokens"][arm]:
        assert lean == megatron
    greedy, sampled, stopped = (pair[0] for pair in results["tokens"][arm])
    assert all(len(row) == 12 for row in greedy) and sampled != greedy
    free, stop = results["free"][arm]
    assert len(stopped[0]) <= 2
    for row_free, row_stopped in zip(free, stopped):
        cut = row_free.index(stop) if stop in row_free else len(row_free)
        assert row_stopped == row_free[:cut]


def test_lean_generate_uses_weights_changed_since_the_last_call(results):
    before, lean, megatron = results["changed"]
    assert lean == megatron and lean != before


def test_what_the_lean_step_does_not_cover_is_named_and_refused(results):
    refused = results["refused"]
    assert refused["qk_layernorm"] == "qk layernorm"
    assert refused["tensor_model_parallel_size"] == "tensor parallelism (TP>1)"
    assert refused["add_bias_linear"] == "linear biases"
    assert refused["generate"] == "the lean decode step does not cover qk layernorm"
    assert results["no_cache"] == ("megatron", "no KV cache requested")
    assert "KV cache" in results["no_cache_lean"]


def test_tool_refuses_the_lean_step_without_a_cache(capsys):
    from megatron_ext.inference.generate import main

    code = main(["--load", "no-such-run", "--prompt", "a", "--decode-step", "lean", "--no-cache"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == "error: --decode-step lean always uses its KV cache; drop --no-cache"
