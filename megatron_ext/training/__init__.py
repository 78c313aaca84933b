"""Training: the portable loop (gloo/NCCL), optimizer, pipeline schedule,
distributed checkpoints and logging. The entry point is `pretrain_leviathan.py`."""

from megatron_ext._lazy import lazy_exports

# Their modules import megatron-core: loaded on first use (see megatron_ext/_lazy.py).
_LAZY = {
    "CheckpointError": "megatron_ext.checkpoint.format",
    "TrainState": "megatron_ext.checkpoint.format",
    "load_checkpoint": "megatron_ext.checkpoint.format",
    "read_latest_iteration": "megatron_ext.checkpoint.format",
    "save_checkpoint": "megatron_ext.checkpoint.format",
    "NonFiniteError": "megatron_ext.training.loop",
    "CollectiveTimeoutError": "megatron_ext.training.run",
    "pretrain": "megatron_ext.training.run",
}

__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "CheckpointError",
    "CollectiveTimeoutError",
    "NonFiniteError",
    "TrainState",
    "load_checkpoint",
    "pretrain",
    "read_latest_iteration",
    "save_checkpoint",
]
