"""Checkpoint names cross the Transformer Engine and local specs (megatron-core's own map)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_ext.models.te_mapping import (
    canonical_param_name,
    te_param_name,
    te_to_local_prefixes,
)
from tests.support.distributed import call_in_file, run_distributed

pytestmark = pytest.mark.integration

# The parameters of one decoder layer in megatron-core's TE spec (TELayerNormColumnParallelLinear
# carries the fused RMSNorm weight as `layer_norm_weight`; TEDotProductAttention has none).
TE_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight",
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
}
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


def test_the_map_is_megatron_cores():
    assert te_to_local_prefixes() == {
        "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
        "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
    }
    name = "module.decoder.layers.11.self_attention.linear_qkv.layer_norm_weight"
    assert canonical_param_name(name) == "module.decoder.layers.11.input_layernorm.weight"
    assert te_param_name(canonical_param_name(name)) == name
    for unchanged in ("embedding.word_embeddings.codebooks", "decoder.final_layernorm.weight",
                      "output_layer.weight", "decoder.layers.0.mlp.linear_fc2.weight"):  # fmt: skip
        assert canonical_param_name(unchanged) == te_param_name(unchanged) == unchanged


def _config(impl="local"):
    from megatron_ext.config.model import ModelConfig

    return ModelConfig(
        vocab_size=96,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        transformer_impl=impl,
        embedding=dict(embedding_type="lev", lev=dict(seed_dim=8, rank=4, num_heads=2)),
    )


class _TENamedLayer(torch.nn.Module):
    """A decoder layer's parameters under the TE spec's names (what a TE checkpoint holds)."""

    def __init__(self, shapes: dict, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        self.self_attention = torch.nn.Module()
        self.mlp = torch.nn.Module()
        for name in TE_LAYER:
            owner_name, linear, param = name.split(".")
            owner = getattr(self, owner_name)
            if not hasattr(owner, linear):
                owner.add_module(linear, torch.nn.Module())
            local = canonical_param_name(f"decoder.layers.{layer_number - 1}.{name}")
            tensor = torch.nn.Parameter(torch.zeros(shapes[local]))
            getattr(owner, linear).register_parameter(param, tensor)


def _round_trip() -> dict:
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.models import build_model
    from megatron_ext.models.full_state_dict import gather_full_state_dict, load_full_state_dict
    from megatron_ext.parallel import ProcessGroups

    pg = ProcessGroups.from_megatron()
    torch.manual_seed(0)
    local = build_model(_config(), parallel=ParallelConfig(), precision=PrecisionConfig(), pg=pg)
    full = gather_full_state_dict(local, pg.tp)
    shapes = {k: v.shape for k, v in full.items()}
    te_like = torch.nn.Module()
    te_like.decoder = torch.nn.Module()
    te_like.decoder.layers = torch.nn.ModuleList([_TENamedLayer(shapes, i + 1) for i in range(2)])
    load_full_state_dict(te_like, full, pg.tp, strict=False)  # a local checkpoint into TE names
    back = gather_full_state_dict(te_like, pg.tp)  # ... and back under the checkpoint's names
    layer0 = {n[len("decoder.layers.0.") :] for n in full if n.startswith("decoder.layers.0.")}
    return dict(
        local_layer_names=layer0,
        te_names=sorted(n for n, _ in te_like.named_parameters()),
        equal=all(torch.equal(back[k], full[k]) for k in back),
        back_keys=sorted(back),
        layer_keys=sorted(k for k in full if k.startswith("decoder.layers.")),
    )


def test_a_checkpoint_crosses_the_specs_on_the_name_level():
    out = run_distributed(call_in_file, 1, args=(__file__, "_round_trip"))[0]
    # The local spec's layer parameters are the TE spec's, renamed by the map.
    assert {te_param_name(f"decoder.layers.0.{n}")[len("decoder.layers.0.") :]
            for n in out["local_layer_names"]} == TE_LAYER  # fmt: skip
    assert any(n.endswith("linear_qkv.layer_norm_weight") for n in out["te_names"])
    assert out["back_keys"] == out["layer_keys"] and out["equal"]


@pytest.mark.skipif(not HAVE_TE, reason="needs Transformer Engine and a CUDA GPU")
def test_te_model_names_map_onto_the_local_model():  # pragma: no cover - GPU only
    out = run_distributed(call_in_file, 1, args=(__file__, "_both_names"))[0]
    assert out["transformer_engine"] == out["local"]


def _both_names() -> dict:
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.models import build_model

    one_rank = dict(parallel=ParallelConfig(), precision=PrecisionConfig())
    return {
        impl: {
            canonical_param_name(n)
            for n, _ in build_model(_config(impl), **one_rank).named_parameters()
        }
        for impl in ("local", "transformer_engine")
    }
