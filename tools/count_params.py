#!/usr/bin/env python
"""Parameter table of every arm x scale x vocabulary, from the configuration alone.

Nothing is allocated, so the 1.2B rows are instant. With --memory, per-GPU memory (weights,
grads, optimizer states, activations with and without full recompute) and training FLOPs per
token for a parallel layout instead (megatron_ext/models/param_table.py). Examples:

    python tools/count_params.py                       # Markdown, all arms/scales/vocabs
    python tools/count_params.py --format csv --scales 1.2b --vocab-sizes 200064
    python tools/count_params.py --num-layers 4 --hidden-size 256 --num-attention-heads 4 \\
        --vocab-sizes 32000                            # a custom shape instead of presets
    python tools/count_params.py --memory --scales 1.2b --vocab-sizes 200064 --arms lev tied \
        --data-parallel-size 8 --micro-batch-size 2 --seq-length 4096   # plan 1.2B on 8 GPUs
"""

import sys

from megatron_ext.models.param_table import main

if __name__ == "__main__":
    sys.exit(main())
