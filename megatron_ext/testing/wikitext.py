"""A small file in the Wikitext-103 format, made from any text, for tests and the docs'
worked example (the real `wiki.test.tokens` is downloaded once by users; nothing here fetches).

The format: a blank line, ` = Title = `, a blank line, then paragraphs, each one line with
wikitext's tokenisation (punctuation split off by spaces, `-` inside words as ` @-@ `, digit
group commas and decimal points as ` @,@ ` / ` @.@ `), sections as ` = = Heading = = `.
"""

from __future__ import annotations

import json
import re
from typing import Sequence

from megatron_ext.data.readers import iter_lines

__all__ = ["to_wikitext_line", "write_wikitext"]


def to_wikitext_line(text: str) -> str:
    """`text` tokenised the wikitext way (the inverse of the standard detokeniser's rules)."""
    text = re.sub(r"(?<=\w)-(?=\w)", " @-@ ", text)
    text = re.sub(r"(?<=\d),(?=\d)", " @,@ ", text)
    text = re.sub(r"(?<=\d)\.(?=\d)", " @.@ ", text)
    text = re.sub(r"([.,;:!?()\"])", r" \1 ", text)
    return " " + " ".join(text.split()) + " "


def write_wikitext(path: str, articles: Sequence[tuple[str, Sequence[str]]]) -> str:
    """Write articles (title, paragraphs) to `path` in the wikitext format."""
    lines = []
    for title, paragraphs in articles:
        lines += [" \n", f" = {title} = \n", " \n"]
        for i, paragraph in enumerate(paragraphs):
            if i and i % 2 == 0:
                lines += [f" = = Section {i // 2} = = \n", " \n"]
            lines.append(to_wikitext_line(paragraph) + "\n")
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(lines)
    return path


def wikitext_from_jsonl(jsonl: str, path: str, articles: int = 8) -> str:
    """A wikitext file of the first `articles` documents of a (compressed) jsonl corpus."""
    out = []
    for _, line in iter_lines(jsonl):
        text = json.loads(line)["text"]
        paragraphs = [p for p in text.split("\n") if p.strip()]
        title = " ".join(paragraphs[0].split()[:3]).strip(".,;:!?")
        out.append((title, paragraphs))
        if len(out) == articles:
            break
    return write_wikitext(path, out)
