"""Wikitext-103 zero-shot perplexity from a local `wiki.test.tokens` (or `.raw`) file.

Each article (from its ` = Title = ` heading line to the next) is detokenised with the standard
wikitext rules (`detokenize`), tokenised with the run's tokenizer, preceded by the EOD token (so
its first token is scored too) and scored with rolling windows of `context` tokens advancing by
`stride`: each token is scored once, in the first window that ends at or after it, so it sees at
least `context - stride` tokens of context (fewer near the article start). Word perplexity
divides the same total loss by the whitespace-separated words of the original articles, as
published wikitext results do.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from megatron_ext.evaluation.outputs import EvaluationError, read_text_file
from megatron_ext.evaluation.scoring import Batch, micro_batches

__all__ = [
    "Window",
    "detokenize",
    "read_wikitext",
    "rolling_windows",
    "window_batches",
]

_TITLE = re.compile(r"^ = [^=].*[^=] = $")

# The standard wikitext detokenisation, applied in order.
_LITERAL_RULES = [("s '", "s'"), (" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", ".")]
_LITERAL_RULES += [(f" {mark} ", f"{mark} ") for mark in ":;.!?,"]
# Spaces inside brackets and quotes: "( x )" -> "(x)".
_BRACKET_RULES = [
    (re.compile(rf"{re.escape(a)}\s*([^{re.escape(b)}]*?)\s*{re.escape(b)}"), rf"{a}\1{b}")
    for a, b in ("()", "[]", "{}", '""', "''")
]
_TAIL_RULES = [
    ("= = = =", "===="),
    ("= = =", "==="),
    ("= =", "=="),
    (" \u00b0 ", "\u00b0"),
    (" \n", "\n"),
    ("\n ", "\n"),
    (" N ", " 1 "),
    (" 's", "'s"),
]


def detokenize(text: str) -> str:
    """Undo wikitext's tokenisation (` @-@ `, spaces around punctuation and brackets)."""
    for old, new in _LITERAL_RULES:
        text = text.replace(old, new)
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)
    for pattern, replacement in _BRACKET_RULES:
        text = pattern.sub(replacement, text)
    for old, new in _TAIL_RULES:
        text = text.replace(old, new)
    return text


def read_wikitext(path: str, encoding: str = "utf-8") -> list[str]:
    """The articles of a wikitext file, each from its ` = Title = ` line to the next one;
    EvaluationError: missing file, bad ``encoding``, or no article heading."""
    if not os.path.isfile(path):
        raise EvaluationError(
            f"wikitext file {path} does not exist; download wikitext-103 once (see "
            "docs/evaluation.md) and pass wiki.test.tokens"
        )
    lines = read_text_file(path, encoding).splitlines(keepends=True)
    articles: list[list[str]] = []
    for line in lines:
        if _TITLE.match(line.rstrip("\n")):
            articles.append([])
        if articles:
            articles[-1].append(line)
        elif line.strip():
            raise EvaluationError(
                f"{path} is not in the wikitext format: text before the first ' = Title = ' "
                "heading line; pass wiki.test.tokens or wiki.test.raw from wikitext-103"
            )
    if not articles:
        raise EvaluationError(
            f"{path} is not in the wikitext format (no ' = Title = ' heading line); pass "
            "wiki.test.tokens or wiki.test.raw from wikitext-103"
        )
    return ["".join(a).strip("\n") + "\n" for a in articles]


@dataclass(frozen=True)
class Window:
    """One scoring window over a token stream t[0..n] (t[0] the EOD before the article):
    inputs t[start:end], labels t[start+1:end+1]; labels at stream positions > `scored_after`
    are scored."""

    start: int
    end: int
    scored_after: int


def rolling_windows(num_targets: int, context: int, stride: int) -> list[Window]:
    """Windows scoring targets 1..num_targets once each: window k ends at min(context + k *
    stride, n), takes the `context` tokens before it and scores those the previous did not."""
    if context < 1 or not 1 <= stride <= context:
        raise EvaluationError(f"need 1 <= --stride <= --context, got {stride} and {context}")
    windows = []
    done = 0
    end = min(context, num_targets)
    while done < num_targets:
        windows.append(Window(start=max(0, end - context), end=end, scored_after=done))
        done = end
        end = min(end + stride, num_targets)
    return windows


def window_batches(
    streams: Sequence[np.ndarray], context: int, stride: int, micro_batch_size: int
) -> Iterator[Batch]:
    """Micro-batches [b, context] of every window of every stream (padded and masked)."""
    rows = (
        (stream[w.start : w.end], stream[w.start + 1 : w.end + 1], w.scored_after - w.start)
        for stream in streams
        for w in rolling_windows(len(stream) - 1, context, stride)
    )
    return micro_batches(rows, context, micro_batch_size)


def prepare_streams(articles: Sequence[str], tokenizer) -> tuple[list[np.ndarray], int, int]:
    """EOD + tokens of each detokenised article; (streams, target tokens, original words)."""
    ids = tokenizer.encode_batch([detokenize(a) for a in articles])
    streams = [np.asarray([tokenizer.eod, *x], dtype=np.int64) for x in ids]
    words = sum(len(a.split()) for a in articles)
    return streams, sum(len(s) - 1 for s in streams), words
