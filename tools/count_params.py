#!/usr/bin/env python
"""Parameter table of every arm x scale x vocabulary, from the configuration alone."""

import sys

from megatron_ext.models.param_table import main

if __name__ == "__main__":
    sys.exit(main())
