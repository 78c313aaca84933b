"""Training: the portable loop (gloo/NCCL), optimizer, pipeline schedule, checkpoint glue and
logging. The entry point is `pretrain_leviathan.py`."""

from megatron_ext._lazy import lazy_exports

# Their modules import megatron-core: loaded on first use (see megatron_ext/_lazy.py).
_LAZY = {
    "NonFiniteError": "megatron_ext.training.engine",
    "CollectiveTimeoutError": "megatron_ext.training.run",
    "pretrain": "megatron_ext.training.run",
}

__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = ["CollectiveTimeoutError", "NonFiniteError", "pretrain"]
