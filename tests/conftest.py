"""Session-wide test set-up, loaded before any test module (and so before triton is imported).

Without a GPU, Triton kernels run in Triton's CPU interpreter, which must be chosen before
triton is first imported (megatron-core imports it): tests/lev/test_lev_triton.py relies on it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
