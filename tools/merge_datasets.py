#!/usr/bin/env python
"""Concatenate indexed datasets (e.g. per-shard preprocess outputs) and sum their token counts."""

from megatron_ext.data.merge_datasets import main

if __name__ == "__main__":
    raise SystemExit(main())
