"""Result files of the evaluation tools, written atomically (temporary name, then rename): an
interrupted run never leaves a half-written table or figure behind."""

from __future__ import annotations

import codecs
import csv
import functools
import io
import json
import math
from typing import Any, Sequence

from megatron_ext._paths import atomic_open, atomic_write

__all__ = [
    "EvaluationError",
    "format_markdown_table",
    "read_text_file",
    "pyplot",
    "save_figure",
    "write_csv",
    "write_json",
]


class EvaluationError(ValueError):
    """Bad evaluation input; the message is one line naming the file and what to do."""


_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"PK\x03\x04": "zip"}


def read_text_file(path: str, encoding: str = "utf-8") -> str:
    """The whole text of ``path`` in ``encoding``; EvaluationError naming the file and byte
    offset (and a compressed format it looks like) for bytes not valid in it."""
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise EvaluationError(
            f"--encoding {encoding!r} is not a text encoding Python knows (e.g. utf-8, latin-1)"
        ) from None
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as error:
        kind = next((k for magic, k in _MAGIC.items() if data.startswith(magic)), None)
        hint = (
            f"it looks like {kind}-compressed data: decompress it first"
            if kind
            else "pass its --encoding (e.g. --encoding latin-1) or convert it to UTF-8"
        )
        raise EvaluationError(
            f"{path} is not valid {encoding} text: byte 0x{data[error.start]:02x} at byte "
            f"offset {error.start} ({error.reason}); {hint}"
        ) from None


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: str, data: Any) -> str:
    """Write `data` to `path` atomically as indented JSON (NaN, inf -> null); returns `path`."""
    return atomic_write(path, json.dumps(_jsonable(data), indent=2) + "\n")


def write_csv(path: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Write `header` and `rows` to `path` atomically as CSV; returns `path`."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return atomic_write(path, buffer.getvalue())


def format_markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; numeric columns right-aligned."""
    texts = [["" if v is None else str(v) for v in row] for row in rows]
    numeric = [
        all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) if rows else False
        for i in range(len(header))
    ]
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---:" if n else "---" for n in numeric) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in texts]
    return "\n".join(lines) + "\n"


@functools.cache
def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), switched to once."""
    # deferred: matplotlib is slow to import and only the plots need it
    import matplotlib.pyplot as plt

    plt.switch_backend("Agg")
    return plt


def save_figure(fig, path: str, dpi: int = 120) -> str:
    """Save a matplotlib figure as PNG atomically and close it."""
    plt = pyplot()
    try:
        with atomic_open(path, "wb") as handle:
            fig.savefig(handle, format="png", dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path
