#!/usr/bin/env python
"""Tokenise jsonl corpora into Megatron-Core indexed datasets (Megatron-LM's flags)."""

from megatron_ext.data.preprocess_data import main

if __name__ == "__main__":
    raise SystemExit(main())
