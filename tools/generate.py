#!/usr/bin/env python
"""Generate text from a training checkpoint (any arm) with a KV cache.

A thin script over `megatron_ext.inference.generate`, which is also run as
`python -m megatron_ext.inference.generate` or the `leviathan-generate` console script.
"""

import sys

from megatron_ext.inference.generate import main

if __name__ == "__main__":
    sys.exit(main())
