"""The peer users would pick instead: transformers' `LlamaForCausalLM` holding our HF export of
the same model (the export-hf mapping: `conversion.hf.to_hf_state_dict` with the LEV input table
materialised), same dtype, same threads; and the model both sides run. Shared by
benchmarks/bench_generate.py, bench_eval.py and bench_train_peer.py."""

from __future__ import annotations

import torch

from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
from megatron_ext.config.model import ModelConfig
from megatron_ext.conversion.hf import hf_config, to_hf_state_dict
from megatron_ext.conversion.source import materialize_module_table
from megatron_ext.models import build_model


def bench_model(pg, arm: str = "lev", eval_table: bool = False, **shape):
    """(config, model): `ModelConfig(**shape)` of `arm` built seeded, in eval mode (`eval_table`:
    with LEV's evaluation table, as `load_for_evaluation` builds it)."""
    torch.manual_seed(0)
    embedding = dict(embedding_type=arm, lev=dict(eval_table=eval_table))
    config = ModelConfig(embedding=embedding, **shape)
    model = build_model(config, parallel=ParallelConfig(), precision=PrecisionConfig(), pg=pg)
    return config, model.eval()


def hf_export(model, model_config):
    """`LlamaForCausalLM` (eval, float32) with `model`'s weights as tools/convert_checkpoint.py
    export-hf writes them (padded vocab kept, so logits line up id for id)."""
    # optional: the [test] extra
    from transformers import LlamaForCausalLM

    tied = model_config.embedding.tied
    full = {
        k: v.detach().float()
        for k, v in model.state_dict().items()
        if not k.endswith("_extra_state") and torch.is_tensor(v)
    }
    embedding = model.embedding.word_embeddings
    table = materialize_module_table(embedding, compute_dtype=torch.float64, progress=False).float()
    state = to_hf_state_dict(
        full,
        table,
        num_attention_heads=model_config.num_attention_heads,
        num_query_groups=model_config.num_query_groups,
        tied=tied,
        vocab_rows=model_config.vocab_size,
    )
    config = hf_config(model_config, vocab_size=model_config.vocab_size, tied=tied,
                       dtype=torch.float32)  # fmt: skip
    hf = LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"export mismatch: missing {missing}, unexpected {unexpected}")
    if tied:
        hf.tie_weights()
    return hf
