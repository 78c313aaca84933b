#!/usr/bin/env python
"""Evaluate training checkpoints: the paper's tables and figures for your own runs."""

import sys

from megatron_ext.evaluation.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
