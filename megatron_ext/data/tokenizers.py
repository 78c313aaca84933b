"""Tokenizers with Megatron-LM's names and conventions.

Each exposes ``vocab_size`` (before padding, `megatron_ext.config.data.padded_vocab_size`),
``eod``, ``pad`` (or None), ``tokenize``, ``detokenize``, ``encode_batch`` and
``unique_identifiers`` (hashed by Megatron-Core's dataset cache). ``--tokenizer-type``:
``SentencePieceTokenizer`` (alias ``GPTSentencePieceTokenizer``), ``HuggingFaceTokenizer`` (needs
``transformers``), ``TikTokenizer`` (a local ``.tiktoken`` file) and ``NullTokenizer`` (ids).
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections import OrderedDict
from typing import Optional, Sequence

import sentencepiece
import tiktoken

from megatron_ext.data.gpt2_bpe import GPT2BPETokenizer
from megatron_ext.data.tokenizer_base import Tokenizer, TokenizerError, _file_digest

logger = logging.getLogger(__name__)

__all__ = [
    "TokenizerError",
    "Tokenizer",
    "SentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
    "TOKENIZER_TYPES",
    "build_tokenizer",
    "EXPORT_PROVENANCE_FILE",
    "read_export_provenance",
]


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
_ENDOFTEXT = "<|endoftext|>"
_PAD = "<|pad|>"


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
