"""Megatron-LM's GPT2BPETokenizer: OpenAI GPT-2's byte-level BPE from a ``vocab.json`` (token ->
id) and a ``merges.txt`` (merge rules, highest priority first), as passed with ``--vocab-file``
and ``--merge-file``; the GPT-2 files many Pile-trained setups use.

Encoding runs on tiktoken: BPE with merge priorities is the same as tiktoken's rank-based BPE
when a token's rank is the priority of the merge that creates it (single bytes first), so the
ranks are built from the merges file and mapped to the ids of ``vocab.json`` afterwards (the two
agree for the published GPT-2 files, but need not in general). EOD is ``<|endoftext|>``.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np
import tiktoken

from megatron_ext.data.tokenizer_base import Tokenizer, TokenizerError, _file_digest

__all__ = ["GPT2BPETokenizer", "bytes_to_unicode"]

# GPT-2's published pre-tokenisation pattern.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used in vocab.json / merges.txt:
    printable Latin-1 bytes map to themselves, the other bytes to code points from 256 on."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE from ``vocab_file`` + ``merge_file`` (no network, no transformers)."""

    type_name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: Optional[str], merge_file: Optional[str]) -> None:
        super().__init__(vocab_file)
        if not vocab_file or not merge_file:
            raise TokenizerError(
                "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"
            )
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not os.path.isfile(path):
                raise TokenizerError(f"{flag}: file not found: {path}")
        self.merge_file = merge_file
        try:
            with open(vocab_file, encoding="utf-8") as handle:
                vocab = json.load(handle)
        except (OSError, ValueError) as error:
            raise TokenizerError(f"--vocab-file {vocab_file}: not a JSON vocabulary ({error})")
        if not isinstance(vocab, dict) or not vocab:
            raise TokenizerError(f"--vocab-file {vocab_file}: expected a JSON object token -> id")
        if ENDOFTEXT not in vocab:
            raise TokenizerError(f"--vocab-file {vocab_file} has no {ENDOFTEXT} token (EOD)")
        decoder = {ch: b for b, ch in bytes_to_unicode().items()}

        def to_bytes(token: str, where: str) -> bytes:
            try:
                return bytes(decoder[ch] for ch in token)
            except KeyError:
                raise TokenizerError(
                    f"{where}: {token!r} is not a GPT-2 byte-level token"
                ) from None

        ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
        with open(merge_file, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                line = line.rstrip("\n")
                if not line or (number == 1 and line.startswith("#version")):
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise TokenizerError(f"{merge_file}:{number}: expected 'left right'")
                merged = to_bytes(parts[0], merge_file) + to_bytes(parts[1], merge_file)
                ranks.setdefault(merged, len(ranks))
        # tiktoken rank -> vocab.json id; every BPE result must be in the vocabulary.
        rank_to_id = np.full(len(ranks), -1, dtype=np.int64)
        for token, token_id in vocab.items():
            if token == ENDOFTEXT:
                continue
            rank = ranks.get(to_bytes(token, vocab_file))
            if rank is not None:
                rank_to_id[rank] = int(token_id)
        missing = int((rank_to_id < 0).sum())
        if missing:
            raise TokenizerError(
                f"{merge_file} creates {missing} token(s) that {vocab_file} lacks; the two files "
                "do not belong together"
            )
        self._enc = tiktoken.Encoding(
            name="gpt2-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={}
        )
        self._rank_to_id = rank_to_id
        self._id_to_bytes = {int(rank_to_id[r]): t for t, r in ranks.items()}
        self._eod = int(vocab[ENDOFTEXT])
        self._vocab_size = max(len(vocab), max(int(i) for i in vocab.values()) + 1)

    @property
    def vocab_size(self) -> int:
        """Number of ids: the larger of vocab.json's entry count and its highest id + 1."""
        return self._vocab_size

    def tokenize(self, text: str) -> list[int]:
        """vocab.json ids of `text` under GPT-2 byte-level BPE (special tokens not recognised)."""
        return self._rank_to_id[self._enc.encode_ordinary(text)].tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`tokenize` of each text in `texts`; an empty list for an empty text."""
        ranks = self._enc.encode_ordinary_batch(list(texts), num_threads=1)
        return [self._rank_to_id[r].tolist() if r else [] for r in ranks]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of `ids`: their bytes joined and decoded as UTF-8 (invalid bytes replaced, unknown
        ids dropped, the EOD id written as <|endoftext|>)."""
        pieces = []
        for i in ids:
            i = int(i)
            pieces.append(ENDOFTEXT.encode() if i == self._eod else self._id_to_bytes.get(i, b""))
        return b"".join(pieces).decode("utf-8", errors="replace")

    @property
    def unique_identifiers(self) -> "OrderedDict[str, str]":
        """The base tokenizer's identifiers plus the merges file's digest (first 16 hex digits of
        its SHA-256), so that data caches of another merges file are not reused."""
        ident = super().unique_identifiers
        ident["merges_sha256_16"] = _file_digest(self.merge_file)
        return ident
