"""Train a SentencePiece tokenizer on jsonl corpora (the engine of ``tools/train_tokenizer.py``).

The input is streamed into a seeded reservoir sample of sentences (deterministic, bounded
memory); over-long pieces are cut, as SentencePiece would silently drop them. The model reserves
``<pad>`` = 0, ``<unk>`` = 1, ``<s>`` = 2, ``</s>`` = 3 (Megatron's ``eod``), uses byte
fallback and identity normalisation.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import sentencepiece

from megatron_ext._paths import display_path
from megatron_ext.config.flags import flag
from megatron_ext.data.readers import DataError, expand_inputs, iter_lines

logger = logging.getLogger(__name__)

__all__ = ["TokenizerTrainingConfig", "sample_sentences", "train_sentencepiece"]

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


@dataclass
class TokenizerTrainingConfig:
    """Settings of a tokenizer training run; the fields are the command line's flags."""

    input: list[str] = flag(
        None, "jsonl files, globs or directories (.jsonl, .jsonl.zst, .json.gz)", nargs="+"
    )
    model_prefix: str = flag(None, "output: <model-prefix>.model and <model-prefix>.vocab")
    json_keys: list[str] = flag(["text"], "json keys to read text from", nargs="+")
    vocab_size: int = flag(
        50000, "vocabulary size including special and byte ids (paper: 50k/100k/200k)"
    )
    model_type: str = flag("bpe", "SentencePiece algorithm", choices=["bpe", "unigram"])
    input_sentence_size: int = flag(
        2_000_000, "sentences sampled (reservoir) for training; bounds memory"
    )
    max_documents: Optional[int] = flag(None, "stop reading input after this many documents")
    max_sentence_length: int = flag(4192, "bytes; longer lines are cut into pieces")
    character_coverage: float = flag(
        0.9995, "fraction of characters the vocabulary covers (the rest: byte fallback or <unk>)"
    )
    byte_fallback: bool = flag(
        True, "disable byte fallback (unknown characters become <unk>)", action="store_false"
    )
    split_digits: bool = flag(
        True,
        "let pieces hold several digits (default: one piece per digit)",
        action="store_false",
    )
    seed: int = flag(1234, "sampling seed")
    num_threads: int = flag(
        1, "training threads (default: the CPU count)", command_line_default=None
    )
    overwrite: bool = flag(False, "replace an existing model")

    def __post_init__(self) -> None:
        if isinstance(self.input, str):
            self.input = [self.input]
        if not self.input or not self.model_prefix:
            raise DataError("--input and --model-prefix are required")
        if self.model_type not in ("bpe", "unigram"):
            raise DataError(f"--model-type must be bpe or unigram, got {self.model_type!r}")
        if self.vocab_size < 300 and self.byte_fallback:
            raise DataError(
                f"--vocab-size {self.vocab_size} is too small: byte fallback alone uses 256 ids "
                "plus 4 special ids; use at least 300"
            )
        if self.input_sentence_size < 1:
            raise DataError("--input-sentence-size must be >= 1")


def _pieces(text: str, max_bytes: int) -> Iterator[str]:
    for line in text.split("\n"):
        if not line.strip():
            continue
        data = line.encode("utf-8")
        if len(data) <= max_bytes:
            yield line
            continue
        start = 0
        while start < len(data):
            end = min(start + max_bytes, len(data))
            while end < len(data) and (data[end] & 0xC0) == 0x80:
                end -= 1  # never split inside a UTF-8 sequence
            yield data[start:end].decode("utf-8")
            start = end


def sample_sentences(config: TokenizerTrainingConfig) -> tuple[list[str], dict]:
    """A seeded reservoir sample of the inputs' sentences, and read statistics (bad lines are
    counted and skipped)."""
    rng = random.Random(config.seed)
    reservoir: list[str] = []
    stats = {"documents": 0, "sentences": 0, "bad_records": 0, "bytes": 0}
    files = expand_inputs(config.input)
    start = time.monotonic()
    for item in files:
        for line_number, raw in iter_lines(item.path):
            if config.max_documents is not None and stats["documents"] >= config.max_documents:
                break
            if not raw.strip():
                continue
            stats["bytes"] += len(raw) + 1
            try:
                record = json.loads(raw.decode("utf-8"))
                texts = [record[key] for key in config.json_keys]
                if not all(isinstance(text, str) for text in texts):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                stats["bad_records"] += 1
                if stats["bad_records"] <= 10:
                    logger.warning("%s:%d: skipped bad record", item.path, line_number)
                continue
            stats["documents"] += 1
            for text in texts:
                for sentence in _pieces(text, config.max_sentence_length):
                    seen = stats["sentences"]
                    stats["sentences"] += 1
                    if seen < config.input_sentence_size:
                        reservoir.append(sentence)
                    else:
                        slot = rng.randrange(seen + 1)
                        if slot < config.input_sentence_size:
                            reservoir[slot] = sentence
            if stats["documents"] % 100_000 == 0:
                elapsed = time.monotonic() - start
                logger.info(
                    "read %d documents (%.1f MB/s)",
                    stats["documents"],
                    stats["bytes"] / elapsed / 1e6,
                )
    if not reservoir:
        raise DataError("no usable text in the input (check --input and --json-keys)")
    return reservoir, stats


def train_sentencepiece(config: TokenizerTrainingConfig) -> str:
    """Train and write ``<model_prefix>.model``/``.vocab`` (temporary names, renamed when
    complete); the ``.model`` path. DataError: bad settings or input, existing output without
    ``overwrite``, or a SentencePiece failure."""
    model_path = config.model_prefix + ".model"
    vocab_path = config.model_prefix + ".vocab"
    if not config.overwrite:
        for path in (model_path, vocab_path):
            if os.path.exists(path):
                raise DataError(f"output exists: {path} (pass --overwrite to replace it)")
    sentences, stats = sample_sentences(config)
    logger.info(
        "sampled %d of %d sentences from %d documents (%d bad records skipped)",
        len(sentences),
        stats["sentences"],
        stats["documents"],
        stats["bad_records"],
    )
    directory = os.path.dirname(os.path.abspath(config.model_prefix))
    os.makedirs(directory, exist_ok=True)
    tmp_prefix = config.model_prefix + ".tmp"
    # SentencePiece's own randomness (unigram seeding, sampling) is seeded process-wide.
    sentencepiece.set_random_generator_seed(config.seed)
    try:
        sentencepiece.SentencePieceTrainer.Train(
            sentence_iterator=iter(sentences),
            model_prefix=tmp_prefix,
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            character_coverage=config.character_coverage,
            byte_fallback=config.byte_fallback,
            split_digits=config.split_digits,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            max_sentence_length=config.max_sentence_length,
            input_sentence_size=0,  # we sampled already
            shuffle_input_sentence=False,
            seed_sentencepiece_size=1_000_000,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_piece="<pad>",
            unk_piece="<unk>",
            bos_piece="<s>",
            eos_piece="</s>",
            hard_vocab_limit=True,
            num_threads=config.num_threads,
            minloglevel=2,
        )
        os.replace(tmp_prefix + ".vocab", vocab_path)
        os.replace(tmp_prefix + ".model", model_path)
    except RuntimeError as error:
        message = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
        raise DataError(f"SentencePiece training failed: {message}") from None
    finally:
        for suffix in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + suffix):
                os.remove(tmp_prefix + suffix)
    logger.info(
        "wrote %s (vocab size %d, %s)",
        display_path(model_path),
        config.vocab_size,
        config.model_type,
    )
    return model_path
