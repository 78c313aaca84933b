"""The checkpoint format and its I/O, below training, inference and conversion: `format` (the
directory layout, save and load at any layout), `digests` (every file's digest, checked before
a load), `safe_load` (reading runs no code), `lock` (one run per --save) and `io_errors` (the
exceptions; I/O failures as one line agreed on by every rank).
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
