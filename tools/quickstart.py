"""The whole product on CPU, stage by stage: corpus -> tokenizer -> datasets -> training of
several arms -> evaluation -> report (tables + PNGs) -> Hugging Face export and a greedy
continuation through transformers (megatron_ext/quickstart/).

Every stage writes into a hidden temporary directory ``OUT/.<stage>.tmp`` and is renamed into
place only when complete, so an interrupted or failed stage leaves nothing behind and is redone
by the next run; a finished stage whose settings did not change is reused.

    python tools/quickstart.py --out runs/quickstart                # TIED vs LEV, 5-8 minutes
    python tools/quickstart.py --out runs/qs_short --iters 20       # a shortened run
"""

import sys

from megatron_ext.quickstart import main

if __name__ == "__main__":
    sys.exit(main())
