"""Write a small GPT-2 style ``vocab.json`` / ``merges.txt`` pair for tests (GPT2BPETokenizer).

The pair is learned with the `tokenizers` library's byte-level BPE trainer (a test dependency,
via transformers), so its files have the exact layout of OpenAI's GPT-2 files, but its ids are
not in merge order: a GPT2BPETokenizer that confused ranks with ids would fail."""

from __future__ import annotations

import os
from typing import Iterable

__all__ = ["write_gpt2_bpe_files"]


def write_gpt2_bpe_files(directory: str, texts: Iterable[str], vocab_size: int = 600):
    """Train on `texts`; return (vocab.json path, merges.txt path) in `directory`."""
    # optional: the [test] extra (transformers')
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        list(texts), vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"]
    )
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_model(directory)
    return os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
