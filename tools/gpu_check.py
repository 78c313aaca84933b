#!/usr/bin/env python
"""The GPU check: correctness of the GPU paths, then 1.2B throughput, into one JSON file."""

from megatron_ext.gpu_check import main

if __name__ == "__main__":
    raise SystemExit(main())
