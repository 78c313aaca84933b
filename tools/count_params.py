#!/usr/bin/env python
"""Parameter table of every arm x scale x vocabulary, from the configuration alone."""

from megatron_ext.models.param_table import main

if __name__ == "__main__":
    raise SystemExit(main())
