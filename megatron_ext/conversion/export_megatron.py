"""export-megatron: any arm -> a Megatron-LM legacy checkpoint (`--ckpt-format torch`).

    <out>/latest_checkpointed_iteration.txt
    <out>/iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt

Each file holds {"model", "checkpoint_version": 3.0, "iteration", "args"} with megatron-core's
GPTModel key names for its local spec; the arm is materialised into
`embedding.word_embeddings.weight` and tensor-parallel shards follow megatron's splits. Stock
Megatron-LM loads it with `pretrain_gpt.py --load <out> --ckpt-format torch --finetune
--no-load-optim --no-load-rng --use-checkpoint-args --untie-embeddings-and-output-weights`.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

import torch
from tqdm import tqdm

from megatron_ext.config.data import padded_vocab_size
from megatron_ext.config.layout import ParallelConfig, check_layout
from megatron_ext.config.model import EmbeddingConfig
from megatron_ext.conversion.common import (
    ConversionError,
    atomic_output_dir,
    new_output,
    resize_rows,
)
from megatron_ext.conversion.source import (
    ExportOptions,
    load_checkpoint_full,
    materialize_module_table,
)
from megatron_ext.models.full_state_dict import tp_shard

__all__ = ["ExportMegatronOptions", "export_megatron", "megatron_rank_state_dict", "TP_LAYOUT"]

logger = logging.getLogger(__name__)

# Parameter-name suffix -> (partition dim, stride) of megatron's tensor-parallel split.
TP_LAYOUT = {
    "embedding.word_embeddings.weight": (0, 1),
    "output_layer.weight": (0, 1),
    "self_attention.linear_qkv.weight": (0, 1),
    "self_attention.linear_proj.weight": (1, 1),
    "mlp.linear_fc1.weight": (0, 2),
    "mlp.linear_fc2.weight": (1, 1),
}


@dataclass(frozen=True)
class ExportMegatronOptions(ExportOptions):
    """Arguments of `export_megatron`: the source and dtypes, and the TP x PP layout to write."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1


def megatron_rank_state_dict(
    full: dict[str, torch.Tensor],
    *,
    num_layers: int,
    tied: bool,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
) -> dict[str, torch.Tensor]:
    """One (TP, PP) rank's state dict from megatron-named full tensors (stage-local layers)."""
    per_stage = num_layers // pp_size
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers.") :].split(".", 1)
            stage, local = divmod(int(index), per_stage)
            if stage != pp_rank:
                continue
            key = f"decoder.layers.{local}.{rest}"
        elif name.startswith("embedding."):
            if not first:
                continue
            key = name
        else:  # final norm, output layer
            if not last:
                continue
            key = name
        layout = next((v for suffix, v in TP_LAYOUT.items() if name.endswith(suffix)), None)
        out[key] = tp_shard(tensor, *layout, tp_rank, tp_size) if layout else tensor.clone()
    if tied and last and not first:
        # Megatron's last stage keeps its own copy of the tied table as output_layer.weight.
        table = full["embedding.word_embeddings.weight"]
        out["output_layer.weight"] = tp_shard(table, 0, 1, tp_rank, tp_size)
    return out


def _megatron_args(loaded, padded: int, tp: int, pp: int, dtype: torch.dtype) -> argparse.Namespace:
    cfg = loaded.model_config
    data = loaded.run.data
    return argparse.Namespace(  # Megatron-LM's checkpoint format: its "args" is a Namespace
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        group_query_attention=cfg.num_query_groups != cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        seq_length=cfg.seq_length,
        max_position_embeddings=cfg.seq_length,
        position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
        rotary_percent=1.0,
        rotary_interleaved=bool(getattr(loaded.model.config, "rotary_interleaved", False)),
        normalization="RMSNorm",
        norm_epsilon=cfg.norm_epsilon,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=cfg.qk_layernorm,
        untie_embeddings_and_output_weights=not cfg.embedding.tied,
        padded_vocab_size=padded,
        make_vocab_size_divisible_by=data.make_vocab_size_divisible_by,
        vocab_size=data.vocab_size,
        tokenizer_type=data.tokenizer_type,
        tokenizer_model=data.tokenizer_model,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        ckpt_format="torch",
        transformer_impl="local",
        consumed_train_samples=0,
        consumed_valid_samples=0,
        iteration=loaded.run.iteration,
        leviathan_embedding_type=cfg.embedding.embedding_type,
        leviathan_source_checkpoint=loaded.run.path,
    )


def export_megatron(opts: ExportMegatronOptions) -> str:
    """Write the legacy checkpoint; returns its directory."""
    output = new_output(opts.output, opts.overwrite)
    tp, pp = opts.tensor_model_parallel_size, opts.pipeline_model_parallel_size
    loaded = load_checkpoint_full(
        opts.load,
        iteration=opts.iteration,
        tokenizer_model=opts.tokenizer_model,
        embedding_type=opts.embedding_type,
        verify=opts.verify,
        progress=opts.progress,
    )
    cfg = loaded.model_config
    try:  # the layout must suit the backbone (heads, groups, layers divisible)
        check_layout(
            cfg.replace(embedding=EmbeddingConfig("untied")),
            ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        )
    except ValueError as error:
        raise ConversionError(str(error)) from None
    if cfg.qk_layernorm:
        raise ConversionError("export-megatron does not map --qk-layernorm models yet")
    divisible = loaded.run.data.make_vocab_size_divisible_by
    padded = padded_vocab_size(loaded.tokenizer.vocab_size, divisible, tp)
    table = materialize_module_table(
        loaded.model.embedding.word_embeddings,
        compute_dtype=opts.compute_dtype,
        dtype=opts.dtype,
        progress=opts.progress,
    )
    full = {k: v for k, v in loaded.full.items() if not k.startswith("embedding.")}
    full["embedding.word_embeddings.weight"] = table
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in full:
            full[key] = resize_rows(full[key], padded)
    full = {k: v.to(opts.dtype) for k, v in full.items()}
    args = _megatron_args(loaded, padded, tp, pp, opts.dtype)
    iteration = loaded.run.iteration
    with atomic_output_dir(output, opts.overwrite) as tmp:
        ranks = [(t, p) for p in range(pp) for t in range(tp)]
        for t, p in tqdm(ranks, desc="writing ranks", unit="rank", disable=not opts.progress):
            name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            directory = os.path.join(tmp, f"iter_{iteration:07d}", name)
            os.makedirs(directory)
            state = megatron_rank_state_dict(
                full,
                num_layers=cfg.num_layers,
                tied=cfg.embedding.tied,
                tp_rank=t,
                tp_size=tp,
                pp_rank=p,
                pp_size=pp,
            )
            torch.save(
                {"model": state, "checkpoint_version": 3.0, "iteration": iteration, "args": args},
                os.path.join(directory, "model_optim_rng.pt"),
            )
        with open(os.path.join(tmp, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write(f"{iteration}\n")
    return output
