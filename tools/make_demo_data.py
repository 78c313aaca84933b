"""Make the small demo data the docs' worked examples use, from any jsonl corpus (no network).

    python tools/make_demo_data.py wikitext --input CORPUS.jsonl.zst --output FILE --articles N
    python tools/make_demo_data.py lm-eval-tasks --input CORPUS.jsonl.zst --output DIR --items N

``wikitext``: a file in the Wikitext-103 format and tokenisation from the corpus's first N
documents. ``lm-eval-tasks``: four tiny lm-evaluation-harness tasks in its local-file format
(``tiny_lambada``, ``tiny_piqa``, ``tiny_wikitext``, ``tiny_gen``), N documents each.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
from typing import Iterator, Optional, Sequence

from megatron_ext._paths import atomic_write
from megatron_ext.cli import run_tool
from megatron_ext.config.flags import ArgumentParser
from megatron_ext.data.readers import DataError, iter_lines

TINY_TASKS = ("tiny_lambada", "tiny_piqa", "tiny_wikitext", "tiny_gen")


def _texts(jsonl: str) -> Iterator[str]:
    """The ``text`` of each line of the corpus ``jsonl``; a `DataError` naming the file and
    the line for a line that is not a JSON object with a ``text`` string."""
    for number, line in iter_lines(jsonl):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
            reason = str(error).splitlines()[0]
            raise DataError(f"{jsonl} line {number}: not a UTF-8 JSON line ({reason})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(
                f'{jsonl} line {number}: expected a JSON object with a "text" string, one '
                "document a line"
            )
        text = record["text"]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # a lone surrogate, escaped in the JSON
            raise DataError(
                f'{jsonl} line {number}: invalid Unicode in "text" (lone surrogate '
                f"U+{ord(text[error.start]):04X}); fix or drop that line"
            ) from None
        yield text


def _write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (its directory created if needed) through a temporary file
    beside it, renamed when complete."""
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise DataError(f"cannot create the directory {directory}: {error.strerror}") from None
    try:
        atomic_write(path, text)
    except OSError as error:
        raise DataError(f"cannot write {path}: {error.strerror}") from None


def to_wikitext_line(text: str) -> str:
    """``text`` tokenised the wikitext way (the inverse of the standard detokeniser's rules)."""
    text = re.sub(r"(?<=\w)-(?=\w)", " @-@ ", text)
    text = re.sub(r"(?<=\d),(?=\d)", " @,@ ", text)
    text = re.sub(r"(?<=\d)\.(?=\d)", " @.@ ", text)
    text = re.sub(r"([.,;:!?()\"])", r" \1 ", text)
    return " " + " ".join(text.split()) + " "


def wikitext_from_jsonl(jsonl: str, path: str, articles: int = 8) -> str:
    """A wikitext file at ``path`` of the first ``articles`` documents of the corpus ``jsonl``
    (documents without text are skipped): the title is the first three words, two paragraphs a
    section; returns ``path``. A `DataError` for unreadable or malformed input, or fewer
    documents."""
    if articles < 1:
        raise DataError(f"articles must be at least 1, got {articles}")
    documents = ([p for p in text.split("\n") if p.strip()] for text in _texts(jsonl))
    out = list(itertools.islice(filter(None, documents), articles))
    if len(out) < articles:
        raise DataError(
            f"{jsonl} has {len(out)} documents with text, fewer than the {articles} articles "
            "asked for; ask for fewer or use a larger corpus"
        )
    lines = []
    for paragraphs in out:
        title = " ".join(paragraphs[0].split()[:3]).strip(".,;:!?")
        lines += [" \n", f" = {title} = \n", " \n"]
        for i, paragraph in enumerate(paragraphs):
            if i and i % 2 == 0:
                lines += [f" = = Section {i // 2} = = \n", " \n"]
            lines.append(to_wikitext_line(paragraph) + "\n")
    _write_text(path, "".join(lines))
    return path


_YAML_HEAD = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: {output_type}
test_split: test
{body}metadata:
  version: 1.0
"""
# Each task's output type and its own lines (the head's `body`).
_YAML = {
    "tiny_lambada": ("loglikelihood", """doc_to_text: "{{text.split(' ')[:-1]|join(' ')}}"
doc_to_target: "{{' '+text.split(' ')[-1]}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""),
    "tiny_piqa": ("multiple_choice", """doc_to_text: "{{goal}}"
doc_to_target: label
doc_to_choice: "{{[sol1, sol2]}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""),
    "tiny_wikitext": ("loglikelihood_rolling", """doc_to_text: ""
doc_to_target: "{{page}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""),
    "tiny_gen": ("generate_until", """doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_punctuation: true
    ignore_case: true
"""),
}  # fmt: skip


def _sentences(jsonl: str) -> Iterator[str]:
    """Sentences of at least six words, in corpus order, without their final period."""
    for text in _texts(jsonl):
        for sentence in text.replace("\n", " ").split(". "):
            words = sentence.strip().rstrip(".").split()
            if len(words) >= 6:
                yield " ".join(words)


def write_tiny_tasks(jsonl: str, directory: str, items: int = 6) -> str:
    """Write the four tasks (YAML + jsonl data, ``items`` documents each) into ``directory``
    (the YAML files name their data by absolute path); returns ``directory``, the harness's
    ``include_path``. A `DataError` for unreadable or malformed input, or fewer than
    ``2 * items`` sentences of six or more words."""
    if items < 1:
        raise DataError(f"items must be at least 1, got {items}")
    sentences = list(itertools.islice(_sentences(jsonl), 2 * items))
    if len(sentences) < 2 * items:
        raise DataError(
            f"{jsonl} has {len(sentences)} sentences of six or more words; {items} items per "
            f"task need {2 * items}: ask for fewer or use a larger corpus"
        )
    rows = {
        "tiny_lambada": [{"text": s} for s in sentences[:items]],
        "tiny_piqa": [],
        "tiny_wikitext": [{"page": f"{a}. {b}."} for a, b in zip(sentences[::2], sentences[1::2])],
        "tiny_gen": [],
    }
    for i in range(items):
        words, other = sentences[i].split(), sentences[items + i].split()
        half = len(words) // 2
        rows["tiny_piqa"].append(
            {"goal": " ".join(words[:half]), "sol1": " ".join(words[half:]),
             "sol2": " ".join(other[len(other) // 2 :]), "label": 0}
        )  # fmt: skip
        rows["tiny_gen"].append({"question": " ".join(words[:-1]), "answer": words[-1]})
    for task, data in rows.items():
        data_path = os.path.join(directory, f"{task}.jsonl")
        _write_text(data_path, "".join(json.dumps(row) + "\n" for row in data))
        output_type, body = _YAML[task]
        data = json.dumps(os.path.abspath(data_path))
        yaml = _YAML_HEAD.format(task=task, data=data, output_type=output_type, body=body)
        _write_text(os.path.join(directory, f"{task}.yaml"), yaml)
    return directory


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line: the `wikitext` and `lm-eval-tasks` sub-commands."""
    parser = ArgumentParser(
        prog="make_demo_data.py",
        description="Make the small demo data of the docs' examples from a jsonl corpus.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    corpus = 'the jsonl corpus (.jsonl, .jsonl.zst or .jsonl.gz), one {"text": ...} a line'
    for name, text, description, output, count in (
        ("wikitext", "a Wikitext-103 format file (for `evaluate.py wikitext --file`)",
         "Write the corpus's first documents as a file in the Wikitext-103 format\n"
         "(what `evaluate.py wikitext --file` reads).",
         ("FILE", "the file to write (its directory is created if needed)"),
         ("--articles", 8, "how many documents become articles")),
        ("lm-eval-tasks",
         "four tiny lm-evaluation-harness tasks (for `evaluate.py lm-eval --include-path`)",
         "Write four tiny lm-evaluation-harness tasks (tiny_lambada, tiny_piqa,\n"
         "tiny_wikitext, tiny_gen: task YAML + jsonl data) made of the corpus's sentences.",
         ("DIR", "the directory to write the tasks into (created if needed)"),
         ("--items", 6, "documents per task; the corpus needs 2N sentences of six or more words")),
    ):  # fmt: skip
        command = commands.add_parser(name, help=text, description=description)
        command.add_argument("--input", required=True, metavar="CORPUS", help=corpus)
        command.add_argument("--output", required=True, metavar=output[0], help=output[1])
        flag, default, count_help = count
        command.add_argument(flag, type=_positive, default=default, metavar="N", help=count_help)
    return parser


def _main(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "wikitext":
        wikitext_from_jsonl(args.input, args.output, articles=args.articles)
        print(f"wrote {args.articles} articles to {args.output}")
    else:
        write_tiny_tasks(args.input, args.output, items=args.items)
        print(f"wrote {', '.join(TINY_TASKS)} ({args.items} items each) to {args.output}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv``, write the demo data, return the exit code (2 for bad input)."""
    return run_tool(_main, argv, errors=(DataError,), log_format=None)


if __name__ == "__main__":
    raise SystemExit(main())
