"""Tokenizers with Megatron-LM's names and conventions.

Each exposes ``vocab_size`` (before padding, `megatron_ext.config.data.padded_vocab_size`),
``eod``, ``pad`` (or None), ``tokenize``, ``detokenize``, ``encode_batch``, ``fingerprint`` and
``unique_identifiers`` (hashed by Megatron-Core's dataset cache). ``--tokenizer-type``:
``SentencePieceTokenizer`` (alias ``GPTSentencePieceTokenizer``), ``HuggingFaceTokenizer`` (needs
``transformers``), ``TikTokenizer`` (a local ``.tiktoken`` file), ``GPT2BPETokenizer`` (GPT-2's
``vocab.json`` and ``merges.txt``) and ``NullTokenizer`` (ids).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np
import sentencepiece
import tiktoken

__all__ = [
    "TokenizerError",
    "Tokenizer",
    "SentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "GPT2BPETokenizer",
    "NullTokenizer",
    "TOKENIZER_TYPES",
    "build_tokenizer",
    "EXPORT_PROVENANCE_FILE",
    "read_export_provenance",
]


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


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; EOD its ``eos`` id and padding its ``pad`` id, as Megatron-LM's
    GPTSentencePieceTokenizer."""

    type_name = "SentencePieceTokenizer"

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        if not os.path.isfile(model_path):
            raise TokenizerError(f"SentencePiece model not found: {model_path}")
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(model_path)
        except (OSError, RuntimeError) as error:
            raise TokenizerError(
                f"cannot load SentencePiece model {model_path}: {str(error).splitlines()[0]}"
            ) from None
        self._eod = self._sp.eos_id()
        if self._eod < 0:
            raise TokenizerError(
                f"SentencePiece model {model_path} has no eos id to use as end-of-document; "
                "train it with tools/train_tokenizer.py (which reserves one)"
            )
        pad = self._sp.pad_id()
        self._pad = pad if pad >= 0 else None

    @property
    def vocab_size(self) -> int:
        """Number of pieces in the SentencePiece model."""
        return int(self._sp.GetPieceSize())

    def tokenize(self, text: str) -> list[int]:
        """Piece ids of `text`."""
        return self._sp.Encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Piece ids of each text, encoded on one thread."""
        # One thread: preprocessing parallelises over processes, never inside one.
        return self._sp.Encode(list(texts), out_type=int, num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text decoded from piece ids."""
        return self._sp.Decode([int(i) for i in ids])


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face tokenizer saved in a local directory (nothing is downloaded); EOD is
    ``eos_token_id``, ``vocab_size`` is ``len(tokenizer)`` (added tokens included)."""

    type_name = "HuggingFaceTokenizer"

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        if not os.path.isdir(model_path):
            raise TokenizerError(
                f"HuggingFaceTokenizer needs a local directory (save_pretrained output); "
                f"not a directory: {model_path}"
            )
        try:
            # optional: the [eval] extra
            import transformers
        except ImportError:
            raise TokenizerError(
                "HuggingFaceTokenizer needs the optional package transformers: "
                "pip install 'megatron-ext-leviathan[eval]' (or pip install transformers)"
            ) from None
        # Workers are separate processes; the Rust thread pool inside each would oversubscribe.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(
                model_path, local_files_only=True
            )
        except Exception as error:  # transformers raises many types here
            raise TokenizerError(
                f"cannot load Hugging Face tokenizer from {model_path}: "
                f"{str(error).splitlines()[0] if str(error) else type(error).__name__}"
            ) from None
        eod = self._tok.eos_token_id
        if eod is None:
            raise TokenizerError(
                f"Hugging Face tokenizer in {model_path} has no eos_token to use as "
                "end-of-document; set eos_token in its tokenizer_config.json"
            )
        self._eod = int(eod)
        self._pad = None if self._tok.pad_token_id is None else int(self._tok.pad_token_id)

    @property
    def vocab_size(self) -> int:
        """`len(tokenizer)`: the base vocabulary plus added tokens."""
        return len(self._tok)

    def tokenize(self, text: str) -> list[int]:
        """Ids of `text` without the tokenizer's special tokens (BOS/EOS)."""
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text without special tokens, in one batched call."""
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text decoded from ids."""
        return self._tok.decode([int(i) for i in ids])

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the tokenizer this directory was exported from, when
        ``leviathan_tokenizer.json`` (written by ``export-hf``, which reproduces the source's
        ids exactly) says so and the files are unchanged since; else that of its own files."""
        own = super().fingerprint
        provenance = read_export_provenance(self.model_path)
        if provenance and provenance.get("exported_fingerprint") == own:
            return str(provenance["source_fingerprint"])
        return own

    @property
    def unique_identifiers(self) -> "OrderedDict[str, str]":
        """The base identifiers plus digests of the tokenizer files in the directory."""
        ident = super().unique_identifiers
        for name in ("tokenizer.json", "tokenizer.model", "vocab.json"):
            path = os.path.join(self.model_path, name)
            if os.path.isfile(path):
                ident[f"{name}_sha256_16"] = _file_digest(path)
        return ident


# Published pre-tokenisation patterns of OpenAI's encodings; they define how text is split into
# words before BPE, so a .tiktoken rank file is only usable with the pattern it was built for.
_O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
_CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
TIKTOKEN_PATTERNS = {"o200k": _O200K_PATTERN, "cl100k": _CL100K_PATTERN}
# Special-token ids of the published encodings, keyed by the rank file's base name.
_KNOWN_TIKTOKEN_SPECIALS = {
    "o200k_base": {"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
    "cl100k_base": {
        "<|endoftext|>": 100257,
        "<|fim_prefix|>": 100258,
        "<|fim_middle|>": 100259,
        "<|fim_suffix|>": 100260,
        "<|endofprompt|>": 100276,
    },
}
_ENDOFTEXT, _PAD = "<|endoftext|>", "<|pad|>"


def _load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` file: one ``<base64 token> <rank>`` pair per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise TokenizerError(
                    f"{path}:{line_number}: not a .tiktoken file (expected '<base64> <rank>')"
                ) from None
    if not ranks:
        raise TokenizerError(f"{path}: empty .tiktoken file")
    return ranks


class TikTokenizer(Tokenizer):
    """A tiktoken BPE from a local ``.tiktoken`` rank file. The published ``o200k_base`` /
    ``cl100k_base`` files keep their special tokens (EOD ``<|endoftext|>``, no pad); other rank
    files get ``<|endoftext|>`` and ``<|pad|>`` after the highest rank. ``pattern``: a key of
    :data:`TIKTOKEN_PATTERNS` or a regular expression."""

    type_name = "TikTokenizer"

    def __init__(self, model_path: str, pattern: str = "o200k") -> None:
        super().__init__(model_path)
        if not os.path.isfile(model_path):
            raise TokenizerError(f"tiktoken rank file not found: {model_path}")
        ranks = _load_tiktoken_ranks(model_path)
        base = os.path.basename(model_path).split(".")[0]
        if base in _KNOWN_TIKTOKEN_SPECIALS:
            specials = dict(_KNOWN_TIKTOKEN_SPECIALS[base])
        else:
            top = max(ranks.values())
            specials = {_ENDOFTEXT: top + 1, _PAD: top + 2}
        pat_str = TIKTOKEN_PATTERNS.get(pattern, pattern)
        try:
            self._enc = tiktoken.Encoding(
                name=base, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials
            )
        except ValueError as error:
            raise TokenizerError(f"cannot build tiktoken encoding from {model_path}: {error}")
        self._eod = specials[_ENDOFTEXT]
        self._pad = specials.get(_PAD)
        self._pattern = pattern

    @property
    def vocab_size(self) -> int:
        """The encoding's `n_vocab` (ranks plus special tokens)."""
        return int(self._enc.n_vocab)

    @property
    def split_pattern(self) -> str:
        """The regular expression that splits text into pieces before BPE."""
        return TIKTOKEN_PATTERNS.get(self._pattern, self._pattern)

    def tokenize(self, text: str) -> list[int]:
        """BPE ids of `text`, special-token text encoded as ordinary text."""
        # Special-token text inside documents is ordinary text, never a control id.
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """BPE ids of each text (ordinary encoding, one thread)."""
        return self._enc.encode_ordinary_batch(list(texts), num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text decoded from BPE ids."""
        return self._enc.decode([int(i) for i in ids])

    @property
    def unique_identifiers(self) -> "OrderedDict[str, str]":
        """The base identifiers plus the split pattern."""
        ident = super().unique_identifiers
        ident["pattern"] = self._pattern
        return ident


# GPT-2's published pre-tokenisation pattern.
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used in vocab.json / merges.txt:
    printable Latin-1 bytes map to themselves, the other bytes to code points from 256 on."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    keep |= {*range(ord("®"), ord("ÿ") + 1)}
    others = (chr(256 + n) for n in itertools.count())
    return {byte: chr(byte) if byte in keep else next(others) for byte in range(256)}


class GPT2BPETokenizer(Tokenizer):
    """Megatron-LM's GPT2BPETokenizer: GPT-2's byte-level BPE from a ``vocab.json`` (token -> id)
    and a ``merges.txt`` (merge rules, highest priority first); EOD is ``<|endoftext|>``.

    Encoding runs on tiktoken: BPE with merge priorities is tiktoken's rank-based BPE when a
    token's rank is the priority of the merge that creates it (single bytes first), so the ranks
    come from the merges file and map to the ids of ``vocab.json`` afterwards."""

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
        if _ENDOFTEXT not in vocab:
            raise TokenizerError(f"--vocab-file {vocab_file} has no {_ENDOFTEXT} token (EOD)")
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
            if token == _ENDOFTEXT:
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
            name="gpt2-bpe", pat_str=_GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={}
        )
        self._rank_to_id = rank_to_id
        self._id_to_bytes = {int(rank_to_id[r]): t for t, r in ranks.items()}
        self._eod = int(vocab[_ENDOFTEXT])
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
            pieces.append(_ENDOFTEXT.encode() if i == self._eod else self._id_to_bytes.get(i, b""))
        return b"".join(pieces).decode("utf-8", errors="replace")

    @property
    def unique_identifiers(self) -> "OrderedDict[str, str]":
        """The base tokenizer's identifiers plus the merges file's digest (first 16 hex digits of
        its SHA-256), so that data caches of another merges file are not reused."""
        ident = super().unique_identifiers
        # The class's path before data/gpt2_bpe.py joined this module: recorded fingerprints hold.
        ident["class"] = "megatron_ext.data.gpt2_bpe.GPT2BPETokenizer"
        ident["merges_sha256_16"] = _file_digest(self.merge_file)
        return ident


class NullTokenizer(Tokenizer):
    """Megatron-LM's NullTokenizer: text is whitespace-separated integer ids below
    ``--vocab-size``; EOD is the id ``vocab_size`` (so ``vocab_size`` is one more); no padding."""

    type_name = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        super().__init__(None)
        if vocab_size is None or int(vocab_size) <= 0:
            raise TokenizerError("NullTokenizer needs --vocab-size > 0")
        self._n = self._eod = int(vocab_size)  # EOD: the id just past the ordinary ids

    @property
    def vocab_size(self) -> int:
        """`--vocab-size` plus one for the EOD id."""
        return self._n + 1

    def tokenize(self, text: str) -> list[int]:
        """The integers of whitespace-separated `text`, each checked to lie in [0, vocab)."""
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise TokenizerError(
                "NullTokenizer input must be whitespace-separated integers"
            ) from None
        for i in ids:
            if not 0 <= i < self._n:
                raise TokenizerError(f"NullTokenizer id {i} outside [0, {self._n})")
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`tokenize` of each text."""
        return [self.tokenize(text) for text in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        """The ids written as space-separated integers."""
        return " ".join(str(int(i)) for i in ids)

    @property
    def unique_identifiers(self) -> "OrderedDict[str, str]":
        """The base identifiers plus the number of ordinary ids."""
        ident = super().unique_identifiers
        ident["null_vocab_size"] = str(self._n)
        return ident


EXPORT_PROVENANCE_FILE = "leviathan_tokenizer.json"
"""Written into an exported Hugging Face tokenizer directory: ``source_fingerprint`` (the
tokenizer it was converted from), ``source_type``, ``exported_fingerprint`` (its own files)."""


def read_export_provenance(directory: str) -> Optional[dict]:
    """The export record of a Hugging Face tokenizer directory, or None (absent, unreadable)."""
    path = os.path.join(directory, EXPORT_PROVENANCE_FILE)
    try:
        with open(path) as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "source_fingerprint" in record else None


TOKENIZER_TYPES = {
    "SentencePieceTokenizer": SentencePieceTokenizer,
    "GPTSentencePieceTokenizer": SentencePieceTokenizer,
    "HuggingFaceTokenizer": HuggingFaceTokenizer,
    "TikTokenizer": TikTokenizer,
    "NullTokenizer": NullTokenizer,
    "GPT2BPETokenizer": GPT2BPETokenizer,
}


def build_tokenizer(
    tokenizer_type: str, tokenizer_model: Optional[str] = None, **kw: object
) -> Tokenizer:
    """Build a tokenizer by its Megatron-LM type name (:data:`TOKENIZER_TYPES`) from its model
    file or directory; ``**kw``: ``vocab_size`` (NullTokenizer), ``tiktoken_pattern``,
    ``vocab_file`` and ``merge_file`` (GPT2BPETokenizer); other keys are ignored. TokenizerError:
    unknown type, missing or unreadable model."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise TokenizerError(
            f"unknown --tokenizer-type {tokenizer_type!r}; choose one of "
            f"{', '.join(TOKENIZER_TYPES)}"
        )
    cls = TOKENIZER_TYPES[tokenizer_type]
    if cls is NullTokenizer:
        return NullTokenizer(kw.get("vocab_size"))  # type: ignore[arg-type]
    if tokenizer_type == "GPT2BPETokenizer":
        return cls(kw.get("vocab_file"), kw.get("merge_file"))  # type: ignore[call-arg]
    if not tokenizer_model:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
    if cls is TikTokenizer:
        return TikTokenizer(tokenizer_model, pattern=str(kw.get("tiktoken_pattern") or "o200k"))
    return cls(tokenizer_model)
