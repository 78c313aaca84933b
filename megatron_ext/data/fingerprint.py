"""Which tokenizer made a dataset or a checkpoint, and the check where two of them meet.

Every tokenizer has a ``fingerprint`` (a digest of its model files, type and vocabulary),
recorded beside every dataset the project writes as ``<prefix>_tokenizer.json`` (the sidecar,
written before the ``.idx``) and in every checkpoint's ``args.json``. They are compared when
training, evaluation or merging brings two together; datasets without a sidecar (stock
Megatron-LM's) load with one warning.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Optional, Sequence

from megatron_ext._paths import atomic_write
from megatron_ext.data.readers import DataError

logger = logging.getLogger(__name__)

__all__ = [
    "SIDECAR_SUFFIX",
    "TokenizerMismatchError",
    "check_dataset_tokenizers",
    "common_record",
    "read_sidecar",
    "place_sidecar",
    "sidecar_path",
    "tokenizer_record",
]

SIDECAR_SUFFIX = "_tokenizer.json"


class TokenizerMismatchError(DataError):
    """A dataset, counts file or checkpoint was made with another tokenizer."""


def tokenizer_record(tokenizer) -> dict:
    """What a sidecar records of `tokenizer` (a `Tokenizer`)."""
    return {
        "fingerprint": tokenizer.fingerprint,
        "type": tokenizer.type_name,
        "model": None if tokenizer.model_path is None else os.path.basename(tokenizer.model_path),
        "vocab_size": int(tokenizer.vocab_size),
        "eod": int(tokenizer.eod),
        "pad": tokenizer.pad,
    }


def describe(record: dict) -> str:
    """``SentencePieceTokenizer tok.model (fingerprint 0123...)`` for error messages."""
    model = f" {record['model']}" if record.get("model") else ""
    return f"{record.get('type', '?')}{model} (fingerprint {record.get('fingerprint')})"


def sidecar_path(prefix: str) -> str:
    """``<prefix>_tokenizer.json``: the tokenizer record of the dataset ``prefix``."""
    return prefix + SIDECAR_SUFFIX


def place_sidecar(prefix: str, record: Optional[dict]) -> None:
    """Write (atomically) the tokenizer record of the dataset ``prefix``, or with None remove
    it (an overwritten dataset must not keep another tokenizer's record)."""
    path = sidecar_path(prefix)
    if record is None:
        if os.path.exists(path):
            os.remove(path)
        return
    atomic_write(path, json.dumps(record, indent=1, sort_keys=True) + "\n")


def read_sidecar(prefix: str) -> Optional[dict]:
    """The tokenizer record of the dataset ``prefix``, or None without a sidecar; DataError
    when the sidecar is not a tokenizer record."""
    path = sidecar_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as handle:
            record = json.load(handle)
    except (OSError, ValueError) as error:
        raise DataError(
            f"{path}: unreadable tokenizer record ({error}); delete it to skip the tokenizer "
            "check, or re-run tools/preprocess_data.py"
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get("fingerprint"), str):
        raise DataError(
            f"{path}: not a tokenizer record (no 'fingerprint'); delete it to skip the "
            "tokenizer check, or re-run tools/preprocess_data.py"
        )
    return record


def common_record(prefixes: Sequence[str]) -> Optional[dict]:
    """The one tokenizer record shared by the datasets `prefixes` (for a merge's output); None
    (with one warning) when some input has none; TokenizerMismatchError when two differ."""
    records = [(prefix, read_sidecar(prefix)) for prefix in prefixes]
    known = [(prefix, record) for prefix, record in records if record is not None]
    for prefix, record in known[1:]:
        if record["fingerprint"] != known[0][1]["fingerprint"]:
            raise TokenizerMismatchError(
                f"cannot merge datasets made with different tokenizers: {prefix} was made with "
                f"{describe(record)}, {known[0][0]} with {describe(known[0][1])}"
            )
    missing = [prefix for prefix, record in records if record is None]
    if missing:
        _warn_unchecked(missing)
        return None
    return known[0][1] if known else None


def check_dataset_tokenizers(
    prefixes: Sequence[str], expected: Optional[dict], against: str, fix: str
) -> None:
    """Raise TokenizerMismatchError when a dataset of `prefixes` was made with another tokenizer
    than the record `expected` (None: unknown, nothing to check); the message names `against`
    (what `expected` is) and ends with `fix`. Datasets without a sidecar pass with one warning."""
    if expected is None:
        return
    missing = []
    for prefix in dict.fromkeys(prefixes):
        record = read_sidecar(prefix)
        if record is None:
            missing.append(prefix)
        elif record["fingerprint"] != expected["fingerprint"]:
            raise TokenizerMismatchError(
                f"{prefix} was tokenized with {describe(record)} but {against} is "
                f"{describe(expected)}; {fix}"
            )
    if missing:
        _warn_unchecked(missing)


def _warn_unchecked(prefixes: Sequence[str]) -> None:
    shown = ", ".join(prefixes[:3]) + (
        f" and {len(prefixes) - 3} more" if len(prefixes) > 3 else ""
    )
    logger.warning(
        "the tokenizer of %s cannot be checked: no %s beside it (made by stock Megatron-LM or "
        "before tokenizer fingerprints); make sure it was preprocessed with this tokenizer",
        shown,
        SIDECAR_SUFFIX,
    )
