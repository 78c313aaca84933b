"""Distributed checkpoints: torch.distributed.checkpoint (DCP), tensor-parallel shards as
DTensors, in Megatron-LM's layout::

    <save>/iter_0000100/                      DCP shards + .metadata, common.json, args.json,
                                              rng/<rank>.pt, digests/rank<N>.json
    <save>/latest_checkpointed_iteration.txt  written last
    <save>/save.lock                          held by the run writing here (`lock.py`)

Keys are layout-free (`model.<name>`, `optim.<name>.exp_avg|exp_avg_sq|step`), so a checkpoint
saved at one TP/PP/DP/VP layout loads at another. A save writes `iter_XXXXXXX.tmp/` and renames
it when every rank is done; a save that stops removes its `.tmp`; a non-finite state is never
saved. A load verifies every file's digest first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import megatron_ext.megatron_import  # noqa: F401

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import tensor_parallel
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from megatron_ext._paths import atomic_write, display_path, fsync_dir
from megatron_ext.checkpoint.digests import (
    DIGESTS_DIR,
    DigestingWriter,
    FileDigest,
    Verification,
    file_digest,
    rank_and_world,
    verify_checkpoint,
    write_manifest,
)
from megatron_ext.checkpoint.io_errors import (
    CHECKPOINT_IO_ERRORS,
    ITER_RE,
    CheckpointDigestError,
    CheckpointError,
    CheckpointSaveError,
    NonFiniteStateError,
    UnsafeCheckpointError,
    agree_on_failure,
    causes,
    check_shard_files,
    describe_io_error,
    older_checkpoints_hint,
    older_iterations,
    saved_iterations,
)
from megatron_ext.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_rng_file,
    pickled_entry_error,
    read_metadata,
    save_rng_file,
)
from megatron_ext.models.full_state_dict import is_tied_copy, layout_free_name, tp_layout
from megatron_ext.parallel import ProcessGroups
from megatron_ext.rng import cpu_tracker

logger = logging.getLogger(__name__)

__all__ = [
    "TrainState",
    "CheckpointError",
    "CheckpointDigestError",
    "CheckpointSaveError",
    "NonFiniteStateError",
    "UnsafeCheckpointError",
    "verify_or_raise",
    "save_tensors",
    "locate_checkpoint",
    "checkpoint_dir",
    "read_latest_iteration",
    "save_checkpoint",
    "load_checkpoint",
    "TRACKER_FILENAME",
]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1


@dataclass
class TrainState:
    """Loop counters saved with every checkpoint (the data position is the consumed samples)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    floating_point_operations_so_far: float = 0.0
    skipped_iterations: int = 0
    nonfinite_iterations: int = 0


def checkpoint_dir(root: str, iteration: int) -> str:
    """`<root>/iter_XXXXXXX`, Megatron-LM's directory of one checkpoint."""
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest_iteration(root: str) -> Optional[int]:
    """The iteration in `<root>/latest_checkpointed_iteration.txt`, None without one."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        text = handle.read().strip()
    if text == "release":
        raise CheckpointError(f"{path} says 'release'; load a release checkpoint with --finetune")
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number") from None


def locate_checkpoint(load_dir: str, iteration: Optional[int] = None) -> tuple[str, int]:
    """(the --save directory, the iteration) of `load_dir`: a run's --save directory (its latest
    checkpoint, or `iteration`) or one `iter_XXXXXXX` directory in it.

    Raises:
        CheckpointError: no such directory, or no checkpoint in it.
    """
    load_dir = os.path.abspath(load_dir)
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"checkpoint directory {display_path(load_dir)} does not exist")
    name = os.path.basename(load_dir.rstrip(os.sep))
    if name.startswith("iter_") and iteration is None:
        if ITER_RE.match(name) is None:
            raise CheckpointError(f"{display_path(load_dir)} is not a checkpoint directory")
        return os.path.dirname(load_dir), int(name[len("iter_") :])
    if iteration is None:
        iteration = read_latest_iteration(load_dir)
    if iteration is None:
        raise CheckpointError(
            f"{display_path(load_dir)} holds no complete checkpoint ({TRACKER_FILENAME} is "
            "missing); give a run's --save directory"
        )
    return load_dir, iteration


# The learning-rate scheduler's saved values and the flags that set them.
_SCHEDULE_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters",
    "lr_decay_steps": "--lr-decay-iters",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--start-weight-decay",
    "end_wd": "--end-weight-decay",
    "wd_incr_steps": "--train-iters",
    "wd_incr_style": "--weight-decay-incr-style",
    "wsd_decay_steps": "--lr-wsd-decay-iters",
}


def _schedule_flags(ours: dict, saved: dict) -> str:
    """The flags (joined by "and") whose scheduler values differ between `ours` and `saved`."""
    names = [
        flag
        for key, flag in _SCHEDULE_FLAGS.items()
        if key in ours and key in saved and ours[key] != saved[key]
    ]
    if "--train-iters" in names and "--lr-decay-iters" in names:
        names.remove("--lr-decay-iters")  # its default: a new --train-iters changes both
    return " and ".join(dict.fromkeys(names))


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _rng_file(path: str, pg: ProcessGroups) -> str:
    return os.path.join(path, "rng", "pp{pp}_tp{tp}_cp{cp}_dp{dp}.pt".format(**pg.coords()))


_MESHES: dict[tuple, Any] = {}


def _tp_mesh(device: torch.device, group: dist.ProcessGroup):
    key = (id(group), device.type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device_type=device.type)
    return _MESHES[key]


def _layout_view(
    tensor: torch.Tensor, param: torch.Tensor, tp_group: dist.ProcessGroup
) -> torch.Tensor:
    """The layout-free view of a parameter-shaped tensor (a DTensor over `tp_group` when
    TP-sharded)."""
    layout = tp_layout(param)
    if layout is None:
        return tensor
    dim, stride = layout
    local = tensor
    shard_dim = dim
    if stride > 1:
        shape = list(tensor.shape)
        local = tensor.view(*shape[:dim], stride, shape[dim] // stride, *shape[dim + 1 :])
        shard_dim = dim + 1
    tp_size = dist.get_world_size(tp_group)
    if tp_size == 1:
        return local
    global_shape = list(local.shape)
    global_shape[shard_dim] *= tp_size
    contiguous = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(
        local,
        _tp_mesh(tensor.device, tp_group),
        [Shard(shard_dim)],
        run_check=False,
        shape=torch.Size(global_shape),
        stride=contiguous,
    )


def _model_chunks(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """This rank's model chunks: a list/tuple or `torch.nn.ModuleList` of chunks (virtual
    pipeline stages, in order) as given, one module as a list of one."""
    if isinstance(model, (list, tuple, torch.nn.ModuleList)):
        return list(model)
    return [model]


def _named_params(
    model: torch.nn.Module | Sequence[torch.nn.Module],
) -> list[tuple[str, str, torch.nn.Parameter, bool]]:
    """(local name, checkpoint name, parameter, is the tied copy) of every parameter of every
    chunk. Each chunk's layers carry their global `layer_number`, so chunk names are already the
    single-stage model's: the checkpoint does not record the chunking."""
    out = []
    for chunk in _model_chunks(model):
        for name, param in chunk.named_parameters():
            out.append((name, layout_free_name(chunk, name), param, is_tied_copy(chunk, name)))
    return out


def _rng_state() -> dict:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    elif (tracker := cpu_tracker()) is not None:
        state["cpu_tracker"] = tracker.get_states()  # dropout's streams on CPU
    return state


def _set_rng_state(state: dict) -> bool:
    """Restore `state`; False when it has no dropout streams for this device (a checkpoint
    saved on CPU before they were saved, or on the other kind of device)."""
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available():
        if "cuda" not in state:
            return False
        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
        return True
    tracker = cpu_tracker()
    if tracker is None:
        return True
    saved = state.get("cpu_tracker")
    if saved is None or set(saved) != set(tracker.get_states()):
        return False
    tracker.set_states(dict(saved))
    return True


def _all_finite(model: torch.nn.Module | Sequence[torch.nn.Module]) -> bool:
    params = [p for chunk in _model_chunks(model) for p in chunk.parameters()]
    # The extremes are NaN or infinite exactly when some element is (aminmax propagates NaN);
    # torch.isfinite(p) would hold an |p| copy and two masks of p's size (1.1 GB for the 1.2B
    # shape's output layer at TP=2, more than the save itself).
    finite = all(
        bool(torch.isfinite(torch.stack(torch.aminmax(p.detach()))).all())
        for p in params
        if p.numel()
    )
    device = params[0].device if params else torch.device("cpu")
    flag = torch.tensor([0.0 if finite else 1.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(flag)
    return flag.item() == 0.0


def _prune(root: str, keep_last: int, latest: int) -> None:
    for iteration in saved_iterations(root)[:-keep_last]:
        if iteration != latest:
            shutil.rmtree(checkpoint_dir(root, iteration), ignore_errors=True)
            logger.info("removed old checkpoint %s", checkpoint_dir(root, iteration))


def save_checkpoint(
    root: str,
    state: TrainState,
    model: torch.nn.Module | Sequence[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    loss_scaler=None,
    *,
    pg: ProcessGroups,
    args_json: Optional[dict] = None,
    save_rng: bool = True,
    keep_last: Optional[int] = None,
    async_save: bool = False,
    digests: bool = True,
):
    """Save (collectively, every rank of the layout `pg`) and return the checkpoint directory,
    written into `iter_XXXXXXX.tmp` and renamed into place when every rank is done.

    `digests` False writes no digests (benchmarks, tests). With `async_save` the tensors are
    staged to CPU and written by a background thread; the returned `PendingSave` finishes the
    checkpoint (rank files, rename, latest marker) once every rank's write completed.

    Raises:
        NonFiniteStateError: a parameter is NaN/inf on some rank (nothing is written).
    """
    if not _all_finite(model):
        raise NonFiniteStateError(
            f"refusing to save iteration {state.iteration}: the model has non-finite parameters"
        )
    final = checkpoint_dir(root, state.iteration)
    tmp = final + ".tmp"
    with _partial_removed_on_failure(tmp):
        failure = None
        try:
            if _rank0():
                os.makedirs(root, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # a killed save's; `SaveLock` sweeps others
                os.makedirs(os.path.join(tmp, "rng"))
                os.makedirs(os.path.join(tmp, DIGESTS_DIR))
        except OSError as error:
            failure = describe_io_error(error, root)
        _stop_if_failed(failure, root, tmp, state.iteration)  # also the barrier

        tensors = _state_tensors(model, optimizer, pg)
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors.values()]
        needed = sum(t.numel() * t.element_size() for t in local)
        # Everything the checkpoint holds is captured now; `finish` only writes it.
        rng = (_rng_file(tmp, pg), _rng_state()) if save_rng else None
        common = {
            "format_version": FORMAT_VERSION,
            "train_state": dataclasses.asdict(state),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "loss_scaler": loss_scaler.state_dict() if loss_scaler is not None else None,
            "layout": pg.layout(),
            "has_optimizer": optimizer is not None,
            "has_rng": save_rng,
            "torch_version": torch.__version__,
        }
        writer = DigestingWriter(tmp) if digests else None
        files = (rng, common, args_json, writer)
        finish = functools.partial(
            _finish_save, root, tmp, final, state.iteration, files, keep_last, needed
        )
        if async_save:
            future = dcp.async_save(
                tensors, checkpoint_id=tmp, storage_writer=writer, process_group=_async_group()
            )
            return PendingSave(future, finish, state.iteration, tmp)
        try:
            dcp.save(tensors, checkpoint_id=tmp, storage_writer=writer)
        except CHECKPOINT_IO_ERRORS as error:
            return finish(error=error)
        return finish()


@contextlib.contextmanager
def _partial_removed_on_failure(tmp: str):
    """Remove the partial checkpoint `tmp` when a save stops on this rank, whatever stopped it
    (Ctrl-C's KeyboardInterrupt, a peer that left, an I/O error): every rank removes it, since
    a slower rank may re-create the directory (DCP's writer makes it) after a faster one
    removed it. A process killed outright leaves it; the next save or interrupt removes it."""
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _state_tensors(model, optimizer, pg: ProcessGroups) -> dict[str, Any]:
    """The layout-free views a save writes: every parameter but the tied copy, and (given
    `optimizer`) the Adam states this rank owns."""
    tensors: dict[str, Any] = {}
    keys: dict[int, str] = {}
    for _, key, param, tied in _named_params(model):
        if not tied:
            tensors[f"model.{key}"] = _layout_view(param.detach(), param, pg.tp)
            keys[id(param)] = key
    for param, adam in (optimizer.owned_state() if optimizer is not None else {}).items():
        key = keys.get(id(param))
        if key is None:
            continue  # the tied copy: its state equals the first stage's
        for name in ("exp_avg", "exp_avg_sq"):
            tensors[f"optim.{key}.{name}"] = _layout_view(adam[name], param, pg.tp)
        tensors[f"optim.{key}.step"] = torch.as_tensor(adam["step"]).detach().float().cpu()
    return tensors


def _stop_if_failed(failure: Optional[str], root: str, tmp: str, iteration: int) -> None:
    """Collective: raise CheckpointSaveError on every rank if any rank failed, after rank 0
    removed the partial checkpoint (which may be what fills the disk)."""
    reason = agree_on_failure(failure)
    if reason is None:
        return
    if _rank0():
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        latest = read_latest_iteration(root)
    except CheckpointError:
        latest = None
    kept = f"iteration {latest} is still the latest" if latest is not None else "none saved yet"
    raise CheckpointSaveError(
        f"saving iteration {iteration} to {root} failed ({reason}); removed the partial "
        f"{os.path.basename(tmp)}, {kept}. Free space or fix the permissions of --save, or "
        "point --save elsewhere, and resume from the latest checkpoint"
    )


def _finish_save(root, tmp, final, iteration, files, keep_last, needed, error=None) -> str:
    """After this rank's shards are written (or failed with `error`): the `files` of
    `_write_rank_files`, then the rename and the latest marker (collective). Any rank's I/O
    failure stops every rank with CheckpointSaveError and leaves the previous latest."""
    failure = describe_io_error(error, root, needed) if error is not None else None
    if failure is None:
        try:
            _write_rank_files(tmp, *files)
        except CHECKPOINT_IO_ERRORS as write_error:
            failure = describe_io_error(write_error, root, needed)
    _stop_if_failed(failure, root, tmp, iteration)  # every rank's files are on disk

    try:
        if _rank0():
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(root)
            atomic_write(os.path.join(root, TRACKER_FILENAME), f"{iteration}\n", fsync=True)
            if keep_last:
                _prune(root, keep_last, iteration)
    except OSError as rename_error:
        failure = describe_io_error(rename_error, root)
    _stop_if_failed(failure, root, tmp, iteration)
    logger.info("saved checkpoint at iteration %d to %s", iteration, display_path(final))
    return final


def _write_rank_files(
    tmp: str,
    rng: Optional[tuple[str, dict]],
    common: dict,
    args_json: Optional[dict],
    writer: Optional[DigestingWriter],
) -> None:
    """This rank's RNG file (`rng`: its path and the states), on rank 0 common.json and
    args.json, then (with the `writer` that hashed the shards) this rank's manifest: its shards
    as hashed while written, the small files hashed now (from the page cache), and on rank 0
    DCP's .metadata."""
    written = []
    if rng is not None:
        save_rng_file(*rng)
        written.append(rng[0])
    if _rank0():
        with open(os.path.join(tmp, "common.json"), "w") as handle:
            json.dump(common, handle, indent=1)
        written.append(os.path.join(tmp, "common.json"))
        if args_json is not None:
            with open(os.path.join(tmp, "args.json"), "w") as handle:
                json.dump(args_json, handle, indent=1, sort_keys=True)
            written.append(os.path.join(tmp, "args.json"))
        written.append(os.path.join(tmp, ".metadata"))
    if writer is None:
        return
    digests: dict[str, FileDigest] = dict(writer.shard_digests())
    for path in written:
        digests[os.path.relpath(path, tmp).replace(os.sep, "/")] = file_digest(path)
    rank, world_size = rank_and_world()
    write_manifest(tmp, rank, world_size, digests)


def save_tensors(path: str, tensors: dict, common: dict, args_json: Optional[dict]) -> None:
    """Write a whole checkpoint directory `path` from one process (offline tools: reshard):
    the DCP shards of `tensors`, common.json, args.json and the digests, as `save_checkpoint`
    writes them (no RNG files; the caller renames it into place)."""
    writer = DigestingWriter(path)
    dcp.save(tensors, storage_writer=writer, no_dist=True)
    _write_rank_files(path, None, common, args_json, writer)


_ASYNC_GROUP: dict = {}


def _async_group():
    """A gloo group of all ranks for the background writes (collective on first use): their
    collectives must not interleave with the training loop's on the default group."""
    key = id(dist.group.WORLD)
    if key not in _ASYNC_GROUP:
        _ASYNC_GROUP.clear()
        _ASYNC_GROUP[key] = dist.new_group(backend="gloo")
    return _ASYNC_GROUP[key]


class PendingSave:
    """An --async-save checkpoint being written; `poll` / `wait` finish it (collectives)."""

    def __init__(self, future, finish, iteration: int, tmp: str) -> None:
        self.future, self.finish, self.iteration, self.tmp = future, finish, iteration, tmp

    def poll(self) -> bool:
        """Finish the checkpoint if every rank's write completed; whether it is finished."""
        done = torch.tensor([1.0 if self.future.done() else 0.0])
        if torch.cuda.is_available():
            done = done.cuda()
        dist.all_reduce(done, op=dist.ReduceOp.MIN)  # the main thread's (default) group
        if done.item() == 0.0:
            return False
        self.wait()
        return True

    def wait(self) -> str:
        """Block until this rank's write completed, then finish the checkpoint everywhere."""
        with _partial_removed_on_failure(self.tmp):
            try:
                self.future.result()
            except CHECKPOINT_IO_ERRORS as error:
                return self.finish(error=error)
            return self.finish()


def _check_same_arm(path: str, model: torch.nn.Module) -> None:
    """Refuse a checkpoint of another embedding arm, naming both (before any shape check)."""
    args_path = os.path.join(path, "args.json")
    ours = getattr(_model_chunks(model)[0], "embedding_type", None)
    if ours is None or not os.path.isfile(args_path):
        return
    with open(args_path) as handle:
        saved = json.load(handle).get("embedding_type")
    if saved is not None and saved != ours:
        raise CheckpointError(
            f"{path} holds a --embedding-type {saved} model, but this run builds "
            f"--embedding-type {ours}; load it into a {saved} model"
        )


def _check_shape(metadata, key: str, view: torch.Tensor, path: str) -> None:
    entry = metadata.state_dict_metadata.get(key)
    if entry is None:
        raise CheckpointError(
            f"{path} has no {key}; it was saved from a different model (check --embedding-type "
            "and the model size flags, or use --use-checkpoint-args)"
        )
    if isinstance(entry, BytesStorageMetadata):
        raise pickled_entry_error(path, key)
    expected = tuple(view.shape)  # a DTensor's shape is its global shape
    saved = tuple(entry.size)
    if saved != expected:
        raise CheckpointError(_shape_mismatch_message(key, saved, expected))


# Parameters whose first dimension is the (padded) vocabulary.
_VOCAB_ROWS = re.compile(r"(word_embeddings|output_layer|\.table)\.weight$")


def _shape_mismatch_message(key: str, saved: tuple, expected: tuple) -> str:
    """Name the parameter and both shapes, and the flags that can explain the difference."""
    message = f"{key}: the checkpoint holds shape {saved}, this model {expected}"
    differs = [i for i, (a, b) in enumerate(zip(saved, expected)) if a != b]
    if len(saved) == len(expected) and differs == [0] and _VOCAB_ROWS.search(key):
        return message + (
            "; the padded vocabulary differs (another tokenizer, or a TP size that changes "
            "the padding: set --make-vocab-size-divisible-by so that both agree)"
        )
    return message + (
        "; the model flags differ (width, layers, heads, or the LEV flags such as "
        "--lev-num-knots / --lev-rank); pass --use-checkpoint-args to take them from the "
        "checkpoint"
    )


def load_checkpoint(
    root: str,
    model: torch.nn.Module | Sequence[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    loss_scaler=None,
    *,
    pg: ProcessGroups,
    iteration: Optional[int] = None,
    load_optim: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
    strict_missing: bool = False,
    verify: bool = True,
) -> Optional[TrainState]:
    """Load the latest (or `iteration`) checkpoint of `root` into this rank's shards (layout
    `pg`), every file checked against its digest first (`verify`); the restored TrainState (zeroed
    with `finetune`), or None when `root` has no checkpoint (an error with `strict_missing`)."""
    if iteration is None:
        iteration = read_latest_iteration(root)
    if iteration is None:
        return _no_checkpoint(root, strict_missing)
    path, common, metadata = _open_checkpoint(root, iteration, model, verify)
    if finetune:
        load_optim = load_rng = False
    _load_tensors(root, iteration, common, metadata, model, optimizer if load_optim else None, pg)
    if finetune:
        logger.info("loaded weights of %s for fine-tuning (iteration reset to 0)", path)
        return TrainState()
    _load_schedule(path, common, scheduler, loss_scaler)
    if load_rng:
        # Each rank reads its own RNG file: every rank must learn that one of them failed.
        try:
            with _unreadable_as_checkpoint_error(root, path, iteration):
                _load_rng(path, common, pg)
        except CheckpointError as error:
            agree_on_failure(str(error))
            raise
        problem = agree_on_failure(None)
        if problem is not None:
            raise CheckpointError(problem)
    state = TrainState(**common["train_state"])
    logger.info(
        "loaded checkpoint %s (iteration %d, %d consumed samples; saved at %s)",
        display_path(path),
        state.iteration,
        state.consumed_train_samples,
        common.get("layout"),
    )
    return state


def _no_checkpoint(root: str, strict_missing: bool) -> None:
    """`root` holds no checkpoint: an error with `strict_missing`, else a warning."""
    where = display_path(os.path.abspath(root))
    what = "does not exist" if not os.path.isdir(root) else f"has no {TRACKER_FILENAME}"
    if strict_missing:
        raise CheckpointError(f"--load {where} {what}: no checkpoint to load")
    if _rank0():
        logger.warning(
            "--load %s %s: starting from scratch (--exit-on-missing-checkpoint makes this "
            "an error)",
            where,
            what,
        )


def _open_checkpoint(root: str, iteration: int, model, verify: bool) -> tuple[str, dict, Any]:
    """(directory, common.json, DCP metadata) of checkpoint `iteration`, its files checked
    (digests with `verify`, else that every shard exists and is long enough) and its arm that
    of `model`."""
    path = checkpoint_dir(root, iteration)
    common_path = os.path.join(path, "common.json")
    if not os.path.isfile(common_path):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no common.json); "
            f"{older_checkpoints_hint(root, iteration)}"
        )
    verified = verify_or_raise(root, iteration) if verify else None
    with _unreadable_as_checkpoint_error(root, path, iteration):
        with open(common_path) as handle:
            common = json.load(handle)
        _check_same_arm(path, model)
        metadata = read_metadata(os.path.join(path, ".metadata"))
    if verified is None or not verified.ok:
        check_shard_files(root, path, iteration, metadata)
    return path, common, metadata


def _load_tensors(root, iteration, common, metadata, model, optimizer, pg) -> None:
    """Read this rank's shards of the parameters and (given `optimizer`) of the Adam states it
    owns, each shape checked against the checkpoint's."""
    path = checkpoint_dir(root, iteration)
    if optimizer is not None and not common.get("has_optimizer", True):
        raise CheckpointError(f"{path} was saved without optimizer state; use --no-load-optim")
    target: dict[str, Any] = {}
    pending = []
    for _, key, param, _tied in _named_params(model):
        view = _layout_view(param.data, param, pg.tp)
        _check_shape(metadata, f"model.{key}", view, path)
        target[f"model.{key}"] = view
        if optimizer is None or not optimizer.owns(param):
            continue
        if f"optim.{key}.step" not in metadata.state_dict_metadata:
            continue
        adam = {name: torch.zeros_like(param.data) for name in ("exp_avg", "exp_avg_sq")}
        for name, moment in adam.items():
            target[f"optim.{key}.{name}"] = _layout_view(moment, param, pg.tp)
        adam["step"] = target[f"optim.{key}.step"] = torch.zeros((), dtype=torch.float32)
        pending.append((param, adam))
    with _unreadable_as_checkpoint_error(root, path, iteration):
        dcp.load(
            target,
            storage_reader=SafeFileSystemReader(path),
            planner=SafeLoadPlanner(path),
        )
    for param, adam in pending:
        optimizer.set_state(param, adam)


def _load_schedule(path: str, common: dict, scheduler, loss_scaler) -> None:
    """The LR scheduler's and the FP16 loss scaler's states, where both sides have them."""
    if scheduler is not None and common.get("scheduler") is not None:
        try:
            scheduler.load_state_dict(common["scheduler"])
        except AssertionError as error:  # megatron's "... do not match"
            flags = _schedule_flags(scheduler.state_dict(), common["scheduler"])
            what = f"{flags} of this command line differs" if flags else str(error).strip()
            raise CheckpointError(
                f"{what} from the run saved in {path} (its learning-rate schedule); pass the "
                "run's value, or --override-opt_param-scheduler to use the command line's "
                "schedule, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's"
            ) from None
    if loss_scaler is not None and common.get("loss_scaler"):
        loss_scaler.load_state_dict(common["loss_scaler"])


@contextlib.contextmanager
def _unreadable_as_checkpoint_error(root: str, path: str, iteration: int):
    """A checkpoint file that cannot be read (truncated, corrupt) as one CheckpointError line
    naming the iteration, the file where known, and an older checkpoint to load instead."""
    try:
        yield
    except CheckpointError:
        raise
    except CHECKPOINT_IO_ERRORS as error:
        ours = next((c for c in causes(error) if isinstance(c, CheckpointError)), None)
        if ours is not None:  # raised inside DCP (e.g. by SafeLoadPlanner), wrapped by it
            raise ours from None
        reason = describe_io_error(error, path)
        files = [getattr(cause, "filename", None) for cause in (error, error.__cause__) if cause]
        where = next((f for f in files if f), path)
        raise CheckpointError(
            f"checkpoint iteration {iteration} cannot be loaded: {where} is corrupt or "
            f"truncated ({reason}); {older_checkpoints_hint(root, iteration)}"
        ) from None


def _load_rng(path: str, common: dict, pg: ProcessGroups) -> None:
    saved_layout = common.get("layout")
    file = _rng_file(path, pg)
    if not common.get("has_rng", True) or saved_layout != pg.layout() or not os.path.isfile(file):
        if _rank0():
            logger.warning(
                "RNG states not restored (checkpoint layout %s, this run %s): dropout streams "
                "restart from --seed",
                saved_layout,
                pg.layout(),
            )
        return
    if not _set_rng_state(load_rng_file(file)) and _rank0():
        logger.warning(
            "%s has no dropout RNG states for this device (saved by an older version, or on "
            "another kind of device): dropout streams restart from --seed",
            display_path(path),
        )


def verify_or_raise(
    root: str, iteration: int, progress: bool = False, announce: bool = True
) -> Verification:
    """Check checkpoint `iteration` of `root` against its digests (collective) and return the
    outcome; without digests, warn once. `announce`: log a line when every file matches.

    Raises:
        CheckpointDigestError (every rank): a file is damaged, missing or of another size; the
            message names the file and the newest older checkpoint that verifies.
    """
    path = checkpoint_dir(root, iteration)
    started = time.time()
    verified = verify_checkpoint(path, progress)
    if not verified.has_digests:
        if _rank0():
            logger.warning(
                "checkpoint iteration %d (%s) has no digests (saved before digests were "
                "recorded, or by another tool): loading it unverified",
                iteration,
                display_path(path),
            )
        return verified
    if verified.problems:
        first = verified.problems[0]
        others = verified.problems[1:]
        more = f" (and {len(others)} more: {', '.join(p.name for p in others)})" if others else ""
        raise CheckpointDigestError(
            f"checkpoint iteration {iteration} cannot be loaded: "
            f"{display_path(os.path.join(path, first.name))} {first.what}{more} (a bad copy or "
            f"a failing disk?); {_newest_verified(root, iteration)}"
        )
    if announce and _rank0():
        logger.info(
            "verified checkpoint %s: %d files, %.1f MiB match their digests (%.1f s)",
            display_path(path),
            verified.files,
            verified.bytes / 2**20,
            time.time() - started,
        )
    return verified


def _newest_verified(root: str, iteration: int) -> str:
    """Collective: which older checkpoint of `root` to load instead (the newest that verifies;
    one without digests is named as unverified)."""
    older = older_iterations(root, iteration)
    where = display_path(root)
    if not older:
        return f"there is no older checkpoint in {where}; copy iteration {iteration} again"
    for candidate in older:
        verified = verify_checkpoint(checkpoint_dir(root, candidate))
        if verified.ok:
            return (
                f"iteration {candidate} verifies: load it with --ckpt-step {candidate}, or copy "
                f"iteration {iteration} again"
            )
        if not verified.has_digests:
            return (
                f"iteration {candidate} has no digests to check it with: load it with "
                f"--ckpt-step {candidate} at your own risk, or copy iteration {iteration} again"
            )
    listed = ", ".join(map(str, older))
    return f"no older checkpoint in {where} verifies ({listed}); copy iteration {iteration} again"
