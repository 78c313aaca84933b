"""The loader side: a training checkpoint (any arm, any saved layout) as full tensors.

The checkpoint is loaded into the TP=1, PP=1 model in this process (DCP reshards on load), the
parameters gathered under their single-stage names, and the arm's input module materialised
into an ordinary [V, D] table: LEV, ALBERT, FLAT-MLP and FACTORED-MLP are pure functions of the
token id, so the table reproduces them exactly (up to the rounding of its dtype).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm import tqdm

from megatron_ext._paths import display_path
from megatron_ext.config.data import padded_vocab_size
from megatron_ext.conversion.common import ConversionError
from megatron_ext.inference.loading import (
    find_checkpoint,
    init_inference_parallel,
    load_model,
    run_model_config,
    run_tokenizer,
)
from megatron_ext.lev.layer import LEVEmbedding
from megatron_ext.lev.table import LEVTable
from megatron_ext.models.full_state_dict import gather_full_state_dict

__all__ = [
    "ExportOptions",
    "LoadedCheckpoint",
    "SourceOptions",
    "load_checkpoint_full",
    "materialize_module_table",
]

logger = logging.getLogger(__name__)

# Ids per step of the materialisation (bounds the LEV intermediates to a few hundred MB).
_TABLE_CHUNK = 8192


@dataclass(frozen=True)
class SourceOptions:
    """What every converter of a training checkpoint takes: the run it reads, what it writes."""

    load: str
    """A run's --save directory, or one iter_XXXXXXX in it."""
    output: str
    iteration: Optional[int] = None
    """The checkpoint to read (default: the latest)."""
    tokenizer_model: Optional[str] = None
    """The run's tokenizer, if not where the run recorded it."""
    overwrite: bool = False
    progress: bool = True
    verify: bool = True
    """Check the source against its digests first (--no-verify-checkpoint turns it off)."""


@dataclass(frozen=True)
class ExportOptions(SourceOptions):
    """An export's source and dtypes."""

    dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float64
    """Precision of the materialised input table before the cast to `dtype`."""
    embedding_type: Optional[str] = None
    """Refuse the checkpoint unless it holds this arm."""


@dataclass
class LoadedCheckpoint:
    """A checkpoint loaded at TP=1, PP=1 in this process."""

    run: object
    """The `SavedRun` (args, iteration, path)."""
    model: torch.nn.Module
    """The eval-mode TP=1 model with the checkpoint's weights (float32)."""
    model_config: object
    """Its `ModelConfig`."""
    full: dict
    """Every parameter under its single-stage name (float32, on CPU)."""
    tokenizer: object
    """The run's tokenizer."""

    @property
    def embedding_type(self) -> str:
        """The checkpoint's arm (`model_config.embedding.embedding_type`: tied, lev, ...)."""
        return self.model_config.embedding.embedding_type


def load_checkpoint_full(
    load_dir: str,
    *,
    iteration: Optional[int] = None,
    tokenizer_model: Optional[str] = None,
    embedding_type: Optional[str] = None,
    verify: bool = True,
    progress: bool = True,
) -> LoadedCheckpoint:
    """Load `load_dir` (a `--save` directory or one iter_XXXXXXX) at TP=1 in this process,
    its digests checked first (`verify`); `embedding_type`: the arm the caller expects;
    `tokenizer_model`: instead of the run's. Every problem is one ConversionError,
    CheckpointError or TokenizerError.
    """
    run = find_checkpoint(load_dir, iteration, verify=verify, progress=progress)
    saved = run.embedding_type
    if embedding_type is not None and embedding_type != saved:
        raise ConversionError(
            f"{display_path(run.path)} holds a --embedding-type {saved} model, not "
            f"{embedding_type}; drop --embedding-type or point at the right checkpoint"
        )
    tokenizer = run_tokenizer(run, tokenizer_model)
    divisible = run.data.make_vocab_size_divisible_by
    tp = run.common.get("layout", {}).get("tp", 1)
    expected = padded_vocab_size(tokenizer.vocab_size, divisible, tp)
    if expected != run.padded_vocab_size():
        raise ConversionError(
            f"tokenizer {tokenizer.model_path} has {tokenizer.vocab_size} ids (padded to "
            f"{expected}) but {display_path(run.path)} embeds {run.padded_vocab_size()}: it is "
            "not the run's tokenizer; pass the right --tokenizer-model"
        )
    try:
        config = run_model_config(run)
    except ValueError as error:
        raise ConversionError(f"{display_path(run.path)}/args.json: {error}") from None
    pg = init_inference_parallel(1, 1)
    logger.info("loading %s at TP=1", display_path(run.path))
    model = load_model(run, config, pg)
    full = gather_full_state_dict(model, pg.tp)
    logger.info(
        "loaded %s (--embedding-type %s, iteration %d, saved at %s)",
        display_path(run.path),
        saved,
        run.iteration,
        run.common.get("layout"),
    )
    return LoadedCheckpoint(run, model, config, full, tokenizer)


@torch.no_grad()
def materialize_module_table(
    module: torch.nn.Module,
    *,
    compute_dtype: torch.dtype = torch.float64,
    dtype: Optional[torch.dtype] = None,
    progress: bool = True,
) -> torch.Tensor:
    """Run a TP=1 input module on every id: [V, D] computed in `compute_dtype`, stored in
    `dtype` (default: `compute_dtype`). LEV is computed chunk by chunk into one table of `dtype`;
    the other generated arms run on a temporary copy of their parameters. A lookup table is
    returned as it is (sharing the weight's storage: do not modify it), or copied into `dtype`."""
    if hasattr(module, "weight") and not list(module.children()):
        return module.weight.detach().to(dtype or module.weight.dtype)
    vocab = module.vocab_size if hasattr(module, "vocab_size") else module.num_embeddings
    dtype = dtype or compute_dtype
    bar_title = "materialising input table"
    if isinstance(module, LEVEmbedding):
        builder = LEVTable(module.lev_config, dict(module.named_parameters()), dtype=compute_dtype)
        out = torch.empty(vocab, builder.hidden_size, dtype=dtype, device=builder.device)
        with tqdm(total=vocab, desc=bar_title, unit="id", disable=not progress) as bar:
            return builder.table(out=out, progress=bar.update).cpu()
    device = next(module.parameters()).device
    saved = {name: p.data for name, p in module.named_parameters()}
    for p in module.parameters():
        p.data = p.data.to(compute_dtype)
    was_training = module.training
    module.eval()
    rows = []
    try:
        with tqdm(total=vocab, desc=bar_title, unit="id", disable=not progress) as bar:
            for start in range(0, vocab, _TABLE_CHUNK):
                ids = torch.arange(start, min(start + _TABLE_CHUNK, vocab), device=device)
                rows.append(module(ids[None, :])[0].to(dtype).cpu())
                bar.update(ids.numel())
    finally:
        for name, p in module.named_parameters():
            p.data = saved[name]
        module.train(was_training)
    return torch.cat(rows)
