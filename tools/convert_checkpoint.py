#!/usr/bin/env python
"""Convert checkpoints: Hugging Face export/import, Megatron-LM export, offline resharding."""

from megatron_ext.conversion.convert_checkpoint import main

if __name__ == "__main__":
    raise SystemExit(main())
