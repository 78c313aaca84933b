"""Writes docs/megatron-compat.md from the entry point's parser.

python -m megatron_ext.training.compat_doc --write docs/megatron-compat.md
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from megatron_ext._paths import atomic_write
from megatron_ext.config.arguments import build_parser
from megatron_ext.config.megatron_compat import compat_table

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Write (or print) the table; 0 on success."""
    parser = argparse.ArgumentParser(description="Write docs/megatron-compat.md")
    parser.add_argument("--write", default=None, help="output path (default: stdout)")
    args = parser.parse_args(argv)
    text = compat_table(build_parser())
    if args.write is None:
        sys.stdout.write(text)
    else:
        atomic_write(args.write, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
