"""Training: Megatron-LM's flags, the portable loop (gloo/NCCL), optimizer, pipeline schedule,
distributed checkpoints and logging. The entry point is `pretrain_leviathan.py`."""

from megatron_ext._lazy import lazy_exports
from megatron_ext.config.flags import ArgumentError
from megatron_ext.config.run import RunConfig

# Their modules import megatron-core: loaded on first use (see megatron_ext/_lazy.py), so the
# run's configs (`config.run`) need only torch.
_LAZY = {
    "build_parser": "megatron_ext.config.arguments",
    "parse_config": "megatron_ext.config.arguments",
    "run_config_from_args_json": "megatron_ext.config.arguments",
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
    "ArgumentError",
    "CheckpointError",
    "CollectiveTimeoutError",
    "NonFiniteError",
    "RunConfig",
    "TrainState",
    "build_parser",
    "load_checkpoint",
    "parse_config",
    "pretrain",
    "read_latest_iteration",
    "run_config_from_args_json",
    "save_checkpoint",
]
