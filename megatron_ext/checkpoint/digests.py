"""Checkpoint digests: every file a save writes is hashed and the digest recorded inside the
checkpoint, so that a load finds a damaged file before reading anything.

    <ckpt>/digests/rank00000.json   rank 0: shards, RNG file, .metadata, common.json, args.json
    <ckpt>/digests/rank00001.json   rank 1: its shards and RNG file ...

A manifest is ``{"format": 1, "algorithm": "xxh3_128", "rank", "world_size", "files": {path:
{"size", "digest"}}, "self": <digest of the manifest's own content>}``. Shard files are hashed
as DCP writes them (`DigestingWriter`: a second thread hashes each file behind the writer, from
the page cache), the small files right after they are written. `verify_checkpoint` is
collective: the files are split between the ranks by size and every rank learns every problem.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from tqdm import tqdm

from megatron_ext._paths import atomic_open

__all__ = [
    "ALGORITHM",
    "DIGESTS_DIR",
    "DigestingWriter",
    "FileDigest",
    "DamagedFile",
    "Verification",
    "file_digest",
    "manifest_path",
    "rank_and_world",
    "verify_checkpoint",
    "write_manifest",
]

ALGORITHM = "xxh3_128"
DIGESTS_DIR = "digests"
MANIFEST_FORMAT = 1
_CHUNK = 16 << 20  # bytes hashed per read when checking a file
PROGRESS_MIN_BYTES = 256 << 20


@dataclass(frozen=True)
class FileDigest:
    """The size and digest of one file of a checkpoint."""

    size: int
    digest: str


def manifest_path(checkpoint: str, rank: int) -> str:
    """`<checkpoint>/digests/rank00000.json`: the manifest of the files rank `rank` wrote."""
    return os.path.join(checkpoint, DIGESTS_DIR, f"rank{rank:05d}.json")


def file_digest(path: str, progress: Optional[Callable[[int], object]] = None) -> FileDigest:
    """Hash the file `path` (read in chunks; `progress(n)` after each chunk of n bytes)."""
    hasher, size = xxhash.xxh3_128(), 0
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(_CHUNK)
            if not chunk:
                break
            hasher.update(chunk)
            size += len(chunk)
            if progress is not None:
                progress(len(chunk))
    return FileDigest(size, hasher.hexdigest())


class _TailHasher:
    """Hashes a file while another thread writes it, reading behind the writer from the page
    cache (the writes are sequential: torch's zip writer refuses any other order, so a byte in
    the file never changes once there). The writer never waits for the hash; `finish` waits
    for the last bytes once the file is closed."""

    def __init__(self, path) -> None:
        self._path = path
        self._hasher = xxhash.xxh3_128()
        self._hashed = 0
        self._final: Optional[int] = None
        self._stop = False
        self._wake = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="digest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        try:
            with open(self._path, "rb", buffering=0) as handle:
                while not self._stop:
                    final = self._final  # read before the size: then the size is final too
                    size = os.fstat(handle.fileno()).st_size
                    while self._hashed < size:
                        n = handle.readinto(view[: min(_CHUNK, size - self._hashed)])
                        if not n:
                            break
                        self._hasher.update(view[:n])
                        self._hashed += n
                    if final is not None and self._hashed >= final:
                        return
                    self._wake.wait(0.01)
                    self._wake.clear()
        except BaseException as error:  # reported by finish
            self._error = error

    def wrote(self) -> None:
        """The writer added bytes to the file."""
        self._wake.set()

    def finish(self, size: int) -> FileDigest:
        """The digest of the closed file of `size` bytes (waits for the hash to reach it)."""
        self._final = size
        self._wake.set()
        self._thread.join()
        if self._error is not None or self._hashed != size:
            raise OSError(
                f"could not hash {self._path} while writing it ({self._hashed} of {size} bytes"
                f"{f': {self._error}' if self._error else ''})"
            )
        return FileDigest(size, self._hasher.hexdigest())

    def abandon(self) -> None:
        """The write failed: stop hashing."""
        self._stop = True
        self._wake.set()
        self._thread.join()


class _CountingStream:
    """A write stream that counts what goes through it and wakes the `_TailHasher` (the rest
    is the wrapped stream's)."""

    def __init__(self, stream, tail: _TailHasher) -> None:
        self._stream, self._tail = stream, tail
        self.size = 0

    def write(self, data) -> int:
        written = self._stream.write(data)
        size = memoryview(data).nbytes
        if written is not None and written != size:
            raise OSError(f"short write: {written} of {size} bytes")
        self.size += size
        self._tail.wrote()
        return size

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _DigestingFileSystem(FileSystem):
    """torch's FileSystem whose write streams record the digest of each file they write."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, FileDigest] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path, mode) -> Iterator:
        """The stream of `path`; in write mode, the file is hashed as it is written."""
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            tail = _TailHasher(path)
            counting = _CountingStream(stream, tail)
            try:
                yield counting
            except BaseException:
                tail.abandon()
                raise
        digest = tail.finish(counting.size)  # the stream is closed: every byte is in the file
        with self._lock:
            self.digests[os.path.basename(os.fspath(path))] = digest


class DigestingWriter(FileSystemWriter):
    """torch.distributed.checkpoint's FileSystemWriter (`dcp.save`'s default settings) that
    records the digest of each shard file this rank writes (`shard_digests`), without torch's zip
    CRC32 (torch.load never checks it; the digests replace it)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.fs = _DigestingFileSystem()

    def write_data(self, plan, planner):
        """This rank's shard files (written before this returns; see the class docstring)."""
        computed = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            return super().write_data(plan, planner)
        finally:
            torch.serialization.set_crc32_options(computed)

    def shard_digests(self) -> dict[str, FileDigest]:
        """{file name: digest} of the shard files this rank wrote (not DCP's `.metadata`, which
        the coordinator writes under a temporary name and renames: it is hashed afterwards)."""
        return {
            name: d
            for name, d in self.fs.digests.items()
            if not name.startswith(".metadata") and not name.endswith(".tmp")
        }


def _manifest_self_digest(body: dict) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_128(text.encode()).hexdigest()


def write_manifest(
    checkpoint: str, rank: int, world_size: int, files: dict[str, FileDigest]
) -> str:
    """Write rank `rank`'s manifest of `files` (paths relative to `checkpoint`) through a
    temporary name; returns its path."""
    body = {
        "format": MANIFEST_FORMAT,
        "algorithm": ALGORITHM,
        "rank": rank,
        "world_size": world_size,
        "files": {name: {"size": d.size, "digest": d.digest} for name, d in sorted(files.items())},
    }
    body["self"] = _manifest_self_digest(body)
    path = manifest_path(checkpoint, rank)
    with atomic_open(path, fsync=True) as handle:
        json.dump(body, handle, indent=1)
    return path


@dataclass(frozen=True, order=True)
class DamagedFile:
    """One problem found by `verify_checkpoint`: `name` (relative to the checkpoint) `what`."""

    name: str
    what: str
    """e.g. "is truncated (10 of 20 bytes)"."""


@dataclass
class Verification:
    """The outcome of `verify_checkpoint` (the same on every rank)."""

    has_digests: bool
    """False: the checkpoint records no digests (saved before they were, or by another tool)."""
    files: int = 0
    """Files checked (all ranks together), manifests included."""
    bytes: int = 0
    problems: list[DamagedFile] = field(default_factory=list)
    """Every damaged or missing file, sorted by name."""

    @property
    def ok(self) -> bool:
        """Digests were recorded and every file matches them."""
        return self.has_digests and not self.problems


def _read_manifests(checkpoint: str) -> tuple[dict[str, FileDigest], Verification]:
    """({every recorded file (relative to the checkpoint): its digest}, the manifests' own
    count, bytes and problems); every rank reads all of them (a few KiB each)."""
    directory = os.path.join(checkpoint, DIGESTS_DIR)
    names = sorted(n for n in os.listdir(directory) if n.startswith("rank") and n.endswith(".json"))
    entries: dict[str, FileDigest] = {}
    found = Verification(has_digests=True, files=len(names))
    world_size = None
    for name in names:
        path = os.path.join(directory, name)
        found.bytes += os.path.getsize(path)
        try:
            with open(path) as handle:
                body = json.load(handle)
            recorded = body.pop("self")
            if recorded != _manifest_self_digest(body):
                raise ValueError("its content does not match its own digest")
            if body["algorithm"] != ALGORITHM:
                raise ValueError(f"unknown digest algorithm {body['algorithm']!r}")
            files = {
                k: FileDigest(int(v["size"]), str(v["digest"])) for k, v in body["files"].items()
            }
            if body["rank"] == 0:
                world_size = int(body["world_size"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            found.problems.append(DamagedFile(f"{DIGESTS_DIR}/{name}", f"is damaged ({error})"))
            continue
        entries.update(files)
    for rank in range(world_size or 1):  # rank 0's manifest names the world size
        name = os.path.basename(manifest_path(checkpoint, rank))
        if name not in names:
            found.problems.append(DamagedFile(f"{DIGESTS_DIR}/{name}", "is missing"))
    return entries, found


def _share(entries: dict[str, FileDigest], rank: int, world_size: int) -> list[str]:
    """This rank's files: the largest first, each to the rank with the fewest bytes so far
    (the same split on every rank)."""
    load = [0] * world_size
    mine = []
    for name in sorted(entries, key=lambda n: (-entries[n].size, n)):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += entries[name].size
        if owner == rank:
            mine.append(name)
    return mine


def _check_file(
    checkpoint: str, name: str, expected: FileDigest, progress: Optional[Callable[[int], object]]
) -> Optional[DamagedFile]:
    path = os.path.join(checkpoint, name)
    if not os.path.isfile(path):
        return DamagedFile(name, "is missing")
    size = os.path.getsize(path)
    if size < expected.size:
        return DamagedFile(name, f"is truncated ({size} of {expected.size} bytes)")
    if size > expected.size:
        return DamagedFile(name, f"is longer than saved ({size} bytes, {expected.size} saved)")
    actual = file_digest(path, progress)
    if actual.digest != expected.digest:
        return DamagedFile(
            name,
            f"does not match the digest recorded when it was saved ({ALGORITHM} "
            f"{actual.digest}, saved {expected.digest})",
        )
    return None


def rank_and_world() -> tuple[int, int]:
    """(this rank, the world size); (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def verify_checkpoint(checkpoint: str, progress: bool = False) -> Verification:
    """Check every file of `checkpoint` against its recorded digest; collective when
    torch.distributed is initialised (each rank hashes its share), the same `Verification` on every
    rank. `progress`: a bar on rank 0 for checkpoints of at least `PROGRESS_MIN_BYTES`."""
    if not os.path.isdir(os.path.join(checkpoint, DIGESTS_DIR)):
        return Verification(has_digests=False)
    rank, world_size = rank_and_world()
    entries, verified = _read_manifests(checkpoint)
    mine = _share(entries, rank, world_size)
    total = sum(e.size for e in entries.values())
    show = progress and rank == 0 and total >= PROGRESS_MIN_BYTES
    with tqdm(
        total=sum(entries[n].size for n in mine),
        desc="verifying " + ("checkpoint" if world_size == 1 else "rank 0's share"),
        unit="B",
        unit_scale=True,
        disable=not show,
    ) as bar:
        local = [p for p in (_check_file(checkpoint, n, entries[n], bar.update) for n in mine) if p]
    if world_size > 1:
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, local)
        local = [p for part in gathered for p in part]
    verified.files += len(entries)
    verified.bytes += total
    verified.problems = sorted(verified.problems + local)
    return verified
