"""export-hf: a training checkpoint (any arm, any saved layout) -> a `LlamaForCausalLM` directory
(`--hf-format llama`, the input module materialised into a [V, D] table), or a LEV checkpoint ->
a `LeviathanForCausalLM` directory that keeps LEV's parameters (`--hf-format leviathan`).

config.json               LlamaConfig (or LeviathanConfig + auto_map) + `leviathan` (arm, LEV
                          hyper-parameters, source checkpoint, iteration, git revision,
                          vocabulary handling)
generation_config.json    eos = the tokenizer's end-of-document id
model.safetensors         (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
tokenizer.json, tokenizer_config.json
configuration_leviathan.py, modeling_leviathan.py, lev_math.py   (leviathan: the model's code,
                          from this package's source; hf_leviathan/remote_code.py)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from transformers import GenerationConfig

import megatron_ext
from megatron_ext._paths import display_path
from megatron_ext.conversion.common import (
    HF_FORMATS,
    ConversionError,
    atomic_output_dir,
    new_output,
)
from megatron_ext.conversion.hf import (
    export_tokenizer,
    hf_config,
    to_hf_state_dict,
    write_safetensors,
)
from megatron_ext.conversion.hf_leviathan.remote_code import write_remote_code
from megatron_ext.conversion.source import (
    ExportOptions,
    load_checkpoint_full,
    materialize_module_table,
)

__all__ = ["ExportHFOptions", "export_hf"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportHFOptions(ExportOptions):
    """Arguments of `export_hf`: the source and dtypes, sharding, tokenizer, format."""

    keep_padded_vocab: bool = False
    """Keep the make-vocab-size-divisible-by padding rows (default: trim to the tokenizer)."""
    max_shard_size: str = "5GB"
    export_tokenizer: bool = True
    hf_format: str = "llama"
    """llama: LlamaForCausalLM, the input module materialised; leviathan: LeviathanForCausalLM,
    LEV's parameters kept (LEV checkpoints only)."""

    def __post_init__(self) -> None:
        if self.hf_format not in HF_FORMATS:
            raise ConversionError(
                f"--hf-format must be one of {', '.join(HF_FORMATS)}, got {self.hf_format!r}"
            )


def provenance(loaded, vocab_rows: int, opts: ExportHFOptions) -> dict:
    """What the export came from, stored in config.json as `leviathan`."""
    cfg = loaded.model_config
    emb = cfg.embedding
    record = {
        "embedding_type": emb.embedding_type,
        "source_checkpoint": loaded.run.path,
        "iteration": loaded.run.iteration,
        "git_revision": megatron_ext.git_revision(),
        "saved_layout": loaded.run.common.get("layout"),
        "padded_vocab_size": cfg.vocab_size,
        "exported_vocab_size": vocab_rows,
        "hf_format": opts.hf_format,
    }
    if opts.hf_format == "llama":
        record["input_table_compute_dtype"] = str(opts.compute_dtype).replace("torch.", "")
    if emb.embedding_type in ("lev", "factored-mlp"):
        record["lev"] = dataclasses.asdict(emb.lev)
    for key in ("albert_dim", "flat_mlp_seed_dim", "mlp_hidden"):
        if getattr(emb, key) is not None:
            record[key] = getattr(emb, key)
    return record


def export_hf(opts: ExportHFOptions) -> str:
    """Write the export; returns its directory."""
    new_output(opts.output, opts.overwrite)  # before the (possibly long) load
    loaded = load_checkpoint_full(
        opts.load,
        iteration=opts.iteration,
        tokenizer_model=opts.tokenizer_model,
        embedding_type=opts.embedding_type,
        verify=opts.verify,
        progress=opts.progress,
    )
    cfg = loaded.model_config
    tied = cfg.embedding.tied
    vocab_rows = cfg.vocab_size if opts.keep_padded_vocab else loaded.tokenizer.vocab_size
    keep_lev = opts.hf_format == "leviathan"
    if keep_lev and cfg.embedding.embedding_type != "lev":
        raise ConversionError(
            f"--hf-format leviathan keeps LEV, but {display_path(loaded.run.path)} holds a "
            f"--embedding-type {cfg.embedding.embedding_type} model; use --hf-format llama"
        )
    table = None
    if not keep_lev:
        # Computed in compute_dtype, kept in the stored dtype: one [V, D] table.
        table = materialize_module_table(
            loaded.model.embedding.word_embeddings,
            compute_dtype=opts.compute_dtype,
            dtype=opts.dtype,
            progress=opts.progress,
        )
    state = to_hf_state_dict(
        loaded.full,
        table,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        tied=tied,
        vocab_rows=vocab_rows,
        rotary_interleaved=bool(getattr(loaded.model.config, "rotary_interleaved", False)),
    )
    state = {k: v.to(opts.dtype).contiguous() for k, v in state.items()}
    config = hf_config(
        cfg,
        vocab_size=vocab_rows,
        tied=tied,
        dtype=opts.dtype,
        tokenizer=loaded.tokenizer,
        provenance=provenance(loaded, vocab_rows, opts),
        lev_config=cfg.embedding.lev if keep_lev else None,
    )
    with atomic_output_dir(opts.output, opts.overwrite) as tmp:
        config.save_pretrained(tmp)
        if keep_lev:
            write_remote_code(tmp)
        GenerationConfig(
            eos_token_id=loaded.tokenizer.eod,
            pad_token_id=loaded.tokenizer.pad,
            do_sample=False,
        ).save_pretrained(tmp)
        write_safetensors(state, tmp, max_shard_size=opts.max_shard_size, progress=opts.progress)
        if opts.export_tokenizer:
            export_tokenizer(loaded.tokenizer, tmp)
    return os.path.abspath(opts.output)
