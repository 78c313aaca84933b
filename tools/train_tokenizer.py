#!/usr/bin/env python
"""Train a SentencePiece tokenizer (BPE by default, unigram by flag) on jsonl corpora."""

from megatron_ext.data.train_tokenizer import main

if __name__ == "__main__":
    raise SystemExit(main())
