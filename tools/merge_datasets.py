#!/usr/bin/env python
"""Concatenate indexed datasets (e.g. per-shard preprocess outputs) and sum their token counts.

A thin script over `megatron_ext.data.merge_datasets`, which is also run as
`python -m megatron_ext.data.merge_datasets` or the `leviathan-merge-datasets` console script.
"""

import sys

from megatron_ext.data.merge_datasets import main

if __name__ == "__main__":
    sys.exit(main())
