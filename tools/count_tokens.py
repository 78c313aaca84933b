#!/usr/bin/env python
"""Write the token counts (and the tokenizer record) of existing datasets, e.g. made by
Megatron-LM's preprocess_data.py, so that frequency evaluation works on them.

A thin script over `megatron_ext.data.count_tokens`, which is also run as
`python -m megatron_ext.data.count_tokens` or the `leviathan-count-tokens` console script.
"""

import sys

from megatron_ext.data.count_tokens import main

if __name__ == "__main__":
    sys.exit(main())
