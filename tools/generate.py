#!/usr/bin/env python
"""Generate text from a training checkpoint (any arm) with a KV cache."""

from megatron_ext.inference.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
