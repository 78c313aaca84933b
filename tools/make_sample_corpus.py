#!/usr/bin/env python
"""Write a small deterministic Pile-format corpus (jsonl.zst) for demos and tests."""

from megatron_ext.data.make_sample_corpus import main

if __name__ == "__main__":
    raise SystemExit(main())
