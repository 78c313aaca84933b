"""Writing Megatron-Core indexed datasets (``.bin``/``.idx``) and their token counts, safely.

The format is Megatron-Core's: the ``.idx`` in its ``_IndexWriter``'s layout (written and read
here without importing megatron.core), the ``.bin`` the concatenated token ids; one document is
one sequence. Beside them ``<prefix>_counts.npy`` (int64 count of every id) and
``<prefix>_tokenizer.json`` (``data/fingerprint.py``). Every file is written under a temporary
name and renamed when complete, counts and tokenizer record first, ``.idx`` last, so a dataset
whose ``.idx`` exists is whole. ``check_dataset`` checks that a pair agrees (header, sizes,
pointers, document indices) before anything reads it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import struct
import warnings
from types import ModuleType
from typing import Optional

import numpy as np

from megatron_ext._paths import atomic_path
from megatron_ext.data.fingerprint import common_record, place_sidecar
from megatron_ext.data.readers import DataError

logger = logging.getLogger(__name__)

__all__ = [
    "check_dataset",
    "token_dtype",
    "counts_path",
    "dataset_files",
    "DatasetWriter",
    "read_counts",
    "merge_datasets",
    "load_dataset",
    "num_tokens",
    "index_header",
    "sampled_max_id",
]


def token_dtype(vocab_size: int) -> type:
    """uint16 when every id fits (vocab_size <= 65,536), else int32 (Megatron-Core's rule)."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def counts_path(prefix: str) -> str:
    """Path of the token-count file beside the dataset ``prefix``."""
    return f"{prefix}_counts.npy"


def dataset_files(prefix: str) -> list[str]:
    """The three files that make up a finished dataset."""
    return [get_bin_path(prefix), get_idx_path(prefix), counts_path(prefix)]


@functools.lru_cache(maxsize=None)
def mcore_datasets() -> ModuleType:
    """megatron.core.datasets with the modules the data package uses, imported on first use
    (they import all of megatron.core, seconds of start-up) without the CPU-only Apex/TE
    warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
        # deferred: keeps megatron and torch (slow) out of the data modules' import
        import megatron_ext.megatron_import  # noqa: F401

        from megatron.core import datasets
        from megatron.core.datasets import (  # noqa: F401 (loaded as attributes of `datasets`)
            blended_megatron_dataset_builder,
            blended_megatron_dataset_config,
            gpt_dataset,
            indexed_dataset,
            utils,
        )
    return datasets


def get_bin_path(prefix: str) -> str:
    """Megatron's data file name for ``prefix``."""
    return prefix + ".bin"


def get_idx_path(prefix: str) -> str:
    """Megatron's index file name for ``prefix``."""
    return prefix + ".idx"


# Megatron-Core's .idx layout (indexed_dataset._INDEX_HEADER, DType codes, _IndexWriter.write).
_INDEX_HEADER = b"MMIDIDX\x00\x00"
_DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}
_HEADER_BYTES = len(_INDEX_HEADER) + 8 + 1 + 8 + 8  # magic, version, dtype, counts
_CODE_NAMES = {code: np.dtype(t).name for t, code in _DTYPE_CODES.items()}
_CHECK_CHUNK = 1 << 22  # index entries checked at a time (bounds the memory)
_FIX = "copy the dataset again or re-run tools/preprocess_data.py"


def check_dataset(prefix: str) -> int:
    """Check that the dataset ``prefix`` is whole and its ``.bin`` and ``.idx`` agree (header,
    sizes, pointers, document indices) in one chunked pass over the ``.idx``; its token count.
    DataError: one line naming the file and what is wrong."""
    idx_path, bin_path = get_idx_path(prefix), get_bin_path(prefix)
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise DataError(f"dataset not found: {path} is missing")
    dtype, sequences, documents = index_header(prefix)
    tokens = _check_sequences(idx_path, sequences, dtype.itemsize)
    bin_size, bin_expected = os.path.getsize(bin_path), tokens * dtype.itemsize
    if bin_size != bin_expected:
        what = "shorter" if bin_size < bin_expected else "longer"
        raise DataError(
            f"{bin_path} is {what} than its index describes ({bin_size} bytes, "
            f"{idx_path} describes {tokens} {dtype.name} tokens = {bin_expected} bytes; an "
            f"interrupted copy, or the .bin of another dataset); {_FIX}"
        )
    _check_documents(idx_path, sequences, documents)
    return tokens


def index_header(prefix: str) -> tuple[np.dtype, int, int]:
    """(token dtype, sequences, document indices) of the ``.idx`` header of ``prefix``, which
    must describe the index's size; DataError naming what is wrong."""
    idx_path = get_idx_path(prefix)
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as handle:
        header = handle.read(_HEADER_BYTES)
    if len(header) < _HEADER_BYTES:
        raise DataError(f"{idx_path} is truncated ({idx_size} bytes, less than a header); {_FIX}")
    if header[: len(_INDEX_HEADER)] != _INDEX_HEADER:
        raise DataError(
            f"{idx_path} is not a Megatron indexed-dataset index (its first bytes are "
            f"{header[: len(_INDEX_HEADER)]!r}, not {_INDEX_HEADER!r}); {_FIX}"
        )
    version, code, sequences, documents = struct.unpack("<QBQQ", header[len(_INDEX_HEADER) :])
    if version != 1:
        raise DataError(f"{idx_path} has index version {version}; this reader knows version 1")
    if code not in _CODE_NAMES:
        known = ", ".join(f"{c} {n}" for c, n in sorted(_CODE_NAMES.items()))
        raise DataError(f"{idx_path} has token dtype code {code}, not one of {known}; {_FIX}")
    expected = _HEADER_BYTES + 12 * sequences + 8 * documents
    if idx_size not in (expected, expected + sequences):  # (+ modes: a multimodal index)
        what = "truncated" if idx_size < expected else "longer than its header describes"
        raise DataError(
            f"{idx_path} is {what} ({idx_size} bytes; {sequences} sequences and {documents} "
            f"document indices take {expected}); {_FIX}"
        )
    if documents == 0:
        raise DataError(f"{idx_path} has no document indices (at least [0] is needed); {_FIX}")
    return np.dtype(_CODE_NAMES[code]), sequences, documents


def _index_arrays(idx_path: str, sequences: int, documents: int) -> tuple[np.ndarray, ...]:
    """Memory maps of the index's sequence lengths, sequence pointers and document indices."""
    lengths = np.memmap(idx_path, np.int32, "r", _HEADER_BYTES, (sequences,))
    pointers = np.memmap(idx_path, np.int64, "r", _HEADER_BYTES + 4 * sequences, (sequences,))
    docs = np.memmap(idx_path, np.int64, "r", _HEADER_BYTES + 12 * sequences, (documents,))
    return lengths, pointers, docs


def _check_sequences(idx_path: str, sequences: int, itemsize: int) -> int:
    """Every sequence's length and pointer (chunk by chunk); returns the token count."""
    lengths, pointers, _ = _index_arrays(idx_path, sequences, 0)
    tokens = 0
    for start in range(0, sequences, _CHECK_CHUNK):
        part = np.asarray(lengths[start : start + _CHECK_CHUNK], dtype=np.int64)
        if part.size and part.min() < 0:
            bad = start + int(np.argmin(part))
            raise DataError(f"{idx_path}: sequence {bad} has a negative length; {_FIX}")
        expected_pointers = (tokens + np.cumsum(part) - part) * itemsize
        wrong = np.flatnonzero(pointers[start : start + _CHECK_CHUNK] != expected_pointers)
        if wrong.size:
            bad = start + int(wrong[0])
            raise DataError(
                f"{idx_path}: sequence {bad} points at byte {int(pointers[bad])} of the .bin, "
                f"not {int(expected_pointers[wrong[0]])} where it starts; {_FIX}"
            )
        tokens += int(part.sum())
    del lengths, pointers
    return tokens


def _check_documents(idx_path: str, sequences: int, documents: int) -> None:
    """The document indices run from 0 up to `sequences`, never decreasing."""
    docs = _index_arrays(idx_path, sequences, documents)[2]
    previous = 0
    for start in range(0, documents, _CHECK_CHUNK):
        part = np.asarray(docs[start : start + _CHECK_CHUNK])
        steps = np.diff(part, prepend=previous)
        outside = np.flatnonzero((part < 0) | (part > sequences) | (steps < 0))
        if outside.size or (start == 0 and part[0] != 0):
            bad = start + (int(outside[0]) if outside.size else 0)
            raise DataError(
                f"{idx_path}: document index {bad} is {int(docs[bad])}, out of range (document "
                f"boundaries run from 0 up to the {sequences} sequences); {_FIX}"
            )
        previous = int(part[-1])
    if previous != sequences:
        raise DataError(
            f"{idx_path}: the last document index is {previous}, not the {sequences} sequences "
            f"(out of range); {_FIX}"
        )
    del docs


def _write_index(
    path: str, dtype: type, lengths: np.ndarray, document_indices: Optional[np.ndarray] = None
) -> None:
    """The .idx Megatron-Core's ``_IndexWriter`` writes, byte for byte, without importing
    megatron.core (seconds of start-up); `document_indices` default: one document per sequence."""
    lengths = np.asarray(lengths, dtype=np.int32)
    if document_indices is None:
        document_indices = np.arange(len(lengths) + 1, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(path, "wb") as handle:
        handle.write(_INDEX_HEADER)
        handle.write(
            struct.pack("<QBQQ", 1, _DTYPE_CODES[dtype], len(lengths), len(document_indices))
        )
        handle.write(lengths.tobytes(order="C"))
        handle.write(pointers.tobytes(order="C"))
        handle.write(np.asarray(document_indices, dtype=np.int64).tobytes(order="C"))


def _save_npy(path: str, array: np.ndarray) -> None:
    # A file object, so numpy does not append a second ".npy" to the temporary name.
    with open(path, "wb") as handle:
        np.save(handle, array, allow_pickle=False)


class DatasetWriter:
    """Stream documents into the indexed dataset ``prefix`` plus its token counts (`vocab_size`
    sets the dtype and the counts' length) and `tokenizer_record` (None: none, a stale one removed).
    """

    def __init__(
        self, prefix: str, vocab_size: int, tokenizer_record: Optional[dict] = None
    ) -> None:
        self.prefix = prefix
        self.tokenizer_record = tokenizer_record
        self.vocab_size = int(vocab_size)
        self.dtype = token_dtype(self.vocab_size)
        # The stack renames in the reverse order of entry: counts, .bin, then the .idx.
        self._files = contextlib.ExitStack()
        self._idx, bin_path, self._counts = [
            self._files.enter_context(atomic_path(path))
            for path in (get_idx_path(prefix), get_bin_path(prefix), counts_path(prefix))
        ]
        self._bin = open(bin_path, "wb")
        self._lengths: list[np.ndarray] = []
        self.counts = np.zeros(self.vocab_size, dtype=np.int64)
        self.num_documents = 0
        self.num_tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: ``tokens`` concatenated (the writer's dtype), ``lengths`` per doc."""
        if len(lengths) == 0:
            return
        tokens = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(memoryview(tokens).cast("B"))
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self.counts += np.bincount(tokens, minlength=self.vocab_size)
        self.num_documents += len(lengths)
        self.num_tokens += int(tokens.size)

    def finalize(self) -> None:
        """Write the index and counts and move all three files to their final names."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int32)
        _write_index(self._idx, self.dtype, lengths)
        _save_npy(self._counts, self.counts)
        place_sidecar(self.prefix, self.tokenizer_record)
        self._files.close()

    def abort(self) -> None:
        """Remove the temporary files (idempotent)."""
        self._bin.close()
        # Unwound by an exception, each atomic_path removes its temporary file.
        self._files.__exit__(InterruptedError, InterruptedError(), None)


def read_counts(prefix: str) -> np.ndarray:
    """Token counts (int64, one per id) of the dataset ``prefix``."""
    path = counts_path(prefix)
    if not os.path.isfile(path):
        raise DataError(f"token counts not found: {path} (written by tools/preprocess_data.py)")
    return np.load(path, allow_pickle=False)


def merge_datasets(
    prefixes: list[str], output_prefix: str, overwrite: bool = False, require_counts: bool = True
) -> dict:
    """Concatenate indexed datasets (in the given order) into ``output_prefix`` and sum their
    counts, streamed (memory grows with the documents only); a summary dict.

    Raises:
        DataError: no or missing inputs, mixed dtypes or vocab sizes, existing output;
            TokenizerMismatchError: the inputs' tokenizer records differ.
    """
    if not prefixes:
        raise DataError("nothing to merge: no dataset prefixes given")
    for prefix in prefixes:
        check_dataset(prefix)  # every input is whole before anything is written
    existing = [path for path in dataset_files(output_prefix) if os.path.exists(path)]
    if existing and not overwrite:
        raise DataError(f"output exists: {existing[0]} (pass --overwrite to replace it)")
    record = common_record(prefixes)
    headers = [index_header(prefix) for prefix in prefixes]
    dtypes = {header[0] for header in headers}
    if len(dtypes) != 1:
        raise DataError(
            f"cannot merge datasets of different token dtypes: {sorted(map(str, dtypes))}"
        )
    counts = _summed_counts(prefixes, require_counts)
    outputs = [get_idx_path(output_prefix), get_bin_path(output_prefix)]
    with contextlib.ExitStack() as files:  # renamed in reverse: the .idx last
        tmp = [files.enter_context(atomic_path(path)) for path in outputs]
        if counts is not None:
            _save_npy(files.enter_context(atomic_path(counts_path(output_prefix))), counts)
        lengths, document_indices = _concatenate(prefixes, headers, tmp[1])
        _write_index(tmp[0], headers[0][0].type, lengths, document_indices)
        place_sidecar(output_prefix, record)
    summary = {
        "output_prefix": output_prefix,
        "inputs": list(prefixes),
        "documents": int(len(document_indices) - 1),
        "tokens": int(lengths.sum(dtype=np.int64)),
        "dtype": headers[0][0].name,
        "counts": counts is not None,
        "tokenizer": record,
    }
    logger.info(
        "merged %d datasets into %s: %d documents, %d tokens",
        len(prefixes),
        output_prefix,
        summary["documents"],
        summary["tokens"],
    )
    return summary


def _summed_counts(prefixes: list[str], require_counts: bool) -> Optional[np.ndarray]:
    """The inputs' token counts summed (None when some input has none and they are not
    required)."""
    have_counts = [os.path.isfile(counts_path(prefix)) for prefix in prefixes]
    if not all(have_counts):
        if require_counts:
            missing = prefixes[have_counts.index(False)]
            raise DataError(f"token counts not found: {counts_path(missing)}")
        return None
    counts = None
    for prefix in prefixes:
        part = read_counts(prefix)
        if counts is None:
            counts = part.astype(np.int64, copy=True)
        elif len(part) != len(counts):
            raise DataError(
                f"cannot merge datasets with different vocab sizes: {counts_path(prefix)} "
                f"has {len(part)} ids, {counts_path(prefixes[0])} has {len(counts)}"
            )
        else:
            counts += part
    return counts


def _concatenate(prefixes, headers, bin_path: str) -> tuple[np.ndarray, np.ndarray]:
    """Stream the inputs' .bin data into `bin_path`; returns the merged index's sequence lengths
    and document indices."""
    lengths_parts, docs_parts, offset = [], [np.zeros(1, dtype=np.int64)], 0
    with open(bin_path, "wb") as out:
        for prefix, (_, sequences, documents) in zip(prefixes, headers):
            with open(get_bin_path(prefix), "rb") as src:
                while block := src.read(1 << 24):
                    out.write(block)
            lengths, _, docs = _index_arrays(get_idx_path(prefix), sequences, documents)
            lengths_parts.append(np.array(lengths))
            docs_parts.append(np.array(docs[1:]) + offset)
            offset += sequences
            del lengths, docs
    return np.concatenate(lengths_parts), np.concatenate(docs_parts)


def load_dataset(prefix: str):
    """Open a finished dataset with Megatron-Core's reader (for tools and tests), after
    ``check_dataset``."""
    check_dataset(prefix)
    return mcore_datasets().indexed_dataset.IndexedDataset(prefix, multimodal=False, mmap=True)


def num_tokens(prefix: str) -> int:
    """Total stored tokens of the dataset ``prefix`` (from its index, checked by
    ``check_dataset``)."""
    return check_dataset(prefix)


_SAMPLE_BLOCKS = 64
_SAMPLE_BLOCK_BYTES = 1 << 20


def sampled_max_id(prefix: str) -> int:
    """The largest token id in a sample of the dataset ``prefix``'s ``.bin``: all of it up to
    64 MiB, else 64 evenly spaced 1 MiB blocks (first and last included). For datasets without
    counts (made by Megatron-LM): a cheap check that the tokenizer covers their ids. Call after
    `check_dataset`."""
    dtype = index_header(prefix)[0]
    if not os.path.getsize(get_bin_path(prefix)):
        return -1
    tokens = np.memmap(get_bin_path(prefix), dtype, "r")
    block = _SAMPLE_BLOCK_BYTES // dtype.itemsize
    if tokens.size <= _SAMPLE_BLOCKS * block:
        found = int(tokens.max())
    else:
        starts = np.linspace(0, tokens.size - block, _SAMPLE_BLOCKS).astype(np.int64)
        found = max(int(tokens[s : s + block].max()) for s in starts)
    del tokens
    return found
