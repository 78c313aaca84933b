"""Reading a checkpoint runs nothing from it: a file of one is data, never code.

`.metadata` is unpickled admitting only DCP's metadata classes and the types they hold
(`METADATA_GLOBALS`), and the shard files it names must lie inside the checkpoint; tensors are
read with `torch.load(weights_only=True)` and entries declared as pickled bytes are refused
(`SafeLoadPlanner`); RNG files hold tensors, ints and floats only (format 1 files: numpy's
array types admitted besides). Anything else is an `UnsafeCheckpointError`.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from megatron_ext._paths import display_path
from megatron_ext.checkpoint.io_errors import UnsafeCheckpointError

__all__ = [
    "METADATA_GLOBALS",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "load_rng_file",
    "pickled_entry_error",
    "read_metadata",
    "save_rng_file",
]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout (torch.strided) by its name
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id, a Path of the saving platform
        ("pathlib", "WindowsPath"),
    }
)
"""(module, name) of every global a DCP `.metadata` pickle may name, besides torch's dtypes
(`torch.float32`, ...)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global is refused before it is looked up."""

    def __init__(self, file, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        """The global `module.name` when it is one of DCP's metadata types (or a dtype)."""
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{display_path(self._path)} holds a pickled {module}.{name}, which loading would "
            "call: refused, nothing of it ran (the file is not a torch.distributed.checkpoint "
            "metadata file as this project or torch writes it; do not use this checkpoint)"
        )


def read_metadata(path: str) -> Metadata:
    """The `Metadata` in `path`, unpickled with only DCP's types admitted, its shard files
    checked to be plain names inside the checkpoint (else `UnsafeCheckpointError`)."""
    with open(path, "rb") as handle:
        metadata = _MetadataUnpickler(handle, path).load()
    where = display_path(path)
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"{where} holds a {type(metadata).__name__}, not torch.distributed.checkpoint "
            "Metadata: refused"
        )
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if (
            not isinstance(info, _StorageInfo)
            or not isinstance(name, str)
            or name in ("", ".", "..")
            or os.path.basename(name) != name
        ):
            raise UnsafeCheckpointError(
                f"{where} names the data file {name!r}, which is not a file of this checkpoint "
                "directory: refused"
            )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader whose `.metadata` is read by `read_metadata` (no code runs)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (see the module's `read_metadata`)."""
        path = os.fspath(self._get_metadata_path(kwargs.get("rank")))
        metadata = read_metadata(path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that an entry stored as pickled bytes is refused
    (the default unpickles it with `torch.load(weights_only=False)`; the project stores
    tensors only)."""

    def __init__(self, checkpoint: str) -> None:
        super().__init__()
        self.checkpoint = checkpoint

    def load_bytes(self, read_item, value) -> None:
        """Refuse: see the class docstring."""
        raise pickled_entry_error(self.checkpoint, read_item.dest_index.fqn)


def pickled_entry_error(checkpoint: str, key: str) -> UnsafeCheckpointError:
    """The refusal of entry `key`, which `checkpoint`'s `.metadata` declares as pickled bytes."""
    return UnsafeCheckpointError(
        f"{display_path(os.path.join(checkpoint, '.metadata'))} declares {key} as pickled bytes, "
        "which loading would execute; this project writes tensors only: refused"
    )


# ------------------------------------------------------------------------------ RNG files

RNG_FORMAT = 2
"""1 (before digests): torch.save of the states as Python returns them (numpy's holds an
array); 2: tensors, ints and floats only."""

try:
    from numpy._core.multiarray import _reconstruct  # numpy 2
except ImportError:  # numpy 1
    from numpy.core.multiarray import _reconstruct

# What a format-1 file needs besides tensors and containers: numpy's state array (its
# reconstructor under the names numpy 1 and numpy 2 pickle it with).
_RNG_FORMAT_1_GLOBALS = [
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),  # numpy.dtypes.UInt32DType: the state array's dtype
    (_reconstruct, "numpy.core.multiarray._reconstruct"),
    (_reconstruct, "numpy._core.multiarray._reconstruct"),
]
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|but got <class '([^']+)'>")
# States saved as torch and the RNG trackers return them (tensors, dicts of tensors).
_TENSOR_STATES = ("torch", "cuda", "tracker", "cpu_tracker")


def _encode_rng(state: dict) -> dict:
    out: dict[str, Any] = {"format": RNG_FORMAT}
    version, internal, gauss = state["random"]
    out["random"] = {
        "version": version,
        "state": torch.tensor(internal, dtype=torch.int64),
        "gauss": gauss,
    }
    name, keys, pos, has_gauss, cached = state["numpy"]
    out["numpy"] = {
        "name": name,
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return {**out, **{k: state[k] for k in _TENSOR_STATES if k in state}}


def _decode_rng(saved: dict) -> dict:
    if saved.get("format") != RNG_FORMAT:  # format 1: the states as Python returns them
        return saved
    r, n = saved["random"], saved["numpy"]
    state = {
        "random": (r["version"], tuple(int(v) for v in r["state"].tolist()), r["gauss"]),
        "numpy": (
            n["name"],
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        ),
    }
    return {**state, **{k: saved[k] for k in _TENSOR_STATES if k in saved}}


def save_rng_file(path: str, state: dict) -> None:
    """Write RNG states (`random`, `numpy`, `torch`, optional `cuda`/`tracker` or `cpu_tracker`,
    as Python, numpy, torch and the RNG trackers return them) as tensors, ints and floats."""
    torch.save(_encode_rng(state), path)


def load_rng_file(path: str) -> dict:
    """The RNG states of `path` (either format), as `save_rng_file` took them;
    `UnsafeCheckpointError` when it holds anything else (nothing of it ran)."""
    try:
        with torch.serialization.safe_globals(_RNG_FORMAT_1_GLOBALS):
            saved = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        refused = _REFUSED_GLOBAL.search(str(error))
        what = f"a pickled {refused.group(1) or refused.group(2)}" if refused else "pickled objects"
        raise UnsafeCheckpointError(
            f"{display_path(path)} holds {what}, which loading would call: refused, nothing of "
            "it ran (it is not an RNG state file this project writes; resume with "
            "--no-load-rng to skip the RNG files, or from another checkpoint)"
        ) from None
    try:
        return _decode_rng(saved)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise UnsafeCheckpointError(
            f"{display_path(path)} is not an RNG state file ({type(error).__name__}: {error})"
        ) from None
