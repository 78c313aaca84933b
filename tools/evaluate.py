#!/usr/bin/env python
"""Evaluate training checkpoints: the paper's tables and figures for your own runs."""

from megatron_ext.evaluation.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())
