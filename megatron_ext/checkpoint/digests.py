"""Checkpoint digests: every file a save writes is hashed and the digest recorded inside the
checkpoint, so that a load finds a damaged file (a bad copy between clusters, a failing disk)
before reading anything.

    <ckpt>/digests/rank00000.json   rank 0: its shard files, its RNG file, .metadata,
                                    common.json, args.json
    <ckpt>/digests/rank00001.json   rank 1: its shard files and RNG file
    ...

A manifest is JSON: ``{"format": 1, "algorithm": "xxh3_128", "rank": r, "world_size": n,
"files": {path in the checkpoint: {"size": bytes, "digest": hex}}, "self": <digest>}``, where
"self" is the digest of the manifest's own content (so that a damaged manifest is named as
such). The latest marker (`latest_checkpointed_iteration.txt`) is outside the checkpoint and
has none.

Shard files are hashed as torch.distributed.checkpoint writes them (`DigestingWriter`: each
write of the stream is hashed in a second thread while the write goes to the file, so the
hashing overlaps the write), the small files right after they are written.

`verify_checkpoint` is collective: every rank reads the manifests, the files are split between
the ranks by size, each rank hashes its share, and every rank learns every problem.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from tqdm import tqdm

__all__ = [
    "ALGORITHM",
    "DIGESTS_DIR",
    "DigestingWriter",
    "FileDigest",
    "DamagedFile",
    "Verification",
    "file_digest",
    "manifest_path",
    "verify_checkpoint",
    "write_manifest",
]

ALGORITHM = "xxh3_128"
DIGESTS_DIR = "digests"
MANIFEST_FORMAT = 1
_CHUNK = 16 << 20  # bytes hashed per read when checking a file
_OVERLAP_MIN = 1 << 20  # writes at least this large are hashed beside the write
PROGRESS_MIN_BYTES = 256 << 20


def _hasher():
    return xxhash.xxh3_128()


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
    hasher, size = _hasher(), 0
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


class _HashingStream:
    """A write stream that hashes what goes through it (the rest is the wrapped stream's).
    A large write is hashed by `pool`'s thread while this one writes it (both release the
    GIL), and returns once both are done, so the hash sees the writes in order."""

    def __init__(self, stream, pool: ThreadPoolExecutor) -> None:
        self._stream, self._pool = stream, pool
        self._hasher = _hasher()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= _OVERLAP_MIN:
            hashed = self._pool.submit(self._hasher.update, view)
            written = self._stream.write(view)
            hashed.result()
        else:
            self._hasher.update(view)
            written = self._stream.write(view)
        if written is not None and written != len(view):
            raise OSError(f"short write: {written} of {len(view)} bytes")
        self.size += len(view)
        return len(view)

    def digest(self) -> FileDigest:
        """What was written so far."""
        return FileDigest(self.size, self._hasher.hexdigest())

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
        """The stream of `path`; in write mode one that hashes what is written."""
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with ThreadPoolExecutor(1, thread_name_prefix="digest") as pool:
            with super().create_stream(path, mode) as stream:
                hashing = _HashingStream(stream, pool)
                yield hashing
        with self._lock:
            self.digests[os.path.basename(os.fspath(path))] = hashing.digest()


class DigestingWriter(FileSystemWriter):
    """torch.distributed.checkpoint's FileSystemWriter (same settings as `dcp.save`'s default)
    that records the digest of each shard file this rank writes (`shard_digests`)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.fs = _DigestingFileSystem()

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
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump(body, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


@dataclass(frozen=True, order=True)
class DamagedFile:
    """One problem found by `verify_checkpoint`: `name` (relative to the checkpoint) `what`."""

    name: str
    what: str
    """e.g. "is truncated (10 of 20 bytes)"."""

    def __str__(self) -> str:
        return f"{self.name} {self.what}"


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


@dataclass
class _Manifests:
    entries: dict[str, FileDigest]
    """Every recorded file (relative to the checkpoint) -> its digest."""
    problems: list[DamagedFile]
    """Manifests that are damaged or missing."""
    count: int
    bytes: int


def _read_manifests(checkpoint: str) -> _Manifests:
    """Every rank reads all of them (a few KiB each)."""
    directory = os.path.join(checkpoint, DIGESTS_DIR)
    names = sorted(n for n in os.listdir(directory) if n.startswith("rank") and n.endswith(".json"))
    found = _Manifests({}, [], len(names), 0)
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
        found.entries.update(files)
    first = os.path.basename(manifest_path(checkpoint, 0))
    if world_size is None:
        if first not in names:
            found.problems.append(DamagedFile(f"{DIGESTS_DIR}/{first}", "is missing"))
    else:
        for rank in range(world_size):
            name = os.path.basename(manifest_path(checkpoint, rank))
            if name not in names:
                found.problems.append(DamagedFile(f"{DIGESTS_DIR}/{name}", "is missing"))
    return found


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


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def verify_checkpoint(checkpoint: str, progress: bool = False) -> Verification:
    """Check every file of `checkpoint` against its recorded digest; collective over the
    default group when torch.distributed is initialised (each rank hashes its share).

    Args:
        progress: a progress bar (tqdm, on rank 0, of its share) when the checkpoint holds at
            least `PROGRESS_MIN_BYTES`.

    Returns:
        the same `Verification` on every rank.
    """
    if not os.path.isdir(os.path.join(checkpoint, DIGESTS_DIR)):
        return Verification(has_digests=False)
    rank, world_size = _world()
    manifests = _read_manifests(checkpoint)
    entries = manifests.entries
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
    return Verification(
        has_digests=True,
        files=len(entries) + manifests.count,
        bytes=sum(e.size for e in entries.values()) + manifests.bytes,
        problems=sorted(manifests.problems + local),
    )
