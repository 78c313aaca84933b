"""Streaming readers for jsonl corpora: plain ``.jsonl``/``.json``, ``.jsonl.zst`` and
``.json.gz``/``.jsonl.gz``.

Nothing here loads a whole file: compressed input is decompressed block by block and handed out
as chunks of whole lines (``iter_line_chunks``), so memory is bounded by the chunk size whatever
the shard size. A zstd stream that ends inside a frame (a truncated download) is an error naming
the file; ``zstandard``'s own stream reader would silently return the truncated prefix.
"""

from __future__ import annotations

import glob
import gzip
import os
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Sequence

import zstandard

from megatron_ext.config.data import DataError

__all__ = [
    "DataError",
    "CorruptInputError",
    "InputFile",
    "SUPPORTED_SUFFIXES",
    "expand_inputs",
    "iter_blocks",
    "iter_line_chunks",
    "iter_lines",
    "strip_suffix",
]

#: Input file name endings we read (longest first, so ``.jsonl.zst`` wins over ``.zst``).
SUPPORTED_SUFFIXES = (".jsonl.zst", ".json.zst", ".jsonl.gz", ".json.gz", ".jsonl", ".json")

_BLOCK = 1 << 20


class CorruptInputError(DataError):
    """A compressed input ends early or is not what its name says."""


@dataclass(frozen=True)
class InputFile:
    """One input file and its shard name: its path relative to the directory it was found
    under, else its base name, without suffix, ``/`` as ``_`` (``pile/train/00.jsonl.zst`` found
    under ``pile/`` is ``train_00``)."""

    path: str
    name: str


def strip_suffix(name: str) -> str:
    """``name`` without a supported suffix (``00.jsonl.zst`` -> ``00``)."""
    for suffix in SUPPORTED_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _is_supported(path: str) -> bool:
    return path.endswith(SUPPORTED_SUFFIXES)


def expand_inputs(inputs: Sequence[str]) -> list[InputFile]:
    """Files, globs and directories (searched recursively) as files, each argument's sorted by
    path, each file once. DataError: an argument matches nothing, an unsupported suffix, or two
    files with the same shard name."""
    found: list[InputFile] = []
    seen: set[str] = set()
    for arg in inputs:
        matches: list[InputFile] = []
        if os.path.isdir(arg):
            for root, dirs, files in os.walk(arg):
                dirs.sort()
                for fname in sorted(files):
                    path = os.path.join(root, fname)
                    if _is_supported(fname):
                        rel = os.path.relpath(path, arg)
                        matches.append(InputFile(path, strip_suffix(rel).replace(os.sep, "_")))
            if not matches:
                raise DataError(
                    f"input directory {arg} holds no {'/'.join(SUPPORTED_SUFFIXES)} files"
                )
        elif os.path.isfile(arg):
            if not _is_supported(arg):
                raise DataError(
                    f"input {arg}: unsupported file type; expected one of "
                    f"{', '.join(SUPPORTED_SUFFIXES)}"
                )
            matches.append(InputFile(arg, strip_suffix(os.path.basename(arg))))
        else:
            paths = sorted(p for p in glob.glob(arg, recursive=True) if os.path.isfile(p))
            paths = [p for p in paths if _is_supported(p)]
            if not paths:
                raise DataError(f"input not found: {arg}")
            matches.extend(InputFile(p, strip_suffix(os.path.basename(p))) for p in paths)
        for item in sorted(matches, key=lambda m: m.path):
            real = os.path.realpath(item.path)
            if real not in seen:
                seen.add(real)
                found.append(item)
    names: dict[str, str] = {}
    for item in found:
        if item.name in names:
            raise DataError(
                f"inputs {names[item.name]} and {item.path} have the same shard name "
                f"{item.name!r}; pass their parent directory instead so names include subfolders"
            )
        names[item.name] = item.path
    return found


def _iter_zstd_blocks(handle: BinaryIO, path: str) -> Iterator[bytes]:
    dctx = zstandard.ZstdDecompressor()
    dobj = dctx.decompressobj()
    in_frame = False
    for compressed in iter(lambda: handle.read(_BLOCK), b""):
        while compressed:
            try:
                out = dobj.decompress(compressed)
            except zstandard.ZstdError as error:
                raise CorruptInputError(f"{path}: corrupt zstd data ({error})") from None
            in_frame = True
            if out:
                yield out
            if dobj.eof:
                # A file may hold several frames (pzstd, concatenated shards).
                compressed = dobj.unused_data
                dobj = dctx.decompressobj()
                in_frame = False
            else:
                compressed = b""
    if in_frame:
        raise CorruptInputError(
            f"{path}: truncated zstd file (the stream ends inside a frame); re-download or "
            "re-compress it"
        )


def iter_blocks(path: str) -> Iterator[bytes]:
    """Decompressed bytes of ``path`` in blocks of about 1 MiB; CorruptInputError for truncated
    or corrupt ``.zst``/``.gz`` input, DataError when it cannot be opened."""
    try:
        handle = open(path, "rb")
    except OSError as error:
        raise DataError(f"cannot open input {path}: {error.strerror}") from None
    with handle:
        if path.endswith(".zst"):
            yield from _iter_zstd_blocks(handle, path)
        elif path.endswith(".gz"):
            try:
                with gzip.GzipFile(fileobj=handle) as gz:
                    yield from iter(lambda: gz.read(_BLOCK), b"")
            except EOFError:
                raise CorruptInputError(f"{path}: truncated gzip file") from None
            except (gzip.BadGzipFile, zlib.error) as error:
                raise CorruptInputError(f"{path}: corrupt gzip data ({error})") from None
        else:
            yield from iter(lambda: handle.read(_BLOCK), b"")


def iter_line_chunks(path: str, chunk_bytes: int = 1 << 20) -> Iterator[tuple[int, bytes]]:
    """``(first_line_number, chunk)`` of whole lines of ``path``, cut at the first newline after
    ``chunk_bytes`` (so the cuts never depend on the worker count); line numbers start at 1."""
    buffer = bytearray()
    line_number = 1
    for block in iter_blocks(path):
        buffer += block
        start = 0
        while len(buffer) - start >= chunk_bytes:
            cut = buffer.find(b"\n", start + chunk_bytes - 1)
            if cut < 0:
                break
            chunk = bytes(buffer[start : cut + 1])
            start = cut + 1
            yield line_number, chunk
            line_number += chunk.count(b"\n")
        if start:
            del buffer[:start]
    if buffer:
        yield line_number, bytes(buffer)


def iter_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """Yield ``(line_number, line)`` for every line of ``path`` (newline stripped)."""
    for first, chunk in iter_line_chunks(path):
        lines = chunk.split(b"\n")
        if chunk.endswith(b"\n"):
            lines.pop()
        for offset, line in enumerate(lines):
            yield first + offset, line
