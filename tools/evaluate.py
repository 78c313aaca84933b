#!/usr/bin/env python
"""Evaluate training checkpoints: the paper's tables and figures for your own runs.

A thin script over `megatron_ext.evaluation.evaluate`, which is also run as
`python -m megatron_ext.evaluation.evaluate` or the `leviathan-evaluate` console script.
"""

import sys

from megatron_ext.evaluation.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
