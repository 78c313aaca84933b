"""Writing Megatron-Core indexed datasets (``.bin``/``.idx``) and their token counts, safely.

The format is Megatron-Core's: the ``.idx`` in its ``_IndexWriter``'s layout with vectorised
sequence pointers (without importing megatron.core), the ``.bin`` the concatenated token ids;
one document is one sequence. Beside them ``<prefix>_counts.npy`` (int64 count of every id) and
``<prefix>_tokenizer.json`` (``data/fingerprint.py``). Every file is written under a temporary
name and renamed when complete, counts and tokenizer record first, ``.idx`` last, so a dataset
whose ``.idx`` exists is whole; ``abort()`` removes the temporary files. ``check_dataset``
checks that a pair agrees (header, sizes, pointers, document indices) before anything reads it.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
import warnings
from types import ModuleType
from typing import Optional

import numpy as np

from megatron_ext.data.fingerprint import common_record, place_sidecar
from megatron_ext.data.readers import DataError

logger = logging.getLogger(__name__)

__all__ = [
    "TMP_SUFFIX",
    "check_dataset",
    "token_dtype",
    "counts_path",
    "dataset_files",
    "DatasetWriter",
    "read_counts",
    "merge_datasets",
    "load_dataset",
    "num_tokens",
    "index_dtype",
    "sampled_max_id",
]

TMP_SUFFIX = ".tmp"


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


@functools.lru_cache(maxsize=None)
def _fast_index_writer() -> type:
    """Megatron-Core's index writer with the sequence pointers computed by numpy."""

    class _FastIndexWriter(mcore_datasets().indexed_dataset._IndexWriter):
        def _sequence_pointers(self, sequence_lengths) -> np.ndarray:  # type: ignore[override]
            lengths = np.asarray(sequence_lengths, dtype=np.int64)
            pointers = np.zeros(len(lengths), dtype=np.int64)
            if len(lengths) > 1:
                np.cumsum(lengths[:-1] * np.dtype(self.dtype).itemsize, out=pointers[1:])
            return pointers

    return _FastIndexWriter


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


def check_dataset(prefix: str) -> int:
    """Check that the dataset ``prefix`` is whole and its ``.bin`` and ``.idx`` agree (header,
    sizes, pointers, document indices) in one chunked pass over the ``.idx``; its token count.
    DataError: one line naming the file and what is wrong."""
    idx_path, bin_path = get_idx_path(prefix), get_bin_path(prefix)
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise DataError(f"dataset not found: {path} is missing")
    fix = "copy the dataset again or re-run tools/preprocess_data.py"
    code, sequences, documents = _index_header(idx_path, fix)
    itemsize = np.dtype(_CODE_NAMES[code]).itemsize
    tokens = _check_sequences(idx_path, sequences, itemsize, fix)
    bin_size, bin_expected = os.path.getsize(bin_path), tokens * itemsize
    if bin_size != bin_expected:
        what = "shorter" if bin_size < bin_expected else "longer"
        raise DataError(
            f"{bin_path} is {what} than its index describes ({bin_size} bytes, "
            f"{idx_path} describes {tokens} {_CODE_NAMES[code]} tokens = {bin_expected} bytes; an "
            f"interrupted copy, or the .bin of another dataset); {fix}"
        )
    _check_documents(idx_path, sequences, documents, fix)
    return tokens


def _index_header(idx_path: str, fix: str) -> tuple[int, int, int]:
    """(dtype code, sequences, document indices) of the index's header, which must describe
    the index's size."""
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as handle:
        header = handle.read(_HEADER_BYTES)
    if len(header) < _HEADER_BYTES:
        raise DataError(f"{idx_path} is truncated ({idx_size} bytes, less than a header); {fix}")
    if header[: len(_INDEX_HEADER)] != _INDEX_HEADER:
        raise DataError(
            f"{idx_path} is not a Megatron indexed-dataset index (its first bytes are "
            f"{header[: len(_INDEX_HEADER)]!r}, not {_INDEX_HEADER!r}); {fix}"
        )
    version, code, sequences, documents = struct.unpack("<QBQQ", header[len(_INDEX_HEADER) :])
    if version != 1:
        raise DataError(f"{idx_path} has index version {version}; this reader knows version 1")
    if code not in _CODE_NAMES:
        known = ", ".join(f"{c} {n}" for c, n in sorted(_CODE_NAMES.items()))
        raise DataError(f"{idx_path} has token dtype code {code}, not one of {known}; {fix}")
    expected = _HEADER_BYTES + 12 * sequences + 8 * documents
    if idx_size not in (expected, expected + sequences):  # (+ modes: a multimodal index)
        what = "truncated" if idx_size < expected else "longer than its header describes"
        raise DataError(
            f"{idx_path} is {what} ({idx_size} bytes; {sequences} sequences and {documents} "
            f"document indices take {expected}); {fix}"
        )
    if documents == 0:
        raise DataError(f"{idx_path} has no document indices (at least [0] is needed); {fix}")
    return code, sequences, documents


def _check_sequences(idx_path: str, sequences: int, itemsize: int, fix: str) -> int:
    """Every sequence's length and pointer (chunk by chunk); returns the token count."""
    lengths = np.memmap(idx_path, np.int32, "r", _HEADER_BYTES, (sequences,))
    pointers = np.memmap(idx_path, np.int64, "r", _HEADER_BYTES + 4 * sequences, (sequences,))
    tokens = 0
    for start in range(0, sequences, _CHECK_CHUNK):
        part = np.asarray(lengths[start : start + _CHECK_CHUNK], dtype=np.int64)
        if part.size and part.min() < 0:
            bad = start + int(np.argmin(part))
            raise DataError(f"{idx_path}: sequence {bad} has a negative length; {fix}")
        expected_pointers = (tokens + np.cumsum(part) - part) * itemsize
        wrong = np.flatnonzero(pointers[start : start + _CHECK_CHUNK] != expected_pointers)
        if wrong.size:
            bad = start + int(wrong[0])
            raise DataError(
                f"{idx_path}: sequence {bad} points at byte {int(pointers[bad])} of the .bin, "
                f"not {int(expected_pointers[wrong[0]])} where it starts; {fix}"
            )
        tokens += int(part.sum())
    del lengths, pointers
    return tokens


def _check_documents(idx_path: str, sequences: int, documents: int, fix: str) -> None:
    """The document indices run from 0 up to `sequences`, never decreasing."""
    docs = np.memmap(idx_path, np.int64, "r", _HEADER_BYTES + 12 * sequences, (documents,))
    previous = 0
    for start in range(0, documents, _CHECK_CHUNK):
        part = np.asarray(docs[start : start + _CHECK_CHUNK])
        steps = np.diff(part, prepend=previous)
        outside = np.flatnonzero((part < 0) | (part > sequences) | (steps < 0))
        if outside.size or (start == 0 and part[0] != 0):
            bad = start + (int(outside[0]) if outside.size else 0)
            raise DataError(
                f"{idx_path}: document index {bad} is {int(docs[bad])}, out of range (document "
                f"boundaries run from 0 up to the {sequences} sequences); {fix}"
            )
        previous = int(part[-1])
    if previous != sequences:
        raise DataError(
            f"{idx_path}: the last document index is {previous}, not the {sequences} sequences "
            f"(out of range); {fix}"
        )
    del docs


def _write_index(path: str, dtype: type, lengths: np.ndarray) -> None:
    """The .idx Megatron-Core's ``_IndexWriter`` writes for one document per sequence, byte for
    byte, without importing megatron.core (seconds of start-up a preprocessing run does without)."""
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(path, "wb") as handle:
        handle.write(_INDEX_HEADER)
        handle.write(struct.pack("<Q", 1))
        handle.write(struct.pack("<B", _DTYPE_CODES[dtype]))
        handle.write(struct.pack("<Q", len(lengths)))
        handle.write(struct.pack("<Q", len(lengths) + 1))
        handle.write(lengths.tobytes(order="C"))
        handle.write(pointers.tobytes(order="C"))
        handle.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes(order="C"))


def _save_npy(path: str, array: np.ndarray) -> None:
    # A file object, so numpy does not append a second ".npy" to the temporary name.
    with open(path, "wb") as handle:
        np.save(handle, array, allow_pickle=False)


def _replace_all(pairs: list[tuple[str, str]]) -> None:
    for tmp, final in pairs:
        os.replace(tmp, final)


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
        directory = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(directory, exist_ok=True)
        self._final = dataset_files(prefix)
        self._tmp = [path + TMP_SUFFIX for path in self._final]
        self._bin = open(self._tmp[0], "wb")
        self._lengths: list[np.ndarray] = []
        self.counts = np.zeros(self.vocab_size, dtype=np.int64)
        self.num_documents = 0
        self.num_tokens = 0
        self._closed = False

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
        _write_index(self._tmp[1], self.dtype, lengths)
        _save_npy(self._tmp[2], self.counts)
        place_sidecar(self.prefix, self.tokenizer_record)
        # counts, bin, idx: the .idx appears last, so its presence means the dataset is whole.
        _replace_all([(self._tmp[2], self._final[2]), (self._tmp[0], self._final[0])])
        _replace_all([(self._tmp[1], self._final[1])])
        self._closed = True

    def abort(self) -> None:
        """Remove the temporary files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._bin.close()
        except OSError:
            pass
        for path in self._tmp:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


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
        if not mcore_datasets().indexed_dataset.IndexedDataset.exists(prefix):
            raise DataError(f"dataset not found: {prefix}.bin/.idx")
    for prefix in prefixes:
        check_dataset(prefix)  # every input is whole before anything is written
    existing = [path for path in dataset_files(output_prefix) if os.path.exists(path)]
    if existing and not overwrite:
        raise DataError(f"output exists: {existing[0]} (pass --overwrite to replace it)")
    record = common_record(prefixes)
    indices = [
        mcore_datasets().indexed_dataset._IndexReader(get_idx_path(prefix), multimodal=False)
        for prefix in prefixes
    ]
    dtypes = {np.dtype(index.dtype) for index in indices}
    if len(dtypes) != 1:
        raise DataError(
            f"cannot merge datasets of different token dtypes: {sorted(map(str, dtypes))}"
        )
    dtype = indices[0].dtype
    counts = _summed_counts(prefixes, require_counts)
    directory = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(directory, exist_ok=True)
    final = dataset_files(output_prefix)
    tmp = [path + TMP_SUFFIX for path in final]
    try:
        lengths, document_indices = _concatenate_bins(prefixes, indices, tmp[0])
        with _fast_index_writer()(tmp[1], dtype) as writer:
            writer.write(lengths, None, document_indices)
        pairs = [(tmp[0], final[0])]
        if counts is not None:
            _save_npy(tmp[2], counts)
            pairs.insert(0, (tmp[2], final[2]))
        place_sidecar(output_prefix, record)
        _replace_all(pairs)
        _replace_all([(tmp[1], final[1])])
    except BaseException:
        for path in tmp:
            if os.path.exists(path):
                os.remove(path)
        raise
    finally:
        del indices
    summary = {
        "output_prefix": output_prefix,
        "inputs": list(prefixes),
        "documents": int(len(document_indices) - 1),
        "tokens": int(lengths.sum(dtype=np.int64)),
        "dtype": np.dtype(dtype).name,
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


def _concatenate_bins(prefixes, indices, bin_path: str) -> tuple[np.ndarray, np.ndarray]:
    """Stream the inputs' .bin data into `bin_path`; returns the merged index's sequence lengths
    and document indices."""
    lengths_parts, docs_parts, offset = [], [], 0
    with open(bin_path, "wb") as out:
        for prefix, index in zip(prefixes, indices):
            with open(get_bin_path(prefix), "rb") as src:
                while block := src.read(1 << 24):
                    out.write(block)
            lengths_parts.append(np.array(index.sequence_lengths, dtype=np.int32))
            docs_parts.append(np.array(index.document_indices[1:], dtype=np.int64) + offset)
            offset += len(index.sequence_lengths)
    document_indices = np.concatenate([np.zeros(1, dtype=np.int64), *docs_parts])
    return np.concatenate(lengths_parts), document_indices


def load_dataset(prefix: str):
    """Open a finished dataset with Megatron-Core's reader (for tools and tests), after
    ``check_dataset``."""
    if not mcore_datasets().indexed_dataset.IndexedDataset.exists(prefix):
        raise DataError(f"dataset not found: {prefix}.bin/.idx")
    check_dataset(prefix)
    return mcore_datasets().indexed_dataset.IndexedDataset(prefix, multimodal=False, mmap=True)


def num_tokens(prefix: str) -> int:
    """Total stored tokens of the dataset ``prefix`` (from its index, checked by
    ``check_dataset``)."""
    return check_dataset(prefix)


def index_dtype(prefix: str) -> np.dtype:
    """The token dtype the ``.idx`` of ``prefix`` names (after `check_dataset`)."""
    with open(get_idx_path(prefix), "rb") as handle:
        header = handle.read(_HEADER_BYTES)
    return np.dtype(_CODE_NAMES[header[len(_INDEX_HEADER) + 8]])


_SAMPLE_BLOCKS = 64
_SAMPLE_BLOCK_BYTES = 1 << 20


def sampled_max_id(prefix: str) -> int:
    """The largest token id in a sample of the dataset ``prefix``'s ``.bin``: all of it up to
    64 MiB, else 64 evenly spaced 1 MiB blocks (first and last included). For datasets without
    counts (made by Megatron-LM): a cheap check that the tokenizer covers their ids. Call after
    `check_dataset` (the header is trusted here)."""
    dtype = index_dtype(prefix)
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
