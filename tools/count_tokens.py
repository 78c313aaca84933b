#!/usr/bin/env python
"""Write the token counts (and the tokenizer record) of existing datasets, e.g. made by
Megatron-LM's preprocess_data.py, so that frequency evaluation works on them."""

from megatron_ext.data.count_tokens import main

if __name__ == "__main__":
    raise SystemExit(main())
