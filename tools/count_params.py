#!/usr/bin/env python
"""Parameter table of every arm x scale x vocabulary, from the configuration alone.

A thin script over `megatron_ext.models.param_table`, which is also run as
`python -m megatron_ext.models.param_table` or the `leviathan-count-params` console script.
"""

import sys

from megatron_ext.models.param_table import main

if __name__ == "__main__":
    sys.exit(main())
