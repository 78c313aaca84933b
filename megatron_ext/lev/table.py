"""LEV's [V, D] table, materialised through the training kernels' forward (no autograd), for
exports, the eval table and generation. Per chunk of n ids::

    ids [n] -> digits [n, k] -> u [n, h, d] -> t [h, n, d] -> M [n, h, r] -> e [n, D]

the seed projection by digit (`lev.kernels.digit_projection`, once per table), steps 3b-3e by
the backend that trains (`--lev-kernel`), and out_proj written straight into the output rows.
The result is this rank's partial embedding, float32 or float64 (`dtype`).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from megatron_ext.config.lev import LEVConfig
from megatron_ext.lev import math as lev_math
from megatron_ext.lev.kernels import (
    LEVKernelOptions,
    digit_projection,
    digit_sum,
    select_backend,
)

__all__ = ["LEVTable", "table_chunk_size"]

# Spline values phi per chunk (h*d*r*n of them): 16M (64 MiB in float32; 256 ids at the
# defaults) amortise the per-op overhead and thread start-up; measured best on 2 CPU cores.
_CHUNK_ELEMENTS = 1 << 24


def table_chunk_size(num_heads: int, seed_dim: int, rank: int) -> int:
    """Ids per chunk so that one chunk's spline values hold about 16M numbers."""
    return max(1, _CHUNK_ELEMENTS // (num_heads * seed_dim * rank))


class LEVTable:
    """This rank's LEV embeddings of any ids, from parameters prepared once (no autograd).

    `params`: this rank's parameters by name (any dtype and device); `dtype`: compute and
    output dtype (float32 or float64); `chunk_size`: ids per chunk (0: `table_chunk_size`).
    """

    def __init__(
        self,
        lev_config: LEVConfig,
        params: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        chunk_size: int = 0,
    ):
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"LEV tables are computed in float32 or float64, not {dtype}")
        lc = self.lev_config = lev_config
        self.dtype = dtype
        with torch.no_grad():
            p = {name: t.detach().to(dtype) for name, t in params.items()}
            codebooks = p["codebooks"]  # [k, b, d]
            h, d, _ = p["seed_proj"].shape
            self.digit_proj = digit_projection(codebooks, p["seed_proj"], lc.codebook_combine)
            self.gain = (p["seed_norm_weight"] / lc.temperature).contiguous()  # [h, d]
            self.shift = (p["seed_norm_bias"] / lc.temperature).contiguous()
            kappa, r = p["spline_delta"].shape[2:]
            self.delta = p["spline_delta"].contiguous()  # [h, d, kappa, r]
            self.out_proj = p["out_proj"].reshape(h * r, -1).contiguous()
        self.num_heads, self.seed_dim, self.num_knots, self.rank = h, d, kappa, r
        self.hidden_size = self.out_proj.shape[1]
        self.device = codebooks.device
        self.chunk_size = chunk_size or table_chunk_size(h, d, r)
        # The training kernels' forward; "reference" (plain autograd) has none: torch ops.
        kernel = "torch" if lc.kernel == "reference" else lc.kernel
        self.backend = select_backend(kernel, self.delta.new_empty(0))
        self.opts = LEVKernelOptions.of(lc)

    @torch.no_grad()
    def modes(self, ids: torch.Tensor) -> torch.Tensor:
        """Steps 1-3e: ids [n] (int64, in [0, V), not checked) -> M [n, h, r]."""
        lc = self.lev_config
        with torch.autocast(device_type=self.device.type, enabled=False):
            digits = lev_math.to_digits(ids, lc.base, lc.num_digits)  # [n, k]
            u = digit_sum(self.digit_proj, digits).view(-1, self.num_heads, self.seed_dim)
            t = self.backend.seed_norm.forward(u, self.gain, self.shift, lc.norm_eps).sigmoid_()
            return self.backend.forward(t.transpose(0, 1), self.delta, self.opts)

    @torch.no_grad()
    def rows(self, ids: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Embeddings of ids [n] -> [n, D] (into `out` when given), one chunk at a time."""
        n = ids.shape[0]
        if out is None:
            out = torch.empty(n, self.hidden_size, dtype=self.dtype, device=self.device)
        for start in range(0, n, self.chunk_size):
            chunk = ids[start : start + self.chunk_size]
            modes = self.modes(chunk).reshape(chunk.shape[0], -1)  # [n', h*r]
            target = out[start : start + chunk.shape[0]]
            if target.dtype == self.dtype and target.is_contiguous():
                torch.mm(modes, self.out_proj, out=target)
            else:
                target.copy_(torch.mm(modes, self.out_proj))
        return out

    @torch.no_grad()
    def table(
        self,
        out: Optional[torch.Tensor] = None,
        progress: Optional[Callable[[int], None]] = None,
    ) -> torch.Tensor:
        """The whole [V, D] table (into `out` when given); `progress(ids_done)` per chunk."""
        vocab = self.lev_config.vocab_size
        if out is None:
            out = torch.empty(vocab, self.hidden_size, dtype=self.dtype, device=self.device)
        for start in range(0, vocab, self.chunk_size):
            ids = torch.arange(start, min(start + self.chunk_size, vocab), device=self.device)
            self.rows(ids, out[start : start + ids.shape[0]])
            if progress is not None:
                progress(ids.shape[0])
        return out
