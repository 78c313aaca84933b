"""Tokenise jsonl corpora into Megatron-Core indexed datasets (the engine behind
``tools/preprocess_data.py``).

    reader thread per shard -> worker processes (parse, validate, batch-encode a ~1 MiB chunk of
    whole lines) -> the same thread writes .bin, lengths and counts in submission order

so the output bytes do not depend on the worker count, and at most ``2 * workers`` chunks per
shard are in flight (bounded memory). Outputs, with ``P`` a unit's prefix: all inputs into
``P_<key>_document`` by default; one unit per input file with ``shard_output`` (units run
concurrently); ``P_<set>_<key>_document`` per value of ``split_by``. Each dataset gets
``_counts.npy``; each unit ends by writing ``P_summary.json``, which ``skip_existing`` resumes by.
"""

from __future__ import annotations

import collections
import glob
import itertools
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from megatron_ext import _signals
from megatron_ext._paths import atomic_open
from megatron_ext.config.flags import flag
from megatron_ext.data.fingerprint import tokenizer_record
from megatron_ext.data.indexed import DatasetWriter, dataset_files, token_dtype
from megatron_ext.data.readers import DataError, InputFile, expand_inputs, iter_line_chunks
from megatron_ext.data.tokenizers import Tokenizer, TokenizerError, build_tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "PreprocessConfig",
    "BadRecordError",
    "Interrupted",
    "preprocess",
    "plan_units",
    "encode_chunk",
]

SUMMARY_SUFFIX = "_summary.json"
# How long a stopping run waits for the chunks already in the pool (see `_settle`).
_SETTLE_SECONDS = 30.0


class BadRecordError(DataError):
    """A bad input record under ``--strict``."""


class Interrupted(DataError):
    """The run was stopped (Ctrl-C, SIGTERM, or another shard failed)."""


@dataclass
class PreprocessConfig:
    """Settings of one preprocessing run; the fields with a flag are the command line's."""

    input: list[str] = flag(
        None,
        "jsonl files, globs or directories (.jsonl, .jsonl.zst, .json.gz, .jsonl.gz)",
        nargs="+",
    )
    output_prefix: str = flag(
        None, "datasets are written to <output-prefix>_<key>_document.{bin,idx}"
    )
    tokenizer_type: Optional[str] = None
    """The tokenizer: these six fields are `DataConfig`'s flags (`data.cli`)."""
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None
    tiktoken_pattern: str = "o200k"
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    json_keys: list[str] = flag(
        ["text"], "keys to extract from each json record (default: text)", nargs="+"
    )
    append_eod: bool = flag(False, "append an end-of-document token to every document")
    workers: int = flag(1, "tokenizer worker processes")
    log_interval: int = flag(1000, "log progress every this many documents")
    split_by: Optional[str] = flag(
        None,
        "write one dataset per value of this dotted field, e.g. meta.pile_set_name",
        metavar="FIELD",
    )
    shard_output: bool = flag(False, "one output per input file: <output-prefix>_<shard name>")
    concurrent_shards: Optional[int] = flag(
        None, "with --shard-output: shards processed at once (default workers/4)"
    )
    skip_existing: bool = flag(
        False, "resume: skip outputs already finished (their _summary.json exists)"
    )
    overwrite: bool = flag(False, "replace existing outputs")
    strict: bool = flag(False, "abort on the first bad record instead of skipping it")
    chunk_size_mb: float = flag(1.0, "MB of jsonl per worker task (default 1)")
    max_reported_bad: int = 20
    """Bad records logged individually per unit (all are counted)."""

    def __post_init__(self) -> None:
        if isinstance(self.input, str):
            self.input = [self.input]
        if isinstance(self.json_keys, str):
            self.json_keys = [self.json_keys]
        if not self.input or not self.output_prefix:
            raise DataError("--input and --output-prefix are required")
        if not self.json_keys:
            raise DataError("--json-keys needs at least one key")
        if self.workers < 1:
            raise DataError(f"--workers must be >= 1, got {self.workers}")
        if self.log_interval < 1:
            raise DataError(f"--log-interval must be >= 1, got {self.log_interval}")
        if self.overwrite and self.skip_existing:
            raise DataError("--overwrite and --skip-existing exclude each other")

    @property
    def chunk_bytes(self) -> int:
        """Bytes of jsonl per task sent to a worker (whole lines: the first newline after)."""
        return max(1, int(self.chunk_size_mb * (1 << 20)))


@dataclass
class Unit:
    """One unit of work: input files written, in order, to the datasets of one prefix."""

    files: list[InputFile]
    prefix: str

    @property
    def summary_path(self) -> str:
        return self.prefix + SUMMARY_SUFFIX


def _dataset_prefix(unit_prefix: str, key: str, group: Optional[str]) -> str:
    base = unit_prefix if group is None else f"{unit_prefix}_{group}"
    return f"{base}_{key}_document"


_GROUP_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _group_name(value: str) -> str:
    """A file-name-safe version of a split value ("Ubuntu IRC" -> "Ubuntu_IRC")."""
    name = _GROUP_SAFE.sub("_", value).strip("_")
    return name or "unnamed"


def plan_units(config: PreprocessConfig) -> list[Unit]:
    """Expand inputs and decide the units of work (see the module docstring)."""
    files = expand_inputs(config.input)
    if not config.shard_output:
        return [Unit(files, config.output_prefix)]
    prefix = config.output_prefix
    joiner = "" if prefix.endswith(("/", os.sep)) else "_"
    return [Unit([item], f"{prefix}{joiner}{item.name}") for item in files]


def _existing_outputs(unit: Unit, config: PreprocessConfig) -> list[str]:
    found = []
    if os.path.exists(unit.summary_path):
        found.append(unit.summary_path)
    for key in config.json_keys:
        if config.split_by is None:
            paths = dataset_files(_dataset_prefix(unit.prefix, key, None))
        else:
            paths = glob.glob(glob.escape(unit.prefix) + f"_*_{key}_document.idx")
        found.extend(path for path in paths if os.path.exists(path))
    return found


# ---------------------------------------------------------------------------------------------
# Worker side: parse, validate and encode one chunk of lines.

_WORKER: dict[str, Any] = {}


@dataclass
class ChunkResult:
    """What a worker returns for one chunk (all picklable, mostly numpy)."""

    lines: int = 0
    bytes: int = 0
    documents: int = 0
    empty: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)
    """(line number, reason) of every bad record in the chunk."""
    groups: dict[Optional[str], dict[str, tuple[np.ndarray, np.ndarray]]] = field(
        default_factory=dict
    )
    """group -> key -> (tokens, lengths), documents in input order."""


def _init_worker(tokenizer_kwargs: dict, options: dict) -> None:
    # Ctrl-C is handled by the main process, which cleans up and terminates the pool with
    # SIGTERM: that must end a worker silently, not run the tool's handler (a KeyboardInterrupt
    # traceback per worker). The pool forks workers with both signals blocked (_signals).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _signals.unblock()
    _WORKER.update(tokenizer=build_tokenizer(**tokenizer_kwargs), options=options)


def _lookup(record: dict, dotted: str) -> Any:
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _flatten(ids: list[list[int]], eod: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
    if eod is not None:
        for doc in ids:
            doc.append(eod)
    lengths = np.fromiter((len(doc) for doc in ids), dtype=np.int32, count=len(ids))
    total = int(lengths.sum(dtype=np.int64))
    tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=total)
    return tokens, lengths


def _record_texts(
    line: str, json_keys: Sequence[str], split_by: Optional[str]
) -> tuple[Optional[str], list[str], Optional[str]]:
    """(why the record is bad, None when it is not; its texts; its split group) of one line."""
    try:
        record = json.loads(line)
    except ValueError as error:
        return f"invalid JSON ({error.msg})", [], None
    if not isinstance(record, dict):
        return f"not a JSON object ({type(record).__name__})", [], None
    values = []
    for key in json_keys:
        if key not in record:
            return f"missing key {key!r}", [], None
        value = record[key]
        if not isinstance(value, str):
            return f"non-string {key!r} ({type(value).__name__})", [], None
        surrogate = _SURROGATE.search(value)
        if surrogate is not None:  # valid JSON ("\ud800"), but no tokenizer can encode it
            where = f"U+{ord(surrogate.group()):04X} at character {surrogate.start()}"
            return f"invalid Unicode in {key!r} (lone surrogate {where})", [], None
        values.append(value)
    if split_by is None:
        return None, values, None
    try:
        return None, values, _group_name(str(_lookup(record, split_by)))
    except KeyError:
        return f"missing split field {split_by!r}", [], None


def encode_chunk(
    tokenizer: Tokenizer,
    chunk: bytes,
    first_line: int,
    json_keys: Sequence[str],
    append_eod: bool,
    split_by: Optional[str] = None,
) -> ChunkResult:
    """Parse, validate and encode one chunk of jsonl lines. A record is bad (counted with its
    line number, skipped) when it is not UTF-8 or not a JSON object, a key is missing or not a
    string, a text holds a lone surrogate, or the ``split_by`` field is missing; empty (counted,
    skipped) when a text is blank or encodes to nothing. Blank lines are ignored."""
    result = ChunkResult(bytes=len(chunk))
    lines = chunk.split(b"\n")
    if chunk.endswith(b"\n"):
        lines.pop()
    result.lines = len(lines)
    texts: dict[str, list[str]] = {key: [] for key in json_keys}
    groups: list[Optional[str]] = []
    line_numbers: list[int] = []
    for offset, raw in enumerate(lines):
        if not raw.strip():
            continue
        line_number = first_line + offset
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            result.bad.append((line_number, f"invalid UTF-8 at byte {error.start}"))
            continue
        reason, values, group = _record_texts(line, json_keys, split_by)
        if reason is not None:
            result.bad.append((line_number, reason))
            continue
        if any(not value.strip() for value in values):
            result.empty += 1
            continue
        for key, value in zip(json_keys, values):
            texts[key].append(value)
        groups.append(group)
        line_numbers.append(line_number)

    failed: set[int] = set()
    encoded = {key: _encode_checked(tokenizer, texts[key], failed) for key in json_keys}
    for i in sorted(failed):
        result.bad.append((line_numbers[i], "tokenizer cannot encode the text"))
    keep = [
        i not in failed and all(len(encoded[key][i]) for key in json_keys)
        for i in range(len(groups))
    ]
    result.empty += keep.count(False) - len(failed)
    eod = tokenizer.eod if append_eod else None
    order: dict[Optional[str], list[int]] = {}
    for i, group in enumerate(groups):
        if keep[i]:
            order.setdefault(group, []).append(i)
    for group, members in order.items():
        result.groups[group] = {
            key: _flatten([encoded[key][i] for i in members], eod) for key in json_keys
        }
        result.documents += len(members)
    return result


def _encode_checked(tokenizer: Tokenizer, texts: list[str], failed: set[int]) -> list[list[int]]:
    """Batch-encode; if the batch fails (a NullTokenizer text that is not ids), encode one by
    one and record the indices of the texts that fail in ``failed``."""
    if not texts:
        return []
    try:
        return [list(doc) for doc in tokenizer.encode_batch(texts)]
    except TokenizerError:
        out: list[list[int]] = []
        for i, text in enumerate(texts):
            try:
                out.append(list(tokenizer.tokenize(text)))
            except TokenizerError:
                failed.add(i)
                out.append([])
        return out


def _worker_encode(task: tuple[bytes, int]) -> ChunkResult:
    chunk, first_line = task
    options = _WORKER["options"]
    result = encode_chunk(
        _WORKER["tokenizer"],
        chunk,
        first_line,
        options["json_keys"],
        options["append_eod"],
        options["split_by"],
    )
    # Narrow to the storage dtype here, so the pipe carries 2-byte ids for small vocabularies.
    dtype = options["dtype"]
    vocab_size = options["vocab_size"]
    for per_key in result.groups.values():
        for key, (tokens, lengths) in list(per_key.items()):
            if tokens.size and (int(tokens.max()) >= vocab_size or int(tokens.min()) < 0):
                raise TokenizerError(
                    f"tokenizer produced id {int(tokens.max())} outside its vocab size {vocab_size}"
                )
            per_key[key] = (tokens.astype(dtype), lengths)
    return result


# ---------------------------------------------------------------------------------------------
# Main side: drive units, write outputs, report.


class _Progress:
    """Megatron-style progress lines every ``interval`` documents (thread-safe, run-wide)."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.start = time.monotonic()
        self.documents = 0
        self.bytes = 0
        self.tokens = 0
        self._next = interval
        self._lock = threading.Lock()

    def add(self, documents: int, nbytes: int, tokens: int) -> None:
        with self._lock:
            self.documents += documents
            self.bytes += nbytes
            self.tokens += tokens
            if self.documents >= self._next:
                self._next = (self.documents // self.interval + 1) * self.interval
                logger.info("%s", self.line())

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        return (
            f"Processed {self.documents} documents ({self.documents / elapsed:.1f} docs/s, "
            f"{self.bytes / elapsed / 1e6:.2f} MB/s, {self.tokens / elapsed:,.0f} tokens/s)."
        )


class _UnitRunner:
    """Runs one unit: feeds its chunks to the pool in order and writes the results."""

    def __init__(
        self,
        unit: Unit,
        config: PreprocessConfig,
        pool: Any,
        vocab_size: int,
        tokenizer_info: dict,
        progress: _Progress,
        cancel: threading.Event,
        max_in_flight: int,
    ) -> None:
        self.unit = unit
        self.config = config
        self.pool = pool
        self.vocab_size = vocab_size
        self.tokenizer_info = tokenizer_info
        self.progress = progress
        self.cancel = cancel
        self.max_in_flight = max_in_flight
        self.writers: dict[tuple[Optional[str], str], DatasetWriter] = {}
        self.stats = collections.Counter()
        self.bad_reasons: collections.Counter = collections.Counter()

    def _writer(self, group: Optional[str], key: str) -> DatasetWriter:
        writer = self.writers.get((group, key))
        if writer is None:
            writer = DatasetWriter(
                _dataset_prefix(self.unit.prefix, key, group),
                self.vocab_size,
                tokenizer_record=self.tokenizer_info,
            )
            self.writers[(group, key)] = writer
        return writer

    def _get(self, async_result: Any) -> ChunkResult:
        while True:
            if self.cancel.is_set():
                raise Interrupted("stopped")
            try:
                return async_result.get(timeout=0.2)
            except multiprocessing.TimeoutError:
                continue

    def _consume(self, path: str, result: ChunkResult) -> None:
        for line_number, reason in result.bad:
            self.stats["bad"] += 1
            self.bad_reasons[reason.split(" (")[0].split(" at byte")[0]] += 1
            if self.config.strict:
                raise BadRecordError(f"{path}:{line_number}: bad record: {reason} (--strict)")
            if self.stats["bad"] <= self.config.max_reported_bad:
                logger.warning("%s:%d: skipped bad record: %s", path, line_number, reason)
            elif self.stats["bad"] == self.config.max_reported_bad + 1:
                logger.warning("further bad records in %s are counted, not shown", self.unit.prefix)
        tokens_total = 0
        for group, per_key in result.groups.items():
            for key, (tokens, lengths) in per_key.items():
                self._writer(group, key).add_documents(tokens, lengths)
                tokens_total += int(tokens.size)
        self.stats["documents"] += result.documents
        self.stats["empty"] += result.empty
        self.stats["lines"] += result.lines
        self.stats["bytes"] += result.bytes
        self.stats["tokens"] += tokens_total
        self.progress.add(result.documents, result.bytes, tokens_total)

    def run(self) -> dict:
        start = time.monotonic()
        if self.config.overwrite and os.path.exists(self.unit.summary_path):
            os.remove(self.unit.summary_path)  # the unit counts as unfinished until rewritten
        # Chunks handed to the pool, oldest first; the head leaves only once consumed, so that a
        # stopping run knows every chunk still in flight.
        pending: collections.deque = collections.deque()
        try:
            for item in self.unit.files:
                for first_line, chunk in iter_line_chunks(item.path, self.config.chunk_bytes):
                    if self.cancel.is_set():
                        raise Interrupted("stopped")
                    pending.append(self.pool.apply_async(_worker_encode, ((chunk, first_line),)))
                    if len(pending) >= self.max_in_flight:
                        self._consume(item.path, self._get(pending[0]))
                        pending.popleft()
                while pending:
                    self._consume(item.path, self._get(pending[0]))
                    pending.popleft()
            if self.stats["documents"] == 0 and self.stats["bad"]:
                raise DataError(
                    f"{self.unit.prefix}: every record was bad ({self.stats['bad']} bad records: "
                    f"{dict(self.bad_reasons)}); nothing written. Check --json-keys and "
                    "--tokenizer-type (NullTokenizer reads space-separated ids, not text)"
                )
            if self.config.split_by is None:
                for key in self.config.json_keys:
                    self._writer(None, key)  # an all-empty input still yields its dataset
            for writer in self.writers.values():
                writer.finalize()
        except BaseException:
            for writer in self.writers.values():
                writer.abort()
            _settle(pending)
            raise
        summary = {
            "output_prefix": self.unit.prefix,
            "inputs": [item.path for item in self.unit.files],
            "datasets": sorted(writer.prefix for writer in self.writers.values()),
            "documents": self.stats["documents"],
            "tokens": self.stats["tokens"],
            "bad_records": self.stats["bad"],
            "bad_by_reason": dict(self.bad_reasons),
            "empty_documents": self.stats["empty"],
            "lines": self.stats["lines"],
            "bytes": self.stats["bytes"],
            "seconds": round(time.monotonic() - start, 3),
            "tokenizer": self.tokenizer_info,
            "json_keys": list(self.config.json_keys),
            "append_eod": self.config.append_eod,
            "split_by": self.config.split_by,
            "dtype": np.dtype(token_dtype(self.vocab_size)).name,
        }
        with atomic_open(self.unit.summary_path) as handle:
            json.dump(summary, handle, indent=2, sort_keys=True)
            handle.write("\n")
        level = logging.WARNING if summary["bad_records"] else logging.INFO
        logger.log(
            level,
            "%s: %d documents, %d tokens, %d bad records skipped%s, %d empty documents skipped "
            "(%.1f s)",
            self.unit.prefix,
            summary["documents"],
            summary["tokens"],
            summary["bad_records"],
            f" {dict(self.bad_reasons)}" if self.bad_reasons else "",
            summary["empty_documents"],
            summary["seconds"],
        )
        return summary


def _settle(pending: Sequence[Any], timeout: float = _SETTLE_SECONDS) -> None:
    """Wait (at most `timeout` seconds in all) for the chunks still in flight; their results
    are dropped. A stopping run does this before it terminates the pool: Pool.terminate()
    deadlocks when finished chunks still fill the result pipe (its task handler blocks sending
    a sentinel into the pipe after the result handler has stopped reading it)."""
    deadline = time.monotonic() + timeout
    for result in pending:
        result.wait(max(0.0, deadline - time.monotonic()))


class _SerialPool:
    """The Pool interface, run in this process (one worker)."""

    class _Done:
        def __init__(self, value: Any) -> None:
            self.value = value

        def get(self, timeout: Optional[float] = None) -> Any:
            return self.value

        def wait(self, timeout: Optional[float] = None) -> None:
            pass

    def __init__(self, tokenizer_kwargs: dict, options: dict) -> None:
        _WORKER.update(tokenizer=build_tokenizer(**tokenizer_kwargs), options=options)

    def apply_async(self, func: Any, args: tuple) -> "_SerialPool._Done":
        return self._Done(func(*args))

    def close(self) -> None:
        pass

    terminate = join = close


def preprocess(config: PreprocessConfig) -> list[dict]:
    """Run preprocessing; one summary dict per unit (skipped units left out). DataError on bad
    input or settings, ``Interrupted`` on Ctrl-C/SIGTERM: temporary files are removed, finished
    units kept."""
    tokenizer_kwargs = asdict(config)  # build_tokenizer reads the tokenizer's fields
    tokenizer = build_tokenizer(**tokenizer_kwargs)
    try:
        tokenizer.encode_batch(["probe"] if config.tokenizer_type != "NullTokenizer" else ["0"])
    except Exception as error:
        raise TokenizerError(f"tokenizer {tokenizer!r} cannot encode: {error}") from None
    vocab_size = tokenizer.vocab_size
    todo = _units_to_do(config)
    if not todo:
        return []
    tokenizer_info = tokenizer_record(tokenizer)
    logger.info(
        "preprocess %d input file(s) into %d output(s) with %s, %d worker(s), dtype %s",
        sum(len(unit.files) for unit in todo),
        len(todo),
        tokenizer,
        config.workers,
        np.dtype(token_dtype(vocab_size)).name,
    )
    options = {
        "json_keys": list(config.json_keys),
        "append_eod": config.append_eod,
        "split_by": config.split_by,
        "dtype": token_dtype(vocab_size),
        "vocab_size": vocab_size,
    }
    concurrent = config.concurrent_shards or max(1, math.ceil(config.workers / 4))
    concurrent = max(1, min(concurrent, len(todo)))
    max_in_flight = max(2, math.ceil(2 * config.workers / concurrent))
    pool = _start_pool(config.workers, tokenizer_kwargs, options)
    progress = _Progress(config.log_interval)
    cancel = threading.Event()
    summaries: list[dict] = []
    ok = False
    try:
        runners = [
            _UnitRunner(
                unit, config, pool, vocab_size, tokenizer_info, progress, cancel, max_in_flight
            )
            for unit in todo
        ]
        with ThreadPoolExecutor(concurrent, thread_name_prefix="shard") as executor:
            futures = [executor.submit(runner.run) for runner in runners]
            try:
                pending = set(futures)
                while pending:
                    done, pending = wait_futures(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
                    for future in done:
                        if future.exception() is not None:
                            raise future.exception()
            except BaseException:
                cancel.set()
                for future in futures:
                    future.cancel()
                raise
            summaries = [future.result() for future in futures]
        ok = True
    finally:
        if ok:
            pool.close()
        else:
            pool.terminate()
        pool.join()
    logger.info("%s", progress.line())
    return summaries


def _units_to_do(config: PreprocessConfig) -> list:
    """The planned units to write: finished ones skipped with --skip-existing; an existing
    output is an error without --overwrite."""
    units = plan_units(config)
    todo = []
    for unit in units:
        existing = _existing_outputs(unit, config)
        if config.skip_existing and os.path.exists(unit.summary_path):
            logger.info("skip %s: finished (%s exists)", unit.prefix, unit.summary_path)
            continue
        if existing and not config.overwrite and not config.skip_existing:
            raise DataError(
                f"output exists: {existing[0]} (pass --overwrite to replace it, or "
                "--skip-existing to resume and keep finished outputs)"
            )
        todo.append(unit)
    if not todo:
        logger.info("nothing to do: all %d outputs are finished", len(units))
    return todo


def _start_pool(workers: int, tokenizer_kwargs: dict, options: dict) -> Any:
    """The encoding workers: in this process for one worker, else a process pool."""
    if workers == 1:
        return _SerialPool(tokenizer_kwargs, options)
    # Blocked here, the pool's threads (which re-fork dead workers) keep the signals
    # blocked too; the main thread gets them back at once.
    with _signals.blocked():
        return multiprocessing.get_context("fork" if os.name == "posix" else "spawn").Pool(
            workers, initializer=_init_worker, initargs=(tokenizer_kwargs, options)
        )
