"""Load a training checkpoint for evaluation, generation and conversion, at whatever TP x PP
layout the caller runs (TP=1 on one CPU process included)::

    run = find_checkpoint("ckpt/lev")                  # latest, or iteration=...
    pg = init_inference_parallel(tensor_model_parallel_size=1)
    model = load_model(run, run_model_config(run), pg)  # eval mode, weights loaded

`find_checkpoint` checks every file against the digests recorded at save time before anything
reads it; every problem with the directory is a one-line `CheckpointError`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import megatron_ext.megatron_import  # noqa: F401

import torch

from megatron_ext.checkpoint.format import (
    CheckpointError,
    checkpoint_dir,
    load_checkpoint,
    locate_checkpoint,
    verify_or_raise,
)
from megatron_ext.checkpoint.safe_load import read_metadata
from megatron_ext.config.arguments import (
    data_config_from_args_json,
    model_config_from_args_json,
    run_config_from_args_json,
)
from megatron_ext.config.data import DataConfig, DataError
from megatron_ext.config.layout import ParallelConfig, PrecisionConfig, check_layout
from megatron_ext.config.model import ModelConfig
from megatron_ext.config.run import RunConfig
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.models import build_model
from megatron_ext.parallel import ProcessGroups, destroy_parallel, initialize_parallel

logger = logging.getLogger(__name__)

__all__ = [
    "SavedRun",
    "find_checkpoint",
    "init_inference_parallel",
    "load_model",
    "run_model_config",
    "run_tokenizer",
]


@dataclass(frozen=True)
class SavedRun:
    """One complete checkpoint and what it says about the run that wrote it."""

    root: str
    """The run's `--save` directory (holds `latest_checkpointed_iteration.txt`)."""
    iteration: int
    path: str
    """`<root>/iter_XXXXXXX`."""
    args_json: dict
    """The run's flags as `args.json` records them (the file a resharded copy rewrites)."""
    common: dict
    """`common.json`: iteration, consumed samples, scheduler state, saved layout."""

    @cached_property
    def model(self) -> ModelConfig:
        """The model args.json records, its vocabulary None (`padded_vocab_size` has it)."""
        return self._read(model_config_from_args_json)

    @cached_property
    def data(self) -> DataConfig:
        """The data and tokenizer flags args.json records."""
        return self._read(data_config_from_args_json)

    def _read(self, reader):
        try:
            return reader(self.args_json)
        except (ValueError, DataError) as error:  # a value no config accepts, naming the flag
            raise CheckpointError(f"{self.path}/args.json: {error}") from None

    def run_config(self) -> RunConfig:
        """The training run args.json records; ValueError for import-hf's checkpoints."""
        return run_config_from_args_json(self.args_json)

    @property
    def embedding_type(self) -> str:
        """The run's `--embedding-type`."""
        return self.model.embedding.embedding_type

    def padded_vocab_size(self) -> int:
        """The vocabulary the saved model embeds and scores (padding included), read from the
        checkpoint's own tensor shapes, so it is right whatever layout wrote it."""
        metadata = read_metadata(os.path.join(self.path, ".metadata")).state_dict_metadata
        for key in ("model.output_layer.weight", "model.embedding.word_embeddings.weight"):
            if key in metadata:
                return int(metadata[key].size[0])
        raise CheckpointError(f"{self.path} holds no output layer or word embedding weights")


def find_checkpoint(
    load_dir: str,
    iteration: Optional[int] = None,
    *,
    verify: bool = True,
    progress: bool = False,
) -> SavedRun:
    """The complete checkpoint `iteration` (default: the latest) of `load_dir` (a `--save`
    directory, or one `iter_XXXXXXX`), checked against its digests (`verify`; collective when
    torch.distributed is initialised; `progress`: a progress bar on large checkpoints).

    Raises:
        CheckpointError: no such directory, no complete checkpoint, or one without args.json;
            CheckpointDigestError: a damaged file (naming it and an older one that verifies).
    """
    root, iteration = locate_checkpoint(load_dir, iteration)
    path = checkpoint_dir(root, iteration)
    needed = ("common.json", "args.json", ".metadata")
    missing = [f for f in needed if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise CheckpointError(
            f"{path} is not a complete checkpoint (missing {', '.join(missing)}); "
            "pick another iteration"
        )
    if verify:
        verify_or_raise(root, iteration, progress=progress, announce=False)
    else:
        logger.info("--no-verify-checkpoint: reading %s without checking its digests", path)
    try:
        with open(os.path.join(path, "common.json")) as handle:
            common = json.load(handle)
        with open(os.path.join(path, "args.json")) as handle:
            args_json = json.load(handle)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({error})") from None
    return SavedRun(root=root, iteration=iteration, path=path, args_json=args_json, common=common)


def run_tokenizer(run: SavedRun, tokenizer_model: Optional[str] = None):
    """The tokenizer the run trained with (any type training accepts), built from its args.json
    and checked against the fingerprint the checkpoint recorded (if any). `tokenizer_model`:
    where the tokenizer is now, if not where the run recorded it (for GPT-2 BPE, the directory
    holding its vocab and merge files)."""
    data = run.data
    if data.tokenizer_type is None:
        raise CheckpointError(f"{run.path}: the run recorded no --tokenizer-type")
    files = _tokenizer_files(data, tokenizer_model)
    tokenizer = build_tokenizer(
        data.tokenizer_type,
        files.get("tokenizer_model"),
        vocab_size=data.vocab_size,
        tiktoken_pattern=data.tiktoken_pattern,
        vocab_file=files.get("vocab_file"),
        merge_file=files.get("merge_file"),
    )
    model_path = " + ".join(v for v in files.values() if v) or data.tokenizer_type
    recorded = data.tokenizer_fingerprint
    if recorded is not None and recorded != tokenizer.fingerprint:
        cause = (
            "another tokenizer was given" if tokenizer_model else "the file changed after training"
        )
        raise CheckpointError(
            f"tokenizer {model_path} (fingerprint {tokenizer.fingerprint}) is not the run's "
            f"tokenizer: {run.path} was trained with fingerprint {recorded} ({cause}); pass "
            "the run's tokenizer with --tokenizer-model"
        )
    padded = run.padded_vocab_size()
    if tokenizer.vocab_size > padded:
        raise CheckpointError(
            f"tokenizer {model_path} has {tokenizer.vocab_size} ids but {run.path} embeds only "
            f"{padded}: it is not the run's tokenizer"
        )
    return tokenizer


def _tokenizer_files(data: DataConfig, override: Optional[str]) -> dict:
    """{flag dest: path} of the run's tokenizer files (`override` replacing where they were
    recorded), each checked to exist."""
    if data.tokenizer_type == "GPT2BPETokenizer":
        recorded = {"vocab_file": data.vocab_file, "merge_file": data.merge_file}
        if override is not None:
            if not os.path.isdir(override):
                raise CheckpointError(
                    f"--tokenizer-model {override}: a GPT2BPETokenizer run takes the directory "
                    "holding its vocab and merge files"
                )
            recorded = {
                dest: os.path.join(override, os.path.basename(path or default))
                for (dest, path), default in zip(recorded.items(), ("vocab.json", "merges.txt"))
            }
        hint = "pass --tokenizer-model DIR, the directory now holding them"
    elif data.tokenizer_type == "NullTokenizer":
        return {}
    else:
        recorded = {"tokenizer_model": override or data.tokenizer_model}
        hint = "pass --tokenizer-model"
    missing = [path for path in recorded.values() if path and not os.path.exists(path)]
    if missing:
        whose = "the given" if override is not None else "the run's"
        raise CheckpointError(
            f"{whose} tokenizer {' and '.join(missing)} does not exist (relative to "
            f"{os.getcwd()}); {hint}"
        )
    return recorded


def run_model_config(
    run: SavedRun,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    transformer_impl: Optional[str] = None,
):
    """The run's `ModelConfig` (from its args.json; dropout and recomputation off), checked
    against the TP x PP layout this process runs; `load_model` builds it there in float32,
    without sequence parallelism."""
    config = run.model
    if transformer_impl is None and not torch.cuda.is_available():
        transformer_impl = "local"
    config = config.replace(
        vocab_size=run.padded_vocab_size(),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        recompute_activations=False,
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        transformer_impl=transformer_impl or config.transformer_impl,
    )
    check_layout(
        config,
        ParallelConfig(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
        ),
    )
    return config


def init_inference_parallel(
    tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1
) -> "ProcessGroups":
    """This rank's groups at this layout, torch.distributed and megatron's groups initialised
    (under torchrun from its environment; a plain `python` is a one-rank world). Groups already
    at this layout are kept, others are rebuilt."""
    current = ProcessGroups.current()
    layout = (tensor_model_parallel_size, pipeline_model_parallel_size)
    if current is not None:
        if (current.tp_size, current.pp_size) == layout:
            return current
        destroy_parallel()
    return initialize_parallel(*layout)


def load_model(run: SavedRun, model_config, pg: "ProcessGroups") -> torch.nn.Module:
    """This rank's stage of the run's model (`model_config`: `run_model_config(run, ...)`) with
    the checkpoint's weights, in eval mode, built over `pg` at its TP x PP layout."""
    parallel = ParallelConfig(
        tensor_model_parallel_size=pg.tp_size, pipeline_model_parallel_size=pg.pp_size
    )
    # No initial values drawn (megatron's CPU init draws a full [V, D] master per vocabulary-
    # parallel weight: 3 GB at V = 200k, D = 2048): the load sets every parameter (strict_missing).
    model = build_model(
        model_config.replace(perform_initialization=False),
        parallel=parallel,
        precision=PrecisionConfig(),  # float32 master weights
        pre_process=pg.is_first_stage,
        post_process=pg.is_last_stage,
        pg=pg,
    )
    load_checkpoint(
        run.root,
        model,
        pg=pg,
        iteration=run.iteration,
        load_optim=False,
        load_rng=False,
        strict_missing=True,
        verify=False,  # find_checkpoint did
    )
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model.eval()
