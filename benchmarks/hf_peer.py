"""The peer users would pick instead: transformers' `LlamaForCausalLM` holding our HF export of
the same model (the export-hf mapping: `conversion.hf.to_hf_state_dict` with the LEV input table
materialised), same dtype, same threads. Shared by benchmarks/bench_generate.py and
bench_eval.py."""

from __future__ import annotations

import torch

from megatron_ext.conversion.hf import hf_config, to_hf_state_dict
from megatron_ext.conversion.source import materialize_module_table


def hf_export(model, model_config, tied: bool):
    """`LlamaForCausalLM` (eval, float32) with `model`'s weights as tools/convert_checkpoint.py
    export-hf writes them (padded vocab kept, so logits line up id for id)."""
    # optional: the [test] extra
    from transformers import LlamaForCausalLM

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
