#!/usr/bin/env python
"""Tokenise jsonl corpora into Megatron-Core indexed datasets (Megatron-LM's flags).

A thin script over `megatron_ext.data.preprocess_data`, which is also run as
`python -m megatron_ext.data.preprocess_data` or the `leviathan-preprocess-data` console script.
"""

import sys

from megatron_ext.data.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
