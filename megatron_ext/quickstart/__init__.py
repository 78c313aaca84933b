"""The quick start: the whole product on CPU as resumable stages (``tools/quickstart.py``)."""

from megatron_ext.quickstart.pipeline import ALL_ARMS, Settings, build_stages, main, parse_args
from megatron_ext.quickstart.stages import MARKER, Stage, StageError, run_stages

__all__ = [
    "ALL_ARMS",
    "MARKER",
    "Settings",
    "Stage",
    "StageError",
    "build_stages",
    "main",
    "parse_args",
    "run_stages",
]
