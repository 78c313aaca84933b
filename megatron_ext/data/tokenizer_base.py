"""The tokenizer interface (`Tokenizer`) and its error type, shared by every tokenizer module.

What each tokenizer exposes is described in `tokenizers`' module docstring; the types and
`build_tokenizer` live there, `GPT2BPETokenizer` in `gpt2_bpe`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from typing import Optional, Sequence

__all__ = ["Tokenizer", "TokenizerError"]


class TokenizerError(ValueError):
    """A tokenizer cannot be built or used; the message is one line that says what to change."""


def _file_digest(path: str, limit: int = 1 << 26) -> str:
    """sha256 of (at most the first ``limit`` bytes of) a file, for cache identifiers."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        digest.update(handle.read(limit))
    return digest.hexdigest()[:16]


class Tokenizer:
    """Base class: the interface shared by all tokenizers (see the module docstring)."""

    #: The name used with ``--tokenizer-type``.
    type_name: str = ""

    def __init__(self, model_path: Optional[str]) -> None:
        self.model_path = model_path

    @property
    def vocab_size(self) -> int:
        """Number of ids (including special ids); the model's embedding must hold them all."""
        raise NotImplementedError

    _eod: int
    _pad: Optional[int] = None

    @property
    def eod(self) -> int:
        """End-of-document id (set by each tokenizer as `_eod`)."""
        return self._eod

    @property
    def pad(self) -> Optional[int]:
        """Padding id (`_pad`), or None when the vocabulary has no padding token."""
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text`` (no EOD appended)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text; equal to ``[self.tokenize(t) for t in texts]``, only faster."""
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        raise NotImplementedError

    @property
    def unique_identifiers(self) -> "OrderedDict[str, str]":
        """What identifies this tokenizer, hashed into Megatron-Core's dataset cache names."""
        ident: OrderedDict[str, str] = OrderedDict()
        ident["class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        ident["tokenizer_path"] = str(self.model_path)
        if self.model_path and os.path.isfile(self.model_path):
            ident["sha256_16"] = _file_digest(self.model_path)
        ident["vocab_size"] = str(self.vocab_size)
        return ident

    @property
    def fingerprint(self) -> str:
        """16 hex digits that change whenever text would map to other ids: a digest of
        `unique_identifiers` (the type, the digests of the model files, the vocab size, the
        split pattern...) without the file locations, so a copied model file keeps it.
        Recorded beside every dataset and in every checkpoint (`data/fingerprint.py`)."""
        ident = {k: v for k, v in self.unique_identifiers.items() if k != "tokenizer_path"}
        blob = json.dumps(ident, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model={self.model_path!r}, vocab_size={self.vocab_size}, "
            f"eod={self.eod}, pad={self.pad})"
        )
