"""The whole product on CPU, stage by stage: corpus -> tokenizer -> datasets -> training of
several arms -> evaluation -> report -> Hugging Face export (megatron_ext/quickstart/).

    python tools/quickstart.py --out runs/quickstart                # TIED vs LEV, 5-8 minutes
"""

from megatron_ext.quickstart import main

if __name__ == "__main__":
    raise SystemExit(main())
