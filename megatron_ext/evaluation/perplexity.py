"""Loss and perplexity over a whole token stream: an indexed dataset, raw text or jsonl files,
or exactly the batches the training loop validates on.

Packing (indexed datasets and text): documents, each ending with its EOD token, are
concatenated into one stream and cut into sequences of `seq_length + 1` tokens that overlap by
one token, as Megatron's GPTDataset does: every token except the stream's first is a target
exactly once, and the last, partial sequence is included (padded and masked). Position ids
count from 0 in every sequence, as in training.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from megatron_ext.data.indexed import get_bin_path, get_idx_path, load_dataset, num_tokens
from megatron_ext.data.loading import build_train_valid_test_datasets
from megatron_ext.data.readers import iter_lines
from megatron_ext.evaluation.outputs import EvaluationError, read_text_file
from megatron_ext.evaluation.scoring import Batch, micro_batches

__all__ = [
    "LossTotals",
    "dataset_documents",
    "loop_validation_batches",
    "pack_stream",
    "text_documents",
]


@dataclass
class LossTotals:
    """Sum of token losses and token count; a `TokenConsumer`."""

    loss_sum: float = 0.0
    tokens: int = 0

    def update(self, targets: np.ndarray, losses: np.ndarray) -> None:
        """Add the losses of scored targets; targets: [n] ids, losses: [n] nats."""
        self.loss_sum += float(np.sum(losses, dtype=np.float64))
        self.tokens += int(len(targets))

    @property
    def loss(self) -> float:
        """Mean loss per token in nats (NaN before any token)."""
        return self.loss_sum / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        """exp(mean loss) (NaN before any token)."""
        return math.exp(self.loss) if self.tokens else float("nan")

    def as_dict(self) -> dict:
        """Token count, mean loss and perplexity as a dict."""
        return {"tokens": self.tokens, "loss": self.loss, "perplexity": self.perplexity}


def pack_stream(
    documents: Iterable[np.ndarray], seq_length: int, micro_batch_size: int
) -> Iterator[Batch]:
    """Micro-batches [b, seq_length] of the concatenated `documents` (token id arrays, each
    already ending with its EOD where wanted; see the module docstring)."""
    if seq_length < 1 or micro_batch_size < 1:
        raise ValueError("seq_length and micro_batch_size must be >= 1")

    def rows() -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        buffer = np.zeros(0, dtype=np.int64)
        for document in documents:
            buffer = np.concatenate([buffer, np.asarray(document, dtype=np.int64)])
            while len(buffer) > seq_length:
                yield buffer[:seq_length], buffer[1 : seq_length + 1], 0
                buffer = buffer[seq_length:]  # the last target is the next sequence's first input
        if len(buffer) > 1:
            yield buffer[:-1], buffer[1:], 0

    return micro_batches(rows(), seq_length, micro_batch_size)


def dataset_documents(prefix: str) -> tuple[Iterator[np.ndarray], int]:
    """The documents of the indexed dataset `prefix` and its total token count."""
    for path in (get_idx_path(prefix), get_bin_path(prefix)):
        if not os.path.isfile(path):
            raise EvaluationError(
                f"evaluation dataset {path} does not exist; give the prefix of a dataset made "
                "by tools/preprocess_data.py (without .bin/.idx)"
            )
    total = num_tokens(prefix)
    if total < 2:
        raise EvaluationError(f"evaluation dataset {prefix} holds {total} tokens; nothing to score")
    dataset = load_dataset(prefix)
    return (np.asarray(dataset[i]) for i in range(len(dataset))), total


def _read_texts(path: str, json_key: str, encoding: str) -> Iterator[str]:
    if path.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")):
        for number, line in iter_lines(path):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record[json_key]
            except (ValueError, KeyError, TypeError):
                raise EvaluationError(
                    f"{path}:{number}: not a JSON object with a {json_key!r} string "
                    "(choose the key with --json-key)"
                ) from None
            yield str(text)
    else:
        yield read_text_file(path, encoding)


def text_documents(
    paths: Sequence[str], tokenizer, json_key: str = "text", encoding: str = "utf-8"
) -> tuple[list[np.ndarray], int]:
    """Tokenised documents (EOD appended) of raw text files (one document each, decoded with
    ``encoding``) or jsonl files (one document per line, UTF-8 as JSON requires), and their
    total token count."""
    documents = []
    for path in paths:
        if not os.path.isfile(path):
            raise EvaluationError(f"evaluation text {path} does not exist")
        texts = [t for t in _read_texts(path, json_key, encoding) if t.strip()]
        for ids in tokenizer.encode_batch(texts) if texts else []:
            documents.append(np.asarray([*ids, tokenizer.eod], dtype=np.int64))
    total = sum(len(d) for d in documents)
    if total < 2:
        raise EvaluationError(f"{', '.join(paths)}: no text to evaluate (empty files?)")
    return documents, total


def loop_validation_batches(run, tokenizer, micro_batch_size: int, split: str = "valid"):
    """The samples the training loop validated on: the first --eval-iters global batches of the
    run's valid (or test) split, built from the run's own data flags.

    Returns:
        (batches, number of target tokens); raises EvaluationError if the run had no such set.
    """
    try:
        recorded = run.run_config()  # the run's batch, evaluation and data flags
    except ValueError as error:  # args.json of no training run (an import-hf checkpoint)
        raise EvaluationError(f"{run.path}: no training run to validate ({error})") from None
    eval_iters, gbs = recorded.eval.eval_iters, recorded.batch.global_batch_size
    if eval_iters == 0:
        raise EvaluationError(f"{run.path}: the run used --eval-iters 0 and has no {split} set")
    data_config = dataclasses.replace(recorded.data, num_dataset_builder_threads=1)
    num_samples = [recorded.batch.train_iters * gbs, eval_iters * gbs, eval_iters * gbs]
    seq = recorded.model.seq_length
    datasets = build_train_valid_test_datasets(
        data_config, tokenizer, num_samples, seq_length=seq, seed=recorded.seed
    )
    dataset = datasets[1 if split == "valid" else 2]
    needed = eval_iters * gbs
    if dataset is None or len(dataset) < needed:
        raise EvaluationError(
            f"the run's {split} split has fewer than --eval-iters x --global-batch-size = "
            f"{needed} samples; evaluate a whole dataset with --data-path instead"
        )
    use_mask = recorded.data.reset_attention_mask

    def batches() -> Iterator[Batch]:
        for first in range(0, needed, micro_batch_size):
            samples = [dataset[i] for i in range(first, min(first + micro_batch_size, needed))]
            stacked = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]}
            yield Batch(
                *(stacked[k] for k in ("tokens", "labels", "loss_mask", "position_ids")),
                attention_mask=stacked.get("attention_mask") if use_mask else None,
            )

    return batches(), needed * seq
