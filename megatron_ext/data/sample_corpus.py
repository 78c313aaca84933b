"""A deterministic, Pile-format synthetic corpus for demos and tests.

Layout (like the Pile): ``DIR/train/00.jsonl.zst`` ..., ``DIR/val.jsonl.zst``,
``DIR/test.jsonl.zst``; one ``{"text": ..., "meta": {"pile_set_name": ...}}`` per line. A
Zipf-distributed syllable vocabulary (with accented, non-Latin words and numbers), topics per
subset and bigram structure give a model something to learn. The same seed and size give
byte-identical files.
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import zstandard

from megatron_ext._paths import atomic_write, display_path
from megatron_ext.config.flags import flag

logger = logging.getLogger(__name__)

__all__ = ["SUBSETS", "SampleCorpusSpec", "write_sample_corpus", "generate_documents"]

SUBSETS = ("Pile-CC", "Wikipedia (en)", "Github", "ArXiv")
_SUBSET_WEIGHTS = np.array([0.45, 0.25, 0.15, 0.15])
_ONSETS = ["", *"b c d f g h k l m n p r s t v w br ch cl dr fr gr pl pr sh st th tr z".split()]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y", "é", "ö"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng"]
_EXOTIC = ["москва", "東京", "naïve", "café", "straße", "λόγος", "数据", "🙂", "ĳssel", "øre"]
_CODE_KEYWORDS = ["def", "return", "if", "else", "for", "in", "import", "class", "self", "None"]
_MATH = r"\alpha \sum_{i=1}^{n} \frac{1}{2} x^2 \int_0^1 \mathbb{R} = + \leq \lambda".split()


@dataclass
class SampleCorpusSpec:
    """Knobs of the generator (defaults give a few MB in a few seconds); the flagged ones are
    tools/make_sample_corpus.py's."""

    size_mb: float = flag(4.0, "approximate uncompressed size of the train split in MB")
    seed: int = flag(1234, "seed of the generated text")
    num_train_shards: int = flag(1, "train shards", name="--num-shards")
    vocab_words: int = flag(20000, "word types (with Zipf frequencies most of them are rare)")
    zipf_exponent: float = 1.1
    valid_fraction: float = 0.05
    """Size of val and of test, each, relative to train."""
    successor_prob: float = 0.35
    """Probability that a word is followed by its preferred successor."""


def _make_vocabulary(rng: np.random.Generator, n: int) -> list[str]:
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        syllables = int(rng.choice([1, 2, 2, 3, 3, 4], 1)[0])
        word = "".join(
            _ONSETS[rng.integers(len(_ONSETS))]
            + _NUCLEI[rng.integers(len(_NUCLEI))]
            + _CODAS[rng.integers(len(_CODAS))]
            for _ in range(syllables)
        )
        if rng.random() < 0.003:
            word = _EXOTIC[rng.integers(len(_EXOTIC))] + word
        if word and word not in seen:
            seen.add(word)
            words.append(word)
    # Frequent words are short, as in natural language: rank 1 gets the shortest word.
    return sorted(words, key=len)


class _Generator:
    def __init__(self, spec: SampleCorpusSpec) -> None:
        self.spec = spec
        rng = np.random.default_rng(spec.seed)
        self.words = np.array(_make_vocabulary(rng, spec.vocab_words), dtype=object)
        ranks = np.arange(1, spec.vocab_words + 1, dtype=np.float64)
        base = ranks ** (-spec.zipf_exponent)
        self.successor = rng.permutation(spec.vocab_words)
        # Each subset boosts a topic slice of the vocabulary (structure a model can pick up).
        self.probs = []
        for k in range(len(SUBSETS)):
            boost = np.ones(spec.vocab_words)
            topic = rng.choice(spec.vocab_words, size=spec.vocab_words // 20, replace=False)
            boost[topic] = 8.0
            p = base * boost
            self.probs.append(np.cumsum(p / p.sum()))

    def _word_ids(self, rng: np.random.Generator, subset: int, n: int) -> np.ndarray:
        ids = np.searchsorted(self.probs[subset], rng.random(n), side="right")
        ids = np.minimum(ids, self.spec.vocab_words - 1)
        follow = rng.random(n) < self.spec.successor_prob
        for i in np.nonzero(follow)[0]:
            if i > 0:
                ids[i] = self.successor[ids[i - 1]]
        return ids

    def _prose(self, rng: np.random.Generator, subset: int, n_words: int) -> str:
        ids = self._word_ids(rng, subset, n_words)
        words = self.words[ids]
        out = []
        pos = 0
        while pos < n_words:
            length = int(rng.integers(5, 18))
            sentence = list(words[pos : pos + length])
            pos += length
            if not sentence:
                break
            sentence[0] = sentence[0].capitalize()
            if rng.random() < 0.15:
                sentence.insert(int(rng.integers(len(sentence))), str(int(rng.integers(1, 2100))))
            if rng.random() < 0.1 and len(sentence) > 3:
                sentence[1] += ","
            end = "." if rng.random() < 0.85 else ("?" if rng.random() < 0.5 else "!")
            out.append(" ".join(sentence) + end)
            if rng.random() < 0.12:
                out.append("\n\n")
        return " ".join(out).replace(" \n\n ", "\n\n").strip()

    def _code(self, rng: np.random.Generator, n_words: int) -> str:
        ids = self._word_ids(rng, 2, n_words)
        names = [w.replace("é", "e").replace("ö", "o") for w in self.words[ids]]
        lines = []
        i = 0
        while i < len(names):
            fn = names[i]
            args = ", ".join(names[i + 1 : i + 1 + int(rng.integers(0, 3))])
            lines.append(f"def {fn}({args}):")
            for _ in range(int(rng.integers(1, 4))):
                kw = _CODE_KEYWORDS[int(rng.integers(len(_CODE_KEYWORDS)))]
                lines.append(f"    {kw} {names[(i + 3) % len(names)]} = {int(rng.integers(100))}")
            lines.append(f"    return {fn}_{names[(i + 4) % len(names)]}\n")
            i += 6
        return "\n".join(lines)

    def _math(self, rng: np.random.Generator, n_words: int) -> str:
        text = self._prose(rng, 3, n_words)
        symbols = " ".join(_MATH[int(rng.integers(len(_MATH)))] for _ in range(8))
        return f"{text}\n\n$$ {symbols} $$"

    def document(self, rng: np.random.Generator) -> dict:
        subset = int(np.searchsorted(np.cumsum(_SUBSET_WEIGHTS), rng.random(), side="right"))
        subset = min(subset, len(SUBSETS) - 1)
        n_words = int(np.clip(rng.lognormal(mean=5.0, sigma=0.8), 8, 3000))
        if SUBSETS[subset] == "Github":
            text = self._code(rng, n_words)
        elif SUBSETS[subset] == "ArXiv":
            text = self._math(rng, n_words)
        else:
            text = self._prose(rng, subset, n_words)
        return {"text": text, "meta": {"pile_set_name": SUBSETS[subset]}}


def generate_documents(
    spec: SampleCorpusSpec, stream_seed: int, target_bytes: int, generator=None
) -> Iterator[bytes]:
    """Yield jsonl lines (bytes, newline-terminated) until about ``target_bytes``."""
    gen = generator or _Generator(spec)
    rng = np.random.default_rng([spec.seed, stream_seed])
    written = 0
    while written < target_bytes:
        line = (json.dumps(gen.document(rng), ensure_ascii=False) + "\n").encode("utf-8")
        written += len(line)
        yield line


def _write_zst(path: str, lines) -> int:
    buffer = io.BytesIO()
    count = 0
    for line in lines:
        buffer.write(line)
        count += 1
    data = zstandard.ZstdCompressor(level=3, threads=0).compress(buffer.getvalue())
    atomic_write(path, data)
    return count


def write_sample_corpus(output_dir: str, spec: Optional[SampleCorpusSpec] = None) -> dict[str, str]:
    """Write the corpus (``spec.size_mb`` of train text; val and test each
    ``spec.valid_fraction`` of it, at least 64 KB); ``{"train/00": path, ..., "val", "test"}``."""
    spec = spec or SampleCorpusSpec()
    if spec.size_mb <= 0 or spec.num_train_shards < 1:
        raise ValueError("size_mb must be > 0 and num_train_shards >= 1")
    os.makedirs(os.path.join(output_dir, "train"), exist_ok=True)
    paths: dict[str, str] = {}
    total = int(spec.size_mb * 1e6)
    per_shard = max(1, total // spec.num_train_shards)
    gen = _Generator(spec)
    for shard in range(spec.num_train_shards):
        path = os.path.join(output_dir, "train", f"{shard:02d}.jsonl.zst")
        docs = _write_zst(path, generate_documents(spec, shard, per_shard, gen))
        paths[f"train/{shard:02d}"] = path
        logger.info("wrote %s (%d documents)", display_path(path), docs)
    held_out = max(64_000, int(total * spec.valid_fraction))
    for offset, name in enumerate(("val", "test")):
        path = os.path.join(output_dir, f"{name}.jsonl.zst")
        docs = _write_zst(path, generate_documents(spec, 10_000 + offset, held_out, gen))
        paths[name] = path
        logger.info("wrote %s (%d documents)", display_path(path), docs)
    return paths
