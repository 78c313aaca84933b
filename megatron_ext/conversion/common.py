"""What every converter shares: one-line errors, atomic output directories, the padding of
vocabulary rows.

Outputs are written into a hidden temporary directory beside the destination and renamed into
place only when complete, so an error or Ctrl-C never leaves a half-written export behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from typing import Iterator

import torch

from megatron_ext._paths import display_path

__all__ = [
    "ConversionError",
    "DTYPES",
    "HF_FORMATS",
    "atomic_output_dir",
    "new_output",
    "resize_rows",
]

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HF_FORMATS = ("llama", "leviathan")
"""export-hf's --hf-format: LEV materialised into a Llama table, or kept (hf_leviathan)."""


class ConversionError(RuntimeError):
    """Bad input to a converter; the message is one line saying what to change."""


def new_output(path: str, overwrite: bool) -> str:
    """The absolute `path`; ConversionError when it exists and `overwrite` is False (checked
    before a long load, and again by `atomic_output_dir`)."""
    path = os.path.abspath(path)
    if os.path.lexists(path) and not overwrite:
        raise ConversionError(
            f"output {display_path(path)} already exists; pass --overwrite or pick another"
        )
    return path


@contextlib.contextmanager
def atomic_output_dir(path: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary directory that becomes `path` when the block completes (`new_output`
    checks `path` first)."""
    path = new_output(path, overwrite)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.lexists(path):
        old = os.path.join(parent, f".{os.path.basename(path)}.old{os.getpid()}")
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    logger.info("wrote %s", display_path(path))


def resize_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A copy of `tensor` [V, ...] with `rows` rows: trimmed, or padded with zero rows."""
    if tensor.size(0) >= rows:
        return tensor[:rows].clone()
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.size(0), *tensor.shape[1:])])
