"""Training: Megatron-LM's flags, the portable loop (gloo/NCCL), optimizer, pipeline schedule,
distributed checkpoints and logging. The entry point is `pretrain_leviathan.py`."""

from megatron_ext.checkpoint.format import (
    CheckpointError,
    TrainState,
    load_checkpoint,
    read_latest_iteration,
    save_checkpoint,
)
from megatron_ext.training.arguments import (
    ArgumentError,
    build_parser,
    parse_args,
    parse_config,
    training_config_from_args,
    validate_args,
)
from megatron_ext.training.config import TrainingConfig
from megatron_ext.training.loop import NonFiniteError
from megatron_ext.training.run import CollectiveTimeoutError, pretrain

__all__ = [
    "ArgumentError",
    "CheckpointError",
    "CollectiveTimeoutError",
    "NonFiniteError",
    "TrainState",
    "TrainingConfig",
    "build_parser",
    "load_checkpoint",
    "parse_args",
    "parse_config",
    "pretrain",
    "read_latest_iteration",
    "save_checkpoint",
    "training_config_from_args",
    "validate_args",
]
