"""Input modules of the baselines and ablations (docs/lev.md section 3), each with
VocabParallelEmbedding's contract: `forward(input_ids [b, s])` -> the TP-complete [b, s, D], or
[s/tp, b, D] with `reduce_scatter_embeddings` (sequence parallel).

- `LookupSeedEmbedding` (albert, flat-mlp): a vocab-parallel V x m table, then a replicated
  m -> D map: a linear projection (albert) or LayerNorm + SiLU MLP (flat-mlp).
- `DigitSeedEmbedding` (factored-mlp): LEV's replicated digit codebooks, then the same MLP.

Replicated parameters are tagged `sequence_parallel` (their gradients summed across TP like
Megatron's norm weights); a fresh model's input embeddings have the usual 0.02 scale.
"""

from __future__ import annotations

import math
from typing import Optional

import megatron_ext.megatron_import  # noqa: F401

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.utils import (
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from megatron.core.utils import get_pg_rank, get_pg_size

from megatron_ext.config.lev import LEVConfig
from megatron_ext.lev import math as lev_math
from megatron_ext.tensor_parallel import PortableVocabParallelEmbedding, check_sequence_split

__all__ = ["SeedToHidden", "LookupSeedEmbedding", "DigitSeedEmbedding"]


def _normal(shape, std: float, config: TransformerConfig) -> torch.nn.Parameter:
    device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else "cuda"
    tensor = torch.empty(shape, dtype=torch.float32, device="cpu")
    if config.perform_initialization:
        tensor.normal_(0.0, std)
    return torch.nn.Parameter(tensor.to(device=device, dtype=config.params_dtype))


class SeedToHidden(torch.nn.Module):
    """Replicated seed -> hidden map: a linear projection (mlp_hidden None) or
    LayerNorm -> Linear(m, H) -> SiLU -> Linear(H, D). No biases besides the norm's.

    Input [..., m] -> output [..., D].
    """

    def __init__(
        self, seed_dim: int, hidden_size: int, mlp_hidden: Optional[int], config: TransformerConfig
    ):
        super().__init__()
        self.mlp_hidden = mlp_hidden
        std = config.init_method_std
        if mlp_hidden is None:
            # z ~ N(0, std^2) per coordinate, so W ~ N(0, 1/m) keeps the output at scale std.
            self.proj = _normal((hidden_size, seed_dim), 1.0 / math.sqrt(seed_dim), config)
        else:
            ones = torch.ones(seed_dim, dtype=config.params_dtype)
            self.norm_weight = torch.nn.Parameter(ones)
            self.norm_bias = torch.nn.Parameter(torch.zeros_like(ones))
            self.fc1 = _normal((mlp_hidden, seed_dim), 1.0 / math.sqrt(seed_dim), config)
            # silu(N(0, 1)) has an RMS of about 0.6; scale fc2 so the output starts at `std`.
            fc2_std = std / (0.6 * math.sqrt(mlp_hidden))
            self.fc2 = _normal((hidden_size, mlp_hidden), fc2_std, config)
        for param in self.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Map seeds [..., m] to embeddings [..., D]."""
        # Outside autocast, in the parameters' dtype: every arm hands layer 0 the same dtype as
        # a lookup table does (training/precision.py); the network is small (m -> D).
        dtype = self.fc2.dtype if self.mlp_hidden is not None else self.proj.dtype
        with torch.autocast(device_type=z.device.type, enabled=False):
            z = z.to(dtype)
            if self.mlp_hidden is None:
                return F.linear(z, self.proj)
            z = F.layer_norm(z, (z.size(-1),), self.norm_weight, self.norm_bias, 1e-5)
            return F.linear(F.silu(F.linear(z, self.fc1)), self.fc2)


class LookupSeedEmbedding(torch.nn.Module):
    """ALBERT's factorised input (`mlp_hidden` None: a linear m -> D projection) or the FLAT-MLP
    ablation: a V x m (`seed_dim`) table split over the vocabulary across TP ranks."""

    def __init__(
        self,
        vocab_size: int,
        seed_dim: int,
        mlp_hidden: Optional[int],
        *,
        config: TransformerConfig,
        reduce_scatter_embeddings: bool = False,
        tp_group=None,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.table = PortableVocabParallelEmbedding(
            num_embeddings=vocab_size,
            embedding_dim=seed_dim,
            init_method=config.embedding_init_method,
            reduce_scatter_embeddings=reduce_scatter_embeddings,
            config=config,
            tp_group=tp_group,
        )
        self.to_hidden = SeedToHidden(seed_dim, config.hidden_size, mlp_hidden, config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embed ids [b, s] -> [b, s, D], or [s/tp, b, D] under reduce-scatter."""
        return self.to_hidden(self.table(input_ids))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The table sharded over the vocabulary, the seed -> hidden network replicated."""
        sharded = self.table.sharded_state_dict(f"{prefix}table.", sharded_offsets, metadata)
        sharded.update(
            sharded_state_dict_default(
                self.to_hidden,
                f"{prefix}to_hidden.",
                sharded_offsets,
                metadata,
                self.table.tp_group,
            )
        )
        return sharded


class DigitSeedEmbedding(torch.nn.Module):
    """FACTORED-MLP ablation: LEV's digit codebooks (V, k, b, d_seed and the codebook combine of
    `lev_config`) + norm + MLP of hidden width `mlp_hidden`, all replicated."""

    def __init__(
        self,
        lev_config: LEVConfig,
        mlp_hidden: int,
        *,
        config: TransformerConfig,
        reduce_scatter_embeddings: bool = False,
        tp_group=None,
    ):
        super().__init__()
        lc = lev_config
        self.vocab_size, self.num_digits, self.base = lc.vocab_size, lc.num_digits, lc.base
        self.codebook_combine = lc.codebook_combine
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.tp_group = tp_group
        self.codebooks = _normal(
            (lc.num_digits, lc.base, lc.seed_dim), config.init_method_std, config
        )
        setattr(self.codebooks, "sequence_parallel", config.sequence_parallel)
        self.to_hidden = SeedToHidden(lc.seed_in_dim, config.hidden_size, mlp_hidden, config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embed ids [b, s] -> [b, s, D], or this rank's [s/tp, b, D] under sequence parallelism."""
        lev_math.check_ids(input_ids, self.vocab_size)
        if self.reduce_scatter_embeddings:
            # Only this rank's slice of the sequence: [b, s] -> [s/tp, b].
            # tp_group None: not tensor-parallel (size 1), never the default world group.
            size, rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
            check_sequence_split(input_ids.size(1), size)
            input_ids = input_ids.t().chunk(size, dim=0)[rank]
        digits = lev_math.to_digits(input_ids.reshape(-1), self.base, self.num_digits)
        z = lev_math.seed(self.codebooks, digits, self.codebook_combine)  # [N, seed width]
        return self.to_hidden(z).view(*input_ids.shape, -1)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Every parameter is replicated across TP (the codebooks and the network)."""
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )
