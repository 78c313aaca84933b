#!/usr/bin/env python
"""Convert checkpoints: Hugging Face export/import, Megatron-LM export, offline resharding.

A thin script over `megatron_ext.conversion.convert_checkpoint`, which is also run as
`python -m megatron_ext.conversion.convert_checkpoint`
or the `leviathan-convert-checkpoint` console script.
"""

import sys

from megatron_ext.conversion.convert_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
