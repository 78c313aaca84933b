"""LEV (Learned Embedding Vectorization): the input generator of Leviathan models.

    from megatron_ext.lev import LEVConfig, LEVEmbedding

`LEVConfig` holds the hyper-parameters (docs/lev.md section 2) and declares their `--lev-*`
flags (`config.flags`, as every config does);
`LEVEmbedding` is the tensor-parallel module that replaces megatron's VocabParallelEmbedding;
`lev.math` is the readable forward pass; `lev.kernels` the memory-lean autograd Function
over its backends (`LEVKernelOptions`, `lev_modes`).
"""

from megatron_ext._lazy import lazy_exports
from megatron_ext.config.lev import LEVConfig, smallest_base
from megatron_ext.lev.kernels import LEVKernelOptions, lev_modes

# Its module imports megatron-core: loaded on first use (see megatron_ext/_lazy.py).
_LAZY = {
    "LEVEmbedding": "megatron_ext.lev.layer",
    "LEV_PARAMETER_NAMES": "megatron_ext.lev.layer",
    "LEV_TP_PARTITION_DIMS": "megatron_ext.lev.layer",
}

__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "LEVConfig",
    "LEVEmbedding",
    "LEVKernelOptions",
    "LEV_PARAMETER_NAMES",
    "LEV_TP_PARTITION_DIMS",
    "lev_modes",
    "smallest_base",
]
