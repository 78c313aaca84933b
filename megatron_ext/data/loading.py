"""Training data: GPT datasets of a `config.data.DataConfig` (Megatron-LM's data flags) built by
Megatron-Core's BlendedMegatronDatasetBuilder, from ``--data-path`` (with ``--split``), the
``--train/valid/test-data-path`` flags, or ``--mock-data``; samples as in Megatron-LM.
A single process without torch.distributed builds through a private one-rank gloo group
(Megatron-Core's BlendedDataset calls ``get_rank()``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch.distributed as dist

from megatron_ext.config.data import DataConfig, DataError
from megatron_ext.data.fingerprint import check_dataset_tokenizers, tokenizer_record
from megatron_ext.data.indexed import (
    check_dataset,
    counts_path,
    get_bin_path,
    get_idx_path,
    index_header,
    mcore_datasets,
    sampled_max_id,
    token_dtype,
)
from megatron_ext.data.tokenizers import Tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "DataConfig",
    "VocabSizeMismatchError",
    "blend_prefixes",
    "build_train_valid_test_datasets",
    "check_vocab_sizes",
    "dataset_vocab_size",
]


class VocabSizeMismatchError(DataError):
    """Tokenizer, dataset and model disagree on the vocabulary."""


def dataset_vocab_size(prefix: str) -> Optional[int]:
    """The vocab size a dataset was preprocessed with: the length of its ``_counts.npy``
    (None when there is no counts file)."""
    path = counts_path(prefix)
    if not os.path.isfile(path):
        return None
    return int(np.load(path, mmap_mode="r").shape[0])


def check_vocab_sizes(
    tokenizer_vocab: int,
    dataset_vocab: Optional[int] = None,
    model_vocab: Optional[int] = None,
    dataset_name: str = "dataset",
) -> None:
    """Raise a one-line VocabSizeMismatchError unless `dataset_vocab` (a dataset's counts length)
    equals `tokenizer_vocab` and `model_vocab` (padded) is at least it; None skips a check."""
    if dataset_vocab is not None and dataset_vocab != tokenizer_vocab:
        raise VocabSizeMismatchError(
            f"{dataset_name} was preprocessed with a vocab of {dataset_vocab} ids but the "
            f"tokenizer has {tokenizer_vocab}; use the tokenizer it was made with or "
            "re-run tools/preprocess_data.py"
        )
    if model_vocab is not None and model_vocab < tokenizer_vocab:
        raise VocabSizeMismatchError(
            f"model vocab size {model_vocab} is smaller than the tokenizer's {tokenizer_vocab}; "
            "set the model's vocab size from the tokenizer (padded_vocab_size)"
        )


def blend_prefixes(blend: Optional[Sequence[str]]) -> list[str]:
    """Dataset prefixes of a Megatron-LM blend (``[weight] prefix ...``), weights dropped."""
    parsed = mcore_datasets().utils.get_blend_from_list(list(blend)) if blend else None
    return list(parsed[0]) if parsed else []


def _split_in_documents(
    weights: Sequence[float], count: int, num_samples: Sequence[Optional[int]]
) -> Optional[str]:
    """A --split, in documents of a `count`-document dataset, that keeps the valid and test
    shares of `weights` but gives each split samples are wanted from at least one document
    (a split the user set to 0 stays 0); None when `count` is too small for that."""
    held_out = [
        max(int(weight * count), 1 if wanted and weight > 0 else 0)
        for weight, wanted in zip(weights[1:], num_samples[1:])
    ]
    train = count - sum(held_out)
    return f"{train},{held_out[0]},{held_out[1]}" if train >= 1 else None


def _check_datasets(
    config: DataConfig, tokenizer: Tokenizer, num_samples: Sequence[Optional[int]]
) -> None:
    split_config = mcore_datasets().blended_megatron_dataset_config
    names = ("train", "valid", "test")
    checks: list[tuple[str, Optional[tuple[float, float]], str]] = []
    weights: Sequence[float] = ()
    if config.data_path:
        weights = split_config.parse_and_normalize_split(config.split)
        matrix = split_config.convert_split_vector_to_split_matrix(weights)
        for prefix in blend_prefixes(config.data_path):
            for i, bookends in enumerate(matrix):
                if bookends is not None and num_samples[i]:
                    checks.append((prefix, bookends, names[i]))
            checks.append((prefix, None, ""))
    for i, paths in enumerate(
        (config.train_data_path, config.valid_data_path, config.test_data_path)
    ):
        for prefix in blend_prefixes(paths):
            checks.append((prefix, (0.0, 1.0) if num_samples[i] else None, names[i]))
    checked: set[str] = set()
    whole: set[str] = set()
    for prefix, bookends, split_name in checks:
        if not (os.path.isfile(get_idx_path(prefix)) and os.path.isfile(get_bin_path(prefix))):
            raise DataError(
                f"dataset not found: {prefix}.bin/.idx (a --data-path entry is the prefix "
                "without .bin/.idx, e.g. data/pile_text_document)"
            )
        if prefix not in whole:
            check_dataset(prefix)  # a damaged .bin/.idx is named here, before training
            whole.add(prefix)
        if bookends is not None:
            # Megatron-Core loops forever building samples from a split without tokens.
            count = index_header(prefix)[1]
            begin = int(round(bookends[0] * count))
            end = int(round(bookends[1] * count))
            if end <= begin:
                hint = _split_in_documents(weights, count, num_samples) if weights else None
                why = (
                    f"--split {config.split} gives it none of its {count} documents"
                    if weights
                    else "it holds no documents"
                )
                more = "use more data (tools/merge_datasets.py joins preprocessed shards)"
                fix = f"pass --split {hint} (documents per split) or {more}" if hint else more
                raise DataError(f"the {split_name} split of {prefix} is empty: {why}; {fix}")
        if prefix in checked:
            continue
        checked.add(prefix)
        counted_vocab = dataset_vocab_size(prefix)
        check_vocab_sizes(tokenizer.vocab_size, counted_vocab, None, prefix)
        if counted_vocab is None:  # no _counts.npy (made by Megatron-LM): look at its ids
            _check_ids_in_vocab(prefix, tokenizer)
        if index_header(prefix)[0] == np.uint16 and token_dtype(tokenizer.vocab_size) != np.uint16:
            raise VocabSizeMismatchError(
                f"{prefix} stores uint16 ids but the tokenizer has {tokenizer.vocab_size} ids; "
                "it was preprocessed with a different tokenizer"
            )
    check_dataset_tokenizers(
        sorted(checked),
        tokenizer_record(tokenizer),
        against="this run's tokenizer (--tokenizer-type/--tokenizer-model)",
        fix="pass the tokenizer the dataset was made with, or re-run tools/preprocess_data.py "
        "with this one",
    )


def _check_ids_in_vocab(prefix: str, tokenizer: Tokenizer) -> None:
    """Refuse a dataset whose ids (a sample of its .bin) the tokenizer does not have."""
    largest = sampled_max_id(prefix)
    if largest >= tokenizer.vocab_size:
        raise VocabSizeMismatchError(
            f"{prefix} holds token id {largest} but the tokenizer ({tokenizer.type_name}) has "
            f"only {tokenizer.vocab_size} ids: the dataset was made with another tokenizer; "
            "pass the tokenizer flags it was preprocessed with"
        )


class _DatasetTokenizer:
    """The attributes Megatron-Core's GPT datasets read from a tokenizer: ``pad`` is -1 (never
    matches) when the vocabulary has no padding id, as Megatron's own fallback."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod
        self.pad = -1 if tokenizer.pad is None else tokenizer.pad
        self.unique_identifiers: OrderedDict = tokenizer.unique_identifiers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


@contextlib.contextmanager
def _process_group_for_build(needed: bool) -> Iterator[None]:
    if not needed or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_train_valid_test_datasets(
    data_config: DataConfig,
    tokenizer: Tokenizer,
    train_val_test_num_samples: Sequence[Optional[int]],
    is_built_on_rank: Optional[Callable[[], bool]] = None,
    *,
    seq_length: int,
    seed: int,
) -> tuple[Any, Any, Any]:
    """(train, valid, test) GPT datasets from Megatron-Core's builder, `train_val_test_num_samples`
    samples of `seq_length` tokens per split (None: one epoch), shuffled from `seed`; None for a
    split, or where `is_built_on_rank` is False. DataError: no or a missing prefix;
    VocabSizeMismatchError: a dataset made with another vocabulary."""
    data_config.check_sources()
    mcore = mcore_datasets()
    gpt, get_blend_from_list = mcore.gpt_dataset, mcore.utils.get_blend_from_list
    if len(train_val_test_num_samples) != 3:
        raise ValueError("train_val_test_num_samples must have 3 entries")
    if not data_config.mock_data:
        _check_datasets(data_config, tokenizer, train_val_test_num_samples)
    per_split = [
        data_config.train_data_path,
        data_config.valid_data_path,
        data_config.test_data_path,
    ]
    use_per_split = any(per_split)
    gpt_config = gpt.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=get_blend_from_list(data_config.data_path) if data_config.data_path else None,
        blend_per_split=[get_blend_from_list(p) if p else None for p in per_split]
        if use_per_split
        else None,
        split=None if use_per_split else data_config.split,
        num_dataset_builder_threads=data_config.num_dataset_builder_threads,
        path_to_cache=data_config.data_cache_path,
        mmap_bin_files=data_config.mmap_bin_files,
        tokenizer=_DatasetTokenizer(tokenizer),
        reset_position_ids=data_config.reset_position_ids,
        reset_attention_mask=data_config.reset_attention_mask,
        eod_mask_loss=data_config.eod_mask_loss,
        create_attention_mask=data_config.create_attention_mask,
    )
    cls = gpt.MockGPTDataset if data_config.mock_data else gpt.GPTDataset
    if data_config.data_cache_path:
        os.makedirs(data_config.data_cache_path, exist_ok=True)
    blends = [data_config.data_path, *per_split]
    multi = any(len(blend_prefixes(b)) > 1 for b in blends if b)
    with _process_group_for_build(bool(data_config.data_cache_path) and multi):
        train, valid, test = mcore.blended_megatron_dataset_builder.BlendedMegatronDatasetBuilder(
            cls,
            list(train_val_test_num_samples),
            is_built_on_rank or (lambda: True),
            gpt_config,
        ).build()
    logger.info(
        "datasets: train %s, valid %s, test %s samples",
        *(None if ds is None else len(ds) for ds in (train, valid, test)),
    )
    return train, valid, test
