"""The checkpoint format and its I/O, below training, inference and conversion (as
Megatron-Core's dist_checkpointing is below Megatron-LM's training loop).

- `format`: the layout of a checkpoint directory (`<save>/iter_0000100/`, the latest marker),
  its save (atomic, also in the background) and its load at any TP/PP/DP layout;
- `digests`: the digest of every file a save writes, recorded inside the checkpoint, and the
  check of them all before a load reads anything;
- `safe_load`: reading a checkpoint runs no code from it (restricted unpickling of DCP's
  metadata, RNG states as tensors, no pickled entries);
- `lock`: one run per --save (a lock with a lease, taken over when its holder is gone);
- `io_errors`: the exception classes, and I/O failures as one clear line agreed on by every
  rank.

`training/checkpoint_manager.py` is a run's glue around them; `inference/` and `conversion/`
read checkpoints through this package.
"""

from megatron_ext._lazy import lazy_exports

__all__ = [
    "CheckpointDigestError",
    "CheckpointError",
    "TRACKER_FILENAME",
    "TrainState",
    "checkpoint_dir",
    "load_checkpoint",
    "read_latest_iteration",
    "save_checkpoint",
    "verify_or_raise",
]

# The format module imports megatron-core (seconds): loaded on first use, so that a tool can
# name CheckpointError among its expected errors without paying for it.
__getattr__ = lazy_exports(__name__, {name: "megatron_ext.checkpoint.format" for name in __all__})
