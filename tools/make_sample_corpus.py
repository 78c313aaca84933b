#!/usr/bin/env python
"""Write a small deterministic Pile-format corpus (jsonl.zst) for demos and tests.

A thin script over `megatron_ext.data.make_sample_corpus`, which is also run as
`python -m megatron_ext.data.make_sample_corpus`
or the `leviathan-make-sample-corpus` console script.
"""

import sys

from megatron_ext.data.make_sample_corpus import main

if __name__ == "__main__":
    sys.exit(main())
