"""The quick start: the whole product on CPU as resumable stages (``tools/quickstart.py``)."""

from megatron_ext.quickstart.pipeline import ALL_ARMS, main
from megatron_ext.quickstart.stages import MARKER

__all__ = ["ALL_ARMS", "MARKER", "main"]
