#!/usr/bin/env python
"""Train a SentencePiece tokenizer (BPE by default, unigram by flag) on jsonl corpora.

A thin script over `megatron_ext.data.train_tokenizer`, which is also run as
`python -m megatron_ext.data.train_tokenizer` or the `leviathan-train-tokenizer` console script.
"""

import sys

from megatron_ext.data.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
