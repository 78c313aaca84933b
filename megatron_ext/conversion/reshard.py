"""reshard: rewrite a checkpoint offline for another TP/PP layout, or as one consolidated file.

Our checkpoints are layout-free (full tensors under single-stage names, see
`megatron_ext.checkpoint.format`), so any layout can already load any checkpoint; what a
layout change needs offline is the rest: the vocabulary padding (make-vocab-size-divisible-by x
TP) of the embedding, head and their optimizer moments, the layout recorded in common.json and
args.json (for --use-checkpoint-args), and the dropped per-rank RNG files. The tensors are
rewritten by one process into a single shard file (`__0_0.distcp`), with or without the
optimizer state. No process group is needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from tqdm import tqdm

from megatron_ext._paths import display_path
from megatron_ext.checkpoint.format import TRACKER_FILENAME, checkpoint_dir, save_tensors
from megatron_ext.checkpoint.io_errors import check_shard_files
from megatron_ext.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    pickled_entry_error,
    read_metadata,
)
from megatron_ext.config.data import padded_vocab_size
from megatron_ext.config.lev import smallest_base
from megatron_ext.conversion.common import (
    ConversionError,
    atomic_output_dir,
    new_output,
    resize_rows,
)
from megatron_ext.conversion.source import SourceOptions
from megatron_ext.inference.loading import (
    SavedRun,
    find_checkpoint,
    run_model_config,
    run_tokenizer,
)

__all__ = ["ReshardOptions", "reshard", "VOCAB_KEYS"]

logger = logging.getLogger(__name__)

# Parameters whose rows are the (padded) vocabulary.
VOCAB_KEYS = (
    "embedding.word_embeddings.weight",
    "embedding.word_embeddings.table.weight",
    "output_layer.weight",
)
# Keys read per DCP load call (bounds the progress granularity, not memory).
_READ_GROUP = 16


@dataclass(frozen=True)
class ReshardOptions(SourceOptions):
    """Arguments of `reshard`: the source, the TP x PP layout to write and whether to keep the
    optimizer state."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    keep_optimizer: bool = True


def _vocab_param(key: str) -> bool:
    name = key.split(".", 1)[1] if key.startswith("model.") else key
    if key.startswith("optim."):
        name = key[len("optim.") :].rsplit(".", 1)[0]
    return name in VOCAB_KEYS and not key.endswith(".step")


@contextlib.contextmanager
def _single_process():
    """DCP warns that it runs without a process group: that is the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _read_tensors(run: SavedRun, keep_optimizer: bool, progress: bool) -> dict[str, torch.Tensor]:
    """Every model tensor (and with `keep_optimizer` every optimizer tensor) of the checkpoint
    `run`, whole, read by this one process."""
    path = run.path
    metadata = read_metadata(os.path.join(path, ".metadata"))
    check_shard_files(run.root, path, run.iteration, metadata)
    metadata = metadata.state_dict_metadata
    pickled = [k for k, md in metadata.items() if not isinstance(md, TensorStorageMetadata)]
    if pickled:  # the project writes tensors only; DCP would unpickle these without limits
        raise pickled_entry_error(path, pickled[0])
    keys = [
        k for k in metadata if k.startswith("model.") or (keep_optimizer and k.startswith("optim."))
    ]
    state: dict[str, torch.Tensor] = {}
    bar = tqdm(total=len(keys), desc="reading tensors", unit="tensor", disable=not progress)
    for start in range(0, len(keys), _READ_GROUP):
        group = {
            k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype)
            for k in keys[start : start + _READ_GROUP]
        }
        with _single_process():
            dcp.load(
                group,
                storage_reader=SafeFileSystemReader(path),
                planner=SafeLoadPlanner(path),
                no_dist=True,
            )
        state.update(group)
        bar.update(len(group))
    bar.close()
    return state


def reshard(opts: ReshardOptions) -> str:
    """Write the resharded checkpoint (a new --save directory); returns its path."""
    output = new_output(opts.output, opts.overwrite)
    tp, pp = opts.tensor_model_parallel_size, opts.pipeline_model_parallel_size
    run = find_checkpoint(opts.load, opts.iteration, verify=opts.verify, progress=opts.progress)
    tokenizer = run_tokenizer(run, opts.tokenizer_model)
    old_padded = run.padded_vocab_size()
    new_padded = padded_vocab_size(tokenizer.vocab_size, run.data.make_vocab_size_divisible_by, tp)

    args = dict(run.args_json)
    args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if tp == 1:
        args["sequence_parallel"] = False
    lev = run.model.embedding.lev
    if run.embedding_type in ("lev", "factored-mlp"):
        # LEV's digit base follows from the padded vocabulary unless given: keep it fixed (the
        # codebooks keep their shape), and it must cover the new padding.
        base = args["lev_base"] = lev.base or smallest_base(old_padded, lev.num_digits)
        if base**lev.num_digits < new_padded:
            raise ConversionError(
                f"cannot lay the model out at TP={tp}: the vocabulary pads to {new_padded} ids, "
                f"more than LEV's {lev.num_digits} digits in base {base} cover "
                f"({base**lev.num_digits}); pick a TP size that pads it to fewer"
            )
    try:  # the layout must suit the model (heads, groups, layers divisible)
        run_model_config(
            dataclasses.replace(run, args_json=args),
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
        )
    except ValueError as error:
        raise ConversionError(f"cannot lay the model out at TP={tp}, PP={pp}: {error}") from None

    state = _read_tensors(run, opts.keep_optimizer, opts.progress)
    if new_padded != old_padded:
        logger.info("re-padding the vocabulary from %d to %d rows", old_padded, new_padded)
        for key in list(state):
            if _vocab_param(key):
                state[key] = resize_rows(state[key], new_padded)

    common = dict(run.common)
    common["layout"] = {"tp": tp, "pp": pp, "cp": 1, "dp": 1}
    common["has_optimizer"] = bool(opts.keep_optimizer and run.common.get("has_optimizer"))
    common["has_rng"] = False
    with atomic_output_dir(output, opts.overwrite) as tmp:
        target = checkpoint_dir(tmp, run.iteration)
        logger.info("writing %d tensors to %s", len(state), display_path(target))
        with _single_process():
            save_tensors(target, state, common, args)
        with open(os.path.join(tmp, TRACKER_FILENAME), "w") as handle:
            handle.write(f"{run.iteration}\n")
    return output
